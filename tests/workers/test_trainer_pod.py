"""The trainer exits with the contract's "bad spec or data" code (and leaves its message where Kubernetes reads it)
when its task cannot work, so that the trainer Job's podFailurePolicy fails the job at once instead of restarting."""

from __future__ import annotations

import socket

from grpolora.api import contract
from grpolora.api.contract import WorkerEnv
from grpolora.api.load import parse_job
from grpolora.api.plan import plan
from grpolora.workers.trainer.main import run_rank
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
