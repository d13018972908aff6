"""`grpolora run` end to end, as a user runs it: a trainer and two vLLM inference replicas as Ray actors on this
machine, a tiny model, real adapter sync every step; then a second run resumes from the checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from grpolora.api.status import TrainerStatus
from grpolora.testing.servers import alive, descendants
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
            "promptsPerStep": 2,
            "generationsPerPrompt": 4,
            "maxNewTokens": 16,
            "learningRate": 1.0e-3,
        },
        "task": {"name": "keyword"},
        "trainer": {"gpusPerReplica": 0},
        "inference": {"replicas": 2, "gpusPerReplica": 0, "kvCacheGiB": 1, "maxModelLen": 256},
        "sync": {"backend": "gloo", "timeoutSeconds": 60},
        "checkpoint": {"everySteps": 2},
    },
}


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


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local-run")
    run_dir = tmp / "run"
    result = grpolora_run(JOB, tmp, run_dir)
    assert result.returncode == 0, result.stderr[-6000:]
    return tmp, run_dir, result


def test_every_step_syncs_with_exact_logprobs(first_run):
    _, run_dir, result = first_run
    steps = records(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["sync_round"] for r in steps] == [1, 2, 3]  # syncRound equals steps
    assert all(r["on_policy"] and r["rollout_version"] == r["step"] - 1 for r in steps)
    worst = max(r["mismatch_max_abs"] for r in steps)
    print(f"largest |logprob_trainer - logprob_vllm| over the run: {worst:.2e}")
    assert worst <= 1e-3
    assert all(r["sync_bytes"] > 0 and r["seconds"]["sync"] > 0 for r in steps)
    assert "mean reward, first 3 steps" in result.stdout


def test_run_folder_holds_adapter_plot_logs_and_final_status(first_run):
    _, run_dir, _ = first_run
    from peft import PeftConfig

    config = PeftConfig.from_pretrained(run_dir / "final-adapter")  # the standard peft format
    assert config.r == 8
    assert (run_dir / "plot.png").stat().st_size > 10_000
    assert {p.name for p in (run_dir / "logs").iterdir()} == {"trainer-0.log", "inference-0.log", "inference-1.log"}
    status = TrainerStatus.model_validate_json((run_dir / "status.json").read_text())
    assert status.phase == "Succeeded" and status.step == status.total_steps == 3 and status.sync_round == 3
    assert set(status.sync_members) == {0, 1}


def test_status_contract_is_the_documented_one():
    documented = (ROOT / "docs" / "status.md").read_text()
    for field in TrainerStatus.model_fields.values():
        assert f"`{field.alias}`" in documented, f"document {field.alias} in docs/status.md"


def test_a_second_run_resumes_from_the_checkpoint_and_pipelines(first_run):
    tmp, run_dir, _ = first_run
    longer = json.loads(json.dumps(JOB))
    longer["spec"]["grpo"]["steps"] = 5
    longer["spec"]["grpo"]["pipelined"] = True
    result = grpolora_run(longer, tmp, run_dir)
    assert result.returncode == 0, result.stderr[-6000:]
    steps = records(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]  # the step count continues
    rounds = [r["sync_round"] for r in steps]
    assert rounds == sorted(rounds) and len(set(rounds)) == 5  # and sync rounds never go back
    assert steps[3]["epoch"] > steps[2]["epoch"]
    # Pipelined: step 5's rollouts were generated while step 4 trained, from the adapter before step 4's update.
    assert steps[3]["on_policy"] and not steps[4]["on_policy"]
    assert steps[4]["rollout_version"] == steps[3]["rollout_version"] < steps[3]["sync_round"]
    # Step 4's checkpoint was written while step 5's prompts were already being generated: they are not counted
    # as consumed, so a restart from it generates them again instead of skipping them.
    state = torch.load(run_dir / "checkpoints" / "step-00000004" / "trainer_state.pt", weights_only=False)
    assert state["progress"]["prompts_consumed"] == 4 * JOB["spec"]["grpo"]["promptsPerStep"]


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
    result = grpolora_run(job, tmp_path, tmp_path / "run")
    assert result.returncode == 1
    assert "exited with code 1" in result.stderr and "model path /nonexistent/model does not exist" in result.stderr
    leftovers = subprocess.run(["pgrep", "-f", "grpolora.cli worker"], capture_output=True, text=True).stdout
    assert not leftovers.strip(), f"worker processes left running: {leftovers}"


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
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stderr.readline, "")))
        self._reader.start()

    def wait_for(self, words: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not any(words in line for line in self.lines):
            assert self.proc.poll() is None, "".join(self.lines)[-6000:]
            assert time.monotonic() < deadline, f"never saw {words!r}:\n" + "".join(self.lines)[-6000:]
            time.sleep(0.2)

    def finish(self, timeout: float = 900) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    @property
    def stderr(self) -> str:
        return "".join(self.lines)


def healing_job(name: str, steps: int) -> dict:
    job = json.loads(json.dumps(JOB))
    job["metadata"]["name"] = name
    job["spec"]["grpo"]["steps"] = steps
    return job


def test_a_sigkilled_inference_replica_is_restarted_and_rejoins_while_the_run_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    run = RunningCommand(healing_job("heal", 24), tmp_path, run_dir)
    try:
        run.wait_for("step 2/24")
        (server,) = worker_pids("heal", "inference", 1)
        engine = descendants(server)
        assert engine, "the inference server has no engine processes"
        os.kill(server, signal.SIGKILL)  # the server process alone, as the OOM killer would
        time.sleep(5)
        assert not [p for p in engine if alive(p)], "vLLM's engine processes outlived their server"
        run.wait_for("inference 1 exited with code -9; starting it again (restart 1 of 3)")
        run.wait_for("2 replica(s) in sync, inference restarts 1")  # the replacement is back in the group
        code = run.finish()
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
    assert code == 0, run.stderr[-6000:]
    assert [r["step"] for r in records(run_dir)] == list(range(1, 25))
    status = TrainerStatus.model_validate_json((run_dir / "status.json").read_text())
    assert status.phase == "Succeeded" and status.inference_restarts == 1 and status.sync_members == [0, 1]
    assert "--- grpolora run: exited with code -9; restart 1 ---" in (run_dir / "logs" / "inference-1.log").read_text()


def test_ctrl_c_is_quick_leaves_nothing_behind_and_the_rerun_records_each_step_once(tmp_path):
    run_dir = tmp_path / "run"
    job = healing_job("interrupted", 6)
    run = RunningCommand(job, tmp_path, run_dir)
    try:
        run.wait_for("step 3/6")  # the checkpoint is at step 2
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
    assert code == 130, run.stderr[-4000:]
    assert seconds < 20, run.stderr[-4000:]
    for role, index in (("trainer", 0), ("inference", 0), ("inference", 1)):
        assert not worker_pids("interrupted", role, index), f"{role} {index} left running"
    assert not list(Path("/dev/shm").glob("grpolora-adapters-interrupted-*")), "adapter folders left in /dev/shm"
    status = TrainerStatus.model_validate_json((run_dir / "status.json").read_text())
    assert status.phase == "Failed" and status.step >= 3 and "run it again to resume" in (status.message or "")
    assert any(r["step"] == 3 for r in records(run_dir))

    again = grpolora_run(job, tmp_path, run_dir)
    assert again.returncode == 0, again.stderr[-6000:]
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4, 5, 6]  # step 3 once, from the resumed run
