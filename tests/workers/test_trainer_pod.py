"""One trainer pod: its exit code (the contract's "bad spec or data" codes must reach Kubernetes, so that the trainer
Job's podFailurePolicy fails the job at once instead of restarting), its last words on SIGTERM, and its ranks'
waiting for rank 0 — with one rank, and with several ranks in one pod process (a pod with several GPUs), run here
on CPUs with gloo."""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpolora.api import contract
from grpolora.api.contract import WorkerEnv
from grpolora.api.load import parse_job
from grpolora.api.plan import plan
from grpolora.testing.servers import tiny_cpu_job
from grpolora.workers.trainer.main import pod_exit_code, run_rank
from grpolora.workers.trainer.policy import missing_target_modules
from grpolora.workers.trainer.ranks import Instruction, broadcast_instruction, instruction_group
from tests.helpers import job_doc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_task_that_cannot_load_exits_with_the_invalid_data_code_and_its_message(tmp_path, monkeypatch):
    termination_log = tmp_path / "termination-log"
    monkeypatch.setattr(contract, "TERMINATION_LOG", str(termination_log))
    job = parse_job(
        job_doc(
            task={"dataset": {"path": str(tmp_path / "missing.jsonl")}, "reward": "no_such_module:score"},
            trainer={"gpusPerReplica": 0, "statusPort": free_port()},
            inference={"gpusPerReplica": 0},
            checkpoint={"path": str(tmp_path / "ckpt")},
        )
    )
    env = WorkerEnv.from_environ({**plan(job).env_for("trainer", 0, token="t"), contract.BIND_ADDR: "127.0.0.1"})
    assert run_rank(env, local_rank=0) == contract.EXIT_INVALID_DATA
    assert termination_log.read_text().startswith("spec.task.")


def test_a_pod_of_several_ranks_exits_with_the_code_that_forbids_a_retry():
    # A rank killed by a signal reads as 128 + signal, as a shell and the kubelet report it.
    assert pod_exit_code([contract.EXIT_INVALID_DATA, -signal.SIGTERM]) == contract.EXIT_INVALID_DATA
    assert pod_exit_code([1, contract.EXIT_INVALID_SPEC]) == contract.EXIT_INVALID_SPEC  # whichever rank said it
    assert pod_exit_code([-signal.SIGTERM, 1]) == 128 + signal.SIGTERM  # rank 0's word first
    assert pod_exit_code([0, 1]) == 1
    assert pod_exit_code([0, None]) == 0


def pod_process(tmp_path: Path, **overrides) -> tuple[list[str], dict[str, str], Path]:
    """`grpolora worker trainer` for a pod with two ranks on CPUs (LOCAL_WORLD_SIZE 2): the command, its env and
    the folder of its status.json."""
    job_plan = tiny_cpu_job(checkpoint={"path": str(tmp_path / "ckpt")}, **overrides)
    environ = job_plan.env_for("trainer", 0, token="t") | {
        contract.BIND_ADDR: "127.0.0.1",
        contract.WORLD_SIZE: "2",
        contract.LOCAL_WORLD_SIZE: "2",
    }
    command = [sys.executable, "-P", "-m", "grpolora.cli", "worker", "trainer"]
    return command, os.environ | environ, tmp_path / "ckpt"


def test_two_ranks_in_one_pod_keep_the_invalid_data_code(tmp_path):
    """torch's start_processes raised ProcessExitedException for the failed rank: the pod exited 1 with a traceback,
    and the operator restarted a job that can only fail the same way."""
    command, environ, _ = pod_process(
        tmp_path, task={"dataset": {"path": str(tmp_path / "missing.jsonl")}, "reward": "no_such_module:score"}
    )
    left_before = Path(contract.TERMINATION_LOG).exists()
    try:
        run = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=300)
    finally:  # rank 0 leaves its message where the kubelet reads it; this machine is not a pod
        if not left_before:
            Path(contract.TERMINATION_LOG).unlink(missing_ok=True)
    assert run.returncode == contract.EXIT_INVALID_DATA, run.stderr[-3000:]
    assert "ProcessExitedException" not in run.stderr


def test_sigterm_to_a_pod_of_two_ranks_reaches_rank_0_which_writes_status_json(tmp_path):
    """The kubelet signals the pod's process only. Its ranks got SIGINT when it died (torch's pdeathsig), which
    torch's wrapper swallows: rank 0 never wrote status.json, and the pod's code was the signal's, not rank 0's."""
    # No inference server answers: rank 0 waits to form the sync group, the state a SIGTERM finds it in here.
    command, environ, folder = pod_process(tmp_path, inference={"port": free_port()})
    status_port = int(environ[contract.STATUS_PORT])
    log = tmp_path / "pod.log"  # a file, not a pipe: a pipe nobody reads fills up and blocks the ranks' logging
    with log.open("w") as out:
        pod = subprocess.Popen(command, env=environ, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:  # rank 0 serves /health once its SIGTERM handling is in place
            assert pod.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "rank 0 never answered /health"
            try:
                if httpx.get(f"http://127.0.0.1:{status_port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        pod.send_signal(signal.SIGTERM)
        code = pod.wait(timeout=120)
    finally:
        if pod.poll() is None:
            pod.kill()
    assert (folder / "status.json").exists(), (code, log.read_text()[-3000:])
    status = json.loads((folder / "status.json").read_text())
    assert status["phase"] == "Failed" and "stopped by SIGTERM" in status["message"]
    assert code == 128 + signal.SIGTERM


def _ranks_wait_for_rank_0(rank: int, port: int, folder: str) -> None:
    # The default group gets a 2-second timeout, as NCCL's watchdog gives a collective its (10 minutes by default).
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=2),
    )
    group = instruction_group(2)
    try:
        if rank == 0:
            time.sleep(5)  # alone: forming the sync group, generating, evaluating...
            received = broadcast_instruction(Instruction(stop=True), 2, group)
        else:
            received = broadcast_instruction(None, 2, group)
        Path(folder, f"rank-{rank}").write_text("stop" if received.stop else "go")
    finally:
        dist.destroy_process_group()


def test_followers_survive_rank_0_working_alone_past_the_collective_timeout(tmp_path):
    """Followers waited for rank 0's next instruction inside a broadcast on the default group: past its timeout
    (gloo: 'Timed out waiting 2000ms for recv operation'; NCCL: the watchdog aborts) they died while rank 0 was
    only busy. Instructions now travel on a gloo group of their own with a long timeout."""
    mp.start_processes(_ranks_wait_for_rank_0, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    assert {p.name: p.read_text() for p in tmp_path.glob("rank-*")} == {"rank-0": "stop", "rank-1": "stop"}


def test_a_target_module_the_model_lacks_exits_with_the_invalid_spec_code_naming_it(tmp_path, monkeypatch):
    """`q_projj` passes validation (the model is not at hand there); the trainer, which loads the model, refuses it
    naming the module and the linear layers there are, with the code that forbids a retry."""
    termination_log = tmp_path / "termination-log"
    monkeypatch.setattr(contract, "TERMINATION_LOG", str(termination_log))
    job = parse_job(
        job_doc(
            model={"name": "offline:tiny-llama", "dtype": "float32"},
            lora={"targetModules": ["q_proj", "q_projj"]},
            trainer={"gpusPerReplica": 0, "statusPort": free_port()},
            inference={"gpusPerReplica": 0},
            checkpoint={"path": str(tmp_path / "ckpt")},
        )
    )
    env = WorkerEnv.from_environ({**plan(job).env_for("trainer", 0, token="t"), contract.BIND_ADDR: "127.0.0.1"})
    assert run_rank(env, local_rank=0) == contract.EXIT_INVALID_SPEC
    message = termination_log.read_text()
    assert message.startswith("spec.lora.targetModules: 'q_projj' names no module of offline:tiny-llama"), message
    assert "q_proj, " in message and "v_proj" in message


def test_target_modules_match_by_peft_rule_full_name_or_dotted_suffix():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].self_attn = torch.nn.Module()
    model.layers[0].self_attn.q_proj = torch.nn.Linear(2, 2)
    names = ["q_proj", "self_attn.q_proj", "layers.0.self_attn.q_proj", "q_projj", "attn.q_proj", "proj"]
    assert missing_target_modules(model, names) == ["q_projj", "attn.q_proj", "proj"]
