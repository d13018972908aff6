"""The reconcile decision for a job with spec.environment.server (issue 48): its StatefulSet `<job>-env` is created
with the other workloads, removed on suspend and at the end as the inference servers' are, counted in the job's
readiness (status.replicas.environment, PodsReady, Kueue's PodsReady) and in the leaving workloads of a job being
deleted."""

from __future__ import annotations

import datetime
from typing import Any

from grpolora.api import constants as c
from grpolora.api.plan import plan
from grpolora.api.status import JobStatus
from grpolora.operator import names
from grpolora.operator.job_workloads import children
from grpolora.operator.reconcile import ChildRef, Observed, decide, decide_deleting
from tests.unit.test_operator_reconcile import (
    NOW,
    applied_view,
    condition,
    report,
    statefulset,
    trainer_job,
)

SERVER = {"builtin": "calculator", "server": {"replicas": 2}}


def view(**spec: Any):
    return applied_view(environment=SERVER, **spec)


def env_sts(ready: int = 0, **meta: Any) -> dict[str, Any]:
    return {
        "kind": "StatefulSet",
        "metadata": {"name": "demo-env", "labels": {c.LABEL_ROLE: c.ROLE_ENVIRONMENT}, **meta},
        "status": {"readyReplicas": ready},
    }


def running_status(env_ready: int = 2) -> JobStatus:
    observed = Observed(
        trainer_job(active=1, ready=1), statefulset(1), trainer=report(step=1), environment=env_sts(env_ready)
    )
    return decide(view(), JobStatus(), observed, NOW - datetime.timedelta(hours=1)).status


def test_a_new_job_gets_its_three_workloads_exactly_as_rendered():
    """Keyed by kind, the rendered workloads had one StatefulSet: the environment server's replaced the inference
    servers' and the job never got its replicas."""
    job_view = view()
    decision = decide(job_view, JobStatus(), Observed(), NOW)
    assert [(o["kind"], o["metadata"]["name"]) for o in decision.create] == [
        ("Job", "demo-trainer"),
        ("StatefulSet", "demo-inference"),
        ("StatefulSet", "demo-env"),
    ]
    assert job_view.job is not None
    _, rendered = children(plan(job_view.job), uid="uid-1", token="unused")
    assert decision.create[2] == rendered[c.ROLE_ENVIRONMENT]
    assert decision.status.replicas.environment is not None
    assert decision.status.replicas.environment.desired == 2


def test_only_the_missing_server_is_created_again():
    observed = Observed(trainer_job(active=1, ready=1), statefulset(1), trainer=report(step=1))
    decision = decide(view(), running_status(), observed, NOW)
    assert [(o["kind"], o["metadata"]["name"]) for o in decision.create] == [("StatefulSet", "demo-env")]


def test_pods_ready_waits_for_every_server_pod_and_progress_for_one():
    def decided(env_ready: int):
        observed = Observed(
            trainer_job(active=1, ready=1), statefulset(1), trainer=report(step=1), environment=env_sts(env_ready)
        )
        return decide(view(), running_status(), observed, NOW)

    whole = decided(2)
    assert condition(whole, names.PODS_READY) == ("True", names.R_ALL_READY)
    assert whole.status.ready == "4/4" and whole.create == ()
    one_short = decided(1)  # a server pod lost: the StatefulSet controller counts one ready
    pods_ready = next(k for k in one_short.status.conditions if k.type == names.PODS_READY)
    assert pods_ready.status == "False" and "environment 1/2 ready" in pods_ready.message
    assert one_short.status.phase == "Running" and one_short.create == () and one_short.delete == ()
    assert one_short.status.replicas.environment is not None and one_short.status.replicas.environment.ready == 1


def test_kueue_pods_ready_needs_one_server_pod(monkeypatch):
    """Kueue's PodsReady (what waitForPodsReady evicts on) says the job can make progress: not without a server."""
    from grpolora.api.status import RoleReplicas
    from grpolora.operator import readiness

    assert readiness.makes_progress(1, 1, RoleReplicas(desired=1, ready=1), RoleReplicas(desired=2, ready=1))
    assert not readiness.makes_progress(1, 1, RoleReplicas(desired=1, ready=1), RoleReplicas(desired=2, ready=0))
    assert readiness.makes_progress(1, 1, RoleReplicas(desired=1, ready=1), None)


def test_suspend_removes_the_server_and_the_end_releases_it():
    observed = Observed(trainer_job(active=1), statefulset(1), environment=env_sts(2))
    suspended = decide(view(suspend=True), running_status(), observed, NOW)
    assert set(suspended.delete) == {
        ChildRef("Job", "demo-trainer"),
        ChildRef("StatefulSet", "demo-inference"),
        ChildRef("StatefulSet", "demo-env"),
    }
    assert suspended.status.replicas.environment is not None
    assert suspended.status.replicas.environment.desired == 0
    ended = Observed(trainer_job(condition="Complete"), statefulset(1), environment=env_sts(2))
    done = decide(view(), running_status(), ended, NOW)
    assert done.status.phase == "Succeeded"
    assert set(done.delete) == {ChildRef("StatefulSet", "demo-inference"), ChildRef("StatefulSet", "demo-env")}


def test_a_job_being_deleted_watches_its_leaving_server():
    leaving = env_sts(0, uid="sts-uid", deletionTimestamp="2026-01-01T11:59:00Z", finalizers=["foregroundDeletion"])
    decision = decide_deleting(view(), running_status(), Observed(environment=leaving), NOW)
    assert decision.requeue_after is not None and not decision.idle


def test_a_server_without_requests_is_warned_of_as_best_effort():
    """Its pods run BestEffort (evicted first under node pressure), as `grpolora validate` says of the other roles."""
    from grpolora.api.load import best_effort_roles, parse_job
    from tests.helpers import job_doc

    sized = {"requests": {"cpu": "1", "memory": "1Gi"}}
    job = parse_job(
        job_doc(trainer={"resources": sized}, inference={"resources": sized}, environment=SERVER)
    )
    assert best_effort_roles(job) == ["spec.environment.server"]
    served = {**SERVER, "server": {**SERVER["server"], "resources": sized}}
    sized_job = parse_job(job_doc(trainer={"resources": sized}, inference={"resources": sized}, environment=served))
    assert best_effort_roles(sized_job) == []
    decision = decide(view(), JobStatus(), Observed(), NOW)
    found = next(k for k in decision.status.conditions if k.type == names.PODS_BEST_EFFORT)
    assert "spec.environment.server.resources" in found.message


def test_the_suspend_message_names_the_server_among_what_is_removed():
    observed = Observed(trainer_job(active=1), statefulset(1), environment=env_sts(2))
    suspended = decide(view(suspend=True), running_status(), observed, NOW)
    assert "environment server" in (suspended.status.message or "")


def test_the_startup_deadline_fails_a_job_with_no_server_ready_and_only_reports_one_with_one():
    """Every trainer rank and replica up, the server's pods not (an image that cannot be pulled, a RuntimeClass no
    node has): past spec.scheduling.startupDeadlineSeconds the job cannot play an episode, so it fails and gives its
    pods back; with one server pod ready it trains, and the deadline is only reported."""
    job_view = view(scheduling={"startupDeadlineSeconds": 600})
    first = decide(job_view, JobStatus(), Observed(), NOW)

    def after(env_ready: int):
        observed = Observed(trainer_job(active=1, ready=1), statefulset(1), environment=env_sts(env_ready))
        return decide(job_view, first.status, observed, NOW + datetime.timedelta(seconds=601))

    none_ready = after(0)
    assert none_ready.status.phase == "Failed"
    assert condition(none_ready, names.FAILED) == ("True", names.R_STARTUP_DEADLINE)
    assert "environment 0/2 ready" in (none_ready.status.message or "")
    assert ChildRef("StatefulSet", "demo-env") in none_ready.delete
    one_ready = after(1)
    assert one_ready.status.phase != "Failed"
    assert condition(one_ready, names.PODS_READY) == ("False", names.R_STARTUP_DEADLINE)


def test_a_network_policy_as_the_api_server_returns_it_is_not_written_again():
    """policy_rewrite compares what a real API server returns: a port's protocol defaulted to TCP, the sandbox's
    `egress: []` read back as no egress key (omitempty). A changed egress is written whole, and a key the built spec
    lacks removed."""
    from grpolora.operator.builders import environment_network_policy
    from grpolora.operator.job_writes import policy_rewrite

    open_egress = [{"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}], "ports": [{"port": 443}]}]
    job_view = applied_view(environment={"builtin": "calculator", "server": {"egress": open_egress}})
    assert job_view.job is not None
    built = environment_network_policy(plan(job_view.job))
    stored = {"spec": {**built["spec"], "egress": [{**open_egress[0], "ports": [{"port": 443, "protocol": "TCP"}]}]}}
    assert policy_rewrite(stored, built) is None

    closed = applied_view(environment={"builtin": "calculator", "server": {}})
    assert closed.job is not None
    built_closed = environment_network_policy(plan(closed.job))
    assert built_closed["spec"]["egress"] == []
    read_back = {"spec": {key: value for key, value in built_closed["spec"].items() if key != "egress"}}
    assert policy_rewrite(read_back, built_closed) is None
    rewrite = policy_rewrite(stored, built_closed)
    assert rewrite is not None and rewrite["spec"]["egress"] == []
    extra = {"spec": {**built_closed["spec"], "somethingElse": {"x": 1}}}
    assert policy_rewrite(extra, built_closed) == {"spec": {**built_closed["spec"], "somethingElse": None}}
