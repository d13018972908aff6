"""Partial admission without Kueue: one pool's pods ready, the other's not. After spec.scheduling
startupDeadlineSeconds the job says so with the scheduler's reason, and (onStartupDeadline: Fail) fails and
releases the pool that did start."""

from __future__ import annotations

import datetime

from grpolora.api.crd import crd
from grpolora.api.load import parse_job, parse_runtime
from grpolora.api.runtime import resolve
from grpolora.api.spec import SchedulingSpec
from grpolora.api.status import JobStatus
from grpolora.operator import names
from grpolora.operator.reconcile import ChildRef, Observed, decide
from tests.unit.test_operator_reconcile import NOW, applied_view, condition, statefulset, trainer_job
from tests.unit.test_runtime import on_runtime, runtime_doc

UNSCHEDULABLE = {
    "metadata": {"name": "demo-trainer-0-abcde", "labels": {"grpolora.dev/role": "trainer"}},
    "status": {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
            }
        ],
    },
}
# Inference is up on its pool; the trainer's pod cannot be scheduled.
HALF = Observed(trainer_job(active=1), statefulset(1), pods=(UNSCHEDULABLE,))


def later(seconds: float) -> datetime.datetime:
    return NOW + datetime.timedelta(seconds=seconds)


def waited(spec: dict, seconds: float):
    """The children were created at NOW (PodsReady False since then); a pass `seconds` later."""
    view = applied_view(scheduling=spec)
    first = decide(view, JobStatus(), Observed(), NOW)
    return view, decide(view, first.status, HALF, later(seconds))


def test_before_the_deadline_the_job_waits_as_before():
    _, decision = waited({"startupDeadlineSeconds": 600, "onStartupDeadline": "Report"}, 599)
    assert decision.status.phase == "Pending" and condition(decision, names.PODS_READY)[1] == "Unschedulable"


def test_after_the_deadline_the_job_reports_it_with_the_schedulers_reason():
    _, decision = waited({"startupDeadlineSeconds": 600, "onStartupDeadline": "Report"}, 601)
    assert decision.status.phase == "Pending"
    assert condition(decision, names.PODS_READY) == ("False", names.R_STARTUP_DEADLINE)
    assert "0/4 nodes are available: 4 Insufficient nvidia.com/gpu." in decision.status.message
    assert "600" in decision.status.message
    assert names.E_PODS_NOT_READY in [e.reason for e in decision.events]
    assert decision.delete == ()


def test_on_fail_the_job_fails_and_releases_the_pool_that_started():
    _, decision = waited({"startupDeadlineSeconds": 600, "onStartupDeadline": "Fail"}, 601)
    assert decision.status.phase == "Failed" and decision.status.completion_time is not None
    assert condition(decision, names.FAILED) == ("True", names.R_STARTUP_DEADLINE)
    assert "Insufficient nvidia.com/gpu" in decision.status.message
    assert set(decision.delete) == {ChildRef("Job", "demo-trainer"), ChildRef("StatefulSet", "demo-inference")}


def test_zero_turns_the_deadline_off_and_the_job_waits_for_ever():
    view = applied_view(scheduling={"startupDeadlineSeconds": 0})
    first = decide(view, JobStatus(), Observed(), NOW)
    decision = decide(view, first.status, HALF, later(10 * 24 * 3600))
    assert decision.status.phase == "Pending" and condition(decision, names.PODS_READY)[1] == "Unschedulable"


DEFAULT = SchedulingSpec.model_fields["startup_deadline_seconds"].default


def test_by_default_a_job_whose_trainer_cannot_start_fails_and_gives_the_started_pools_gpus_back():
    """A job that says nothing about scheduling does not hold its inference GPUs for ever while its trainer's pods
    wait: the spec's default deadline (half an hour, long enough for a multi-GB image pull on a fresh GPU node and a
    model download) passes, and it fails, releasing both workloads."""
    assert DEFAULT == 1800
    assert SchedulingSpec().on_startup_deadline == "Fail"
    view = applied_view()
    first = decide(view, JobStatus(), Observed(), NOW)
    assert decide(view, first.status, HALF, later(DEFAULT - 1)).status.phase == "Pending"
    decision = decide(view, first.status, HALF, later(DEFAULT + 1))
    assert decision.status.phase == "Failed"
    assert condition(decision, names.FAILED) == ("True", names.R_STARTUP_DEADLINE)
    assert set(decision.delete) == {ChildRef("Job", "demo-trainer"), ChildRef("StatefulSet", "demo-inference")}


def test_a_job_that_trains_while_one_replica_is_missing_is_reported_not_failed():
    """The default Fail releases GPUs held idle, never a job that makes progress: its trainer runs on the replicas
    it has (a lost or unschedulable replica rejoins at the next sync round), so past the deadline it is only
    reported."""
    view = applied_view(inference={"replicas": 2})
    first = decide(view, JobStatus(), Observed(), NOW)
    short = Observed(trainer_job(active=1, ready=1), statefulset(1), pods=(UNSCHEDULABLE,))
    decision = decide(view, first.status, short, later(DEFAULT + 1))
    assert decision.status.phase != "Failed" and decision.delete == ()
    assert condition(decision, names.PODS_READY) == ("False", names.R_STARTUP_DEADLINE)
    assert "inference 1/2 ready" in decision.status.message


def test_a_runtimes_deadline_wins_over_the_default_and_the_jobs_zero_over_the_runtimes():
    """The default is the model's, applied after the merge (no server-side default in the CRD), so a runtime's
    value reaches the jobs that leave the field out, and a job's 0 turns the runtime's deadline off."""
    runtime = parse_runtime(runtime_doc(scheduling={"startupDeadlineSeconds": 3600, "onStartupDeadline": "Report"}))
    resolved = resolve(parse_job(on_runtime()), runtime).spec.scheduling
    assert (resolved.startup_deadline_seconds, resolved.on_startup_deadline) == (3600, "Report")
    off = resolve(parse_job(on_runtime(scheduling={"startupDeadlineSeconds": 0})), runtime).spec.scheduling
    assert off.startup_deadline_seconds == 0
    field = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    schema = field["scheduling"]["properties"]["startupDeadlineSeconds"]
    assert "default" not in schema and schema["minimum"] == 0 and not schema.get("exclusiveMinimum")
    assert "Default: 1800" in schema["description"] and "0: no deadline" in schema["description"]
