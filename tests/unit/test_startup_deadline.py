"""Partial admission without Kueue: one pool's pods ready, the other's not. After spec.scheduling
startupDeadlineSeconds the job says so with the scheduler's reason, and (onStartupDeadline: Fail) fails and
releases the pool that did start."""

from __future__ import annotations

import datetime

from grpolora.api.status import JobStatus
from grpolora.operator import names
from grpolora.operator.reconcile import ChildRef, Observed, decide
from tests.unit.test_operator_reconcile import NOW, applied_view, condition, statefulset, trainer_job

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
    _, decision = waited({"startupDeadlineSeconds": 600}, 599)
    assert decision.status.phase == "Pending" and condition(decision, names.PODS_READY)[1] == "Unschedulable"


def test_after_the_deadline_the_job_reports_it_with_the_schedulers_reason():
    _, decision = waited({"startupDeadlineSeconds": 600}, 601)
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


def test_without_a_deadline_the_job_waits_for_ever():
    view = applied_view()
    first = decide(view, JobStatus(), Observed(), NOW)
    decision = decide(view, first.status, HALF, later(10 * 24 * 3600))
    assert decision.status.phase == "Pending" and condition(decision, names.PODS_READY)[1] == "Unschedulable"
