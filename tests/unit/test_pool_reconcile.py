"""The pure decision of one pass of a job on a RolloutPool (grpolora.operator.reconcile.decide with the pool)."""

from __future__ import annotations

import json

from grpolora.api.status import AttachedJob, JobStatus, PoolStatus, RoleReplicas
from grpolora.operator import names
from grpolora.operator.job_view import job_view, spec_json
from grpolora.operator.pools import PoolView
from grpolora.operator.reconcile import ChildRef, Observed, decide
from tests.unit.test_operator_reconcile import NOW, body, trainer_job
from tests.unit.test_pool import pool

ON_POOL = {"model": {"name": "Qwen/Qwen3-0.6B", "dtype": "bfloat16"}, "inference": {"poolRef": {"name": "shared"}}}


def view(**spec):
    merged = {**ON_POOL, **spec}
    first = job_view(body(**merged))
    assert first.job is not None
    doc = body(applied=json.loads(spec_json(first.job.spec)), **merged)
    doc["metadata"]["namespace"] = "rl"
    return job_view(doc)


def shared(*attached: str, waiting: tuple[str, ...] = (), ready: int = 2, desired: int = 2, **spec) -> PoolView:
    status = PoolStatus(
        attached_jobs=[AttachedJob(job=key, uid="uid-1") for key in attached],
        waiting_jobs=list(waiting),
        replicas=RoleReplicas(desired=desired, ready=ready),
    )
    return PoolView("shared", pool(**spec), status)


def attached_before() -> JobStatus:
    return decide(view(), JobStatus(), Observed(pool=shared("rl/demo")), NOW).status


def test_an_attached_job_creates_only_its_trainer_and_counts_the_pools_replicas():
    decision = decide(view(), JobStatus(), Observed(pool=shared("rl/demo")), NOW)
    assert [o["kind"] for o in decision.create] == ["Job"]
    status = decision.status
    assert status.pool == "shared" and status.replicas.inference == RoleReplicas(desired=2, ready=2)
    attached = next(c for c in status.conditions if c.type == names.POOL_ATTACHED)
    assert (attached.status, attached.reason) == ("True", names.R_POOL_ATTACHED)
    assert status.rendezvous.inference_endpoints[0] == "http://shared-pool-0.shared-pool.rl.svc:8000"


def test_a_waiting_job_creates_nothing_and_says_its_place_in_line():
    decision = decide(view(), JobStatus(), Observed(pool=shared("rl/x", "rl/y", waiting=("rl/z", "rl/demo"))), NOW)
    assert decision.create == () and decision.status.phase == "Pending"
    assert decision.status.message == "2nd in line for RolloutPool shared (2/4 jobs attached)"
    attached = next(c for c in decision.status.conditions if c.type == names.POOL_ATTACHED)
    assert (attached.status, attached.reason) == ("False", names.R_WAITING_FOR_POOL)  # 2/4: not full


def test_a_job_no_longer_listed_loses_its_trainer_and_waits():
    decision = decide(
        view(), attached_before(), Observed(trainer_job=trainer_job(active=1), pool=shared(waiting=("rl/demo",))), NOW
    )
    assert decision.delete == (ChildRef("Job", "demo-trainer"),) and decision.status.phase == "Pending"


def test_a_job_that_does_not_fit_fails_at_once_naming_each_field():
    decision = decide(view(lora={"rank": 64}), JobStatus(), Observed(pool=shared(maxLoraRank=32)), NOW)
    assert decision.status.phase == "Failed" and decision.create == () and decision.idle
    failed = next(c for c in decision.status.conditions if c.type == names.FAILED)
    assert failed.reason == names.R_POOL_MISMATCH
    assert failed.message == (
        "cannot run on RolloutPool rl/shared: spec.lora.rank: 64 is above RolloutPool shared's maxLoraRank (32); "
        "use at most it"
    )


def test_without_its_pool_a_job_waits_unless_it_ran_on_it():
    missing = Observed(pool=PoolView("shared", None, PoolStatus()))
    waiting = decide(view(), JobStatus(), missing, NOW)
    assert waiting.status.phase == "Pending" and waiting.create == ()
    assert next(c for c in waiting.status.conditions if c.type == names.POOL_ATTACHED).reason == names.R_POOL_NOT_FOUND

    gone = decide(view(), attached_before(), Observed(trainer_job=trainer_job(active=1), pool=missing.pool), NOW)
    assert gone.status.phase == "Failed" and gone.status.completion_time is not None
    assert gone.delete == (ChildRef("Job", "demo-trainer"),)
    assert next(c for c in gone.status.conditions if c.type == names.FAILED).reason == names.R_POOL_DELETED
    # Finished: it stays so, and nothing more is deleted.
    after = decide(view(), gone.status, Observed(pool=missing.pool), NOW)
    assert after.status == gone.status and after.delete == () and after.idle


def test_a_pool_job_whose_trainer_never_starts_fails_at_its_startup_deadline():
    """spec.scheduling.startupDeadlineSeconds holds for a job on a pool too (its only pods are the trainer's): with
    onStartupDeadline Fail it fails, naming the scheduler's reason, and gives its pool slot back."""
    from tests.unit.test_startup_deadline import UNSCHEDULABLE, later

    on_pool = view(scheduling={"startupDeadlineSeconds": 600, "onStartupDeadline": "Fail"})
    first = decide(on_pool, JobStatus(), Observed(pool=shared("rl/demo")), NOW)
    stuck = Observed(trainer_job=trainer_job(active=1), pods=(UNSCHEDULABLE,), pool=shared("rl/demo"))
    assert decide(on_pool, first.status, stuck, later(599)).status.phase == "Pending"
    decision = decide(on_pool, first.status, stuck, later(601))
    assert decision.status.phase == "Failed"
    failed = next(c for c in decision.status.conditions if c.type == names.FAILED)
    assert failed.reason == names.R_STARTUP_DEADLINE
    assert "trainer 0/1 ready" in failed.message and "4 Insufficient nvidia.com/gpu" in failed.message
    assert ChildRef("Job", "demo-trainer") in decision.delete


def test_a_scale_up_of_its_pool_that_cannot_be_placed_never_fails_an_attached_job():
    """The pool scaled from 2 to 3 and its new replica cannot be scheduled: the job trains on the 2 it has. The
    pool's capacity is the pool's to report (its Ready condition, its events), not a reason to fail its jobs at
    their startup deadline; a pool with no ready server still is (the job cannot start)."""
    from tests.unit.test_startup_deadline import later

    on_pool = view(scheduling={"startupDeadlineSeconds": 600, "onStartupDeadline": "Fail"})
    first = decide(on_pool, JobStatus(), Observed(pool=shared("rl/demo")), NOW)
    trained = Observed(trainer_job=trainer_job(active=1, ready=1), pool=shared("rl/demo"))
    running = decide(on_pool, first.status, trained, later(10))
    scaled = Observed(trainer_job=trainer_job(active=1, ready=1), pool=shared("rl/demo", desired=3, ready=2))
    status = decide(on_pool, running.status, scaled, later(20)).status
    assert status.replicas.inference == RoleReplicas(desired=3, ready=2)  # what kubectl get glj shows
    decision = decide(on_pool, status, scaled, later(20 + 601))
    assert decision.status.phase != "Failed" and decision.delete == ()
    none_ready = Observed(trainer_job=trainer_job(active=1, ready=1), pool=shared("rl/demo", desired=3, ready=0))
    status = decide(on_pool, running.status, none_ready, later(20)).status
    assert decide(on_pool, status, none_ready, later(20 + 601)).status.phase == "Failed"
