"""The trainer's exit codes that the operator reads (grpolora.api.contract): a fenced trainer is told apart from a
crash, and its code is the one the trainer Job's podFailurePolicy names."""

from __future__ import annotations

from grpolora.api import contract
from grpolora.api.load import parse_job
from grpolora.api.plan import plan
from grpolora.operator import builders
from grpolora.workers.sync.control import StaleIncarnation
from grpolora.workers.trainer.main import exit_code
from tests.helpers import job_doc


def test_a_fenced_trainer_exits_with_the_code_its_jobs_failure_policy_names():
    assert exit_code(StaleIncarnation("inference replica 0: trainer incarnation 1 is older than 2")) == 79
    assert contract.EXIT_FENCED == 79 and exit_code(RuntimeError("x")) == 1
    job = next(
        o
        for o in builders.build_children(plan(parse_job(job_doc())), owner_uid="u", token="t")
        if o["kind"] == "Job"
    )
    codes = [r["onExitCodes"]["values"] for r in job["spec"]["podFailurePolicy"]["rules"] if "onExitCodes" in r]
    assert [contract.EXIT_FENCED] in codes
