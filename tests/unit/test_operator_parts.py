"""The operator's small parts: pod diagnosis, trainer folding, peering rule, metrics names, RBAC shape, API paths."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from grpolora.api.status import AttachedJob, JobStatus, PoolStatus, RendezvousStatus, RoleReplicas, TrainerStatus
from grpolora.operator import kube, observe, rbac
from grpolora.operator.metrics import Metrics
from grpolora.operator.observe import fold_trainer, why_not_ready
from grpolora.operator.peering import outranked

NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)


def pod(name: str, phase: str = "Pending", conditions=(), containers=()) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "status": {"phase": phase, "conditions": list(conditions), "containerStatuses": list(containers)},
    }


def waiting(reason: str, message: str = "") -> dict[str, Any]:
    return {"name": "worker", "state": {"waiting": {"reason": reason, "message": message}}}


UNSCHEDULABLE = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/4 nodes: gpu"}


@pytest.mark.parametrize(
    ("pods", "reason", "fragment"),
    [
        ([], None, None),
        ([pod("a", conditions=[UNSCHEDULABLE])], "Unschedulable", "a: 0/4 nodes: gpu"),
        ([pod("a", containers=[waiting("ImagePullBackOff", "pull denied")])], "ImagePullBackOff", "a: pull denied"),
        ([pod("a", containers=[waiting("ContainerCreating")])], "ContainerCreating", "a: container worker"),
        (
            [pod("a", conditions=[UNSCHEDULABLE]), pod("b", containers=[waiting("CrashLoopBackOff", "exit 1")])],
            "CrashLoopBackOff",  # the worse reason wins
            "b: exit 1",
        ),
        ([pod("a", phase="Running", conditions=[{"type": "Ready", "status": "False"}])], "NotReady", "a: running"),
        ([pod("a", phase="Running", conditions=[{"type": "Ready", "status": "True"}])], None, None),
        ([pod("a", phase="Failed")], None, None),  # the Job's business
    ],
    ids=["none", "unschedulable", "image", "creating", "worst-wins", "not-ready", "ready", "finished"],
)
def test_why_pods_are_not_ready(pods, reason, fragment):
    found = why_not_ready(pods)
    if reason is None:
        assert found is None
    else:
        assert found is not None and found.reason == reason and fragment in found.message


def test_a_crash_loop_says_how_the_container_last_ended():
    """The kubelet's CrashLoopBackOff message is only 'back-off 5m0s restarting failed container=...': what went
    wrong is in lastState.terminated, whose message is the log's tail under FallbackToLogsOnError (builders.py),
    e.g. a pool's server exiting 78 on a model it cannot load. Its exit code and last log line are reported."""
    container = waiting("CrashLoopBackOff", "back-off 5m0s restarting failed container=server pod=pool-0")
    container["lastState"] = {
        "terminated": {
            "exitCode": 78,
            "reason": "Error",
            "message": "INFO starting\nerror: spec.model.name: no config.json in /models/x\n\n",
        }
    }
    found = why_not_ready([pod("pool-0", phase="Running", containers=[container])])
    assert found is not None and found.reason == "CrashLoopBackOff"
    assert "pool-0: back-off 5m0s" in found.message
    assert "last exit 78: error: spec.model.name: no config.json in /models/x" in found.message
    assert "INFO" not in found.message  # the last line, not the whole tail


def test_why_names_at_most_three_pods():
    found = why_not_ready([pod(f"p{i}", conditions=[UNSCHEDULABLE]) for i in range(5)])
    assert found is not None and found.message.count("0/4 nodes") == 3 and "(and 2 more)" in found.message


@pytest.mark.parametrize(
    ("old_round", "reported_round", "expected_round", "takes_sync_figures"),
    [(None, 2, 2, True), (2, 2, 2, True), (2, 5, 5, True), (5, 2, 5, False)],
)
def test_fold_keeps_sync_round_monotonic(old_round, reported_round, expected_round, takes_sync_figures):
    old = JobStatus(sync_round=old_round, last_sync_seconds=1.0)
    report = TrainerStatus(
        phase="Running", total_steps=10, step=reported_round, sync_round=reported_round, last_sync_seconds=2.0
    )
    progress = fold_trainer(old, report)
    assert progress.sync_round == expected_round
    assert progress.last_sync_seconds == (2.0 if takes_sync_figures else 1.0)


@pytest.mark.parametrize(
    ("old_step", "old_lost", "reported", "step", "lost"),
    [
        (None, None, 3, 3, None),
        (3, None, 5, 5, None),
        (15, None, 0, 0, 15),  # restarted from scratch (checkpoints in an emptyDir went with the pod)
        (15, None, 10, 10, 5),  # resumed from the checkpoint of step 10
        (4, 15, 2, 2, 17),  # lost again after an earlier loss
    ],
)
def test_fold_reports_the_step_actually_reached_and_the_steps_lost(old_step, old_lost, reported, step, lost):
    old = JobStatus(step=old_step, steps_lost=old_lost)
    progress = fold_trainer(old, TrainerStatus(phase="Running", total_steps=20, step=reported))
    assert (progress.step, progress.steps_lost) == (step, lost)


def test_fold_without_a_report_keeps_everything():
    rendezvous = RendezvousStatus(
        master_addr="a",
        master_port=1,
        trainer_world_size=1,
        sync_addr="a",
        sync_port=2,
        sync_world_size=2,
        sync_backend="gloo",
        epoch=4,
    )
    old = JobStatus(step=3, sync_round=3, reward_mean=0.25, rendezvous=rendezvous)
    progress = fold_trainer(old, None)
    assert (progress.step, progress.sync_round, progress.reward_mean, progress.epoch) == (3, 3, 0.25, 4)


def peer(priority: int, seconds_ago: float, lifetime: int = 60) -> dict[str, Any]:
    lastseen = (NOW - datetime.timedelta(seconds=seconds_ago)).isoformat()
    return {"priority": priority, "lastseen": lastseen, "lifetime": lifetime}


@pytest.mark.parametrize(
    ("peers", "paused"),
    [
        ({}, False),
        ({"me": peer(5, 0)}, False),
        ({"me": peer(5, 0), "other": peer(3, 0)}, False),
        ({"me": peer(5, 0), "other": peer(7, 0)}, True),
        ({"me": peer(5, 0), "other": peer(5, 0)}, True),  # a tie pauses both, as in Kopf
        ({"me": peer(5, 0), "other": peer(7, 120)}, False),  # dead peer
        ({"me": peer(5, 0), "other": "garbage"}, False),
    ],
    ids=["alone-empty", "alone", "lower", "higher", "tie", "dead", "malformed"],
)
def test_peering_rule(peers, paused):
    assert outranked(peers, identity="me", priority=5, now=NOW) is paused


def test_metrics_have_the_agreed_names_and_labels():
    metrics = Metrics()
    metrics.set_job(
        "ns", "a", JobStatus(phase="Running", step=7, sync_round=6, last_sync_seconds=0.5, last_sync_bytes=9)
    )
    metrics.set_job("ns", "b", JobStatus(phase="Pending"))
    with metrics.timed("reconcile"):
        pass
    with pytest.raises(RuntimeError), metrics.timed("monitor"):
        raise RuntimeError("boom")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
    }
    job = (("job", "a"), ("namespace", "ns"))
    assert samples[("grpolora_jobs", (("phase", "Running"),))] == 1
    assert samples[("grpolora_jobs", (("phase", "Pending"),))] == 1
    assert samples[("grpolora_jobs", (("phase", "Failed"),))] == 0
    assert samples[("grpolora_job_sync_rounds_total", job)] == 6
    assert samples[("grpolora_job_step", job)] == 7
    assert samples[("grpolora_job_last_sync_seconds", job)] == 0.5
    assert samples[("grpolora_job_last_sync_bytes", job)] == 9
    assert samples[("grpolora_reconcile_errors_total", (("handler", "monitor"),))] == 1
    assert samples[("grpolora_reconcile_errors_total", (("handler", "reconcile"),))] == 0
    assert samples[("grpolora_reconcile_duration_seconds_count", (("handler", "reconcile"),))] == 1
    metrics.forget_job("ns", "a")
    assert 'job="a"' not in metrics.exposition().decode()


def test_pool_metrics_count_replicas_jobs_and_lora_slots_per_pool():
    metrics = Metrics()
    status = PoolStatus(
        replicas=RoleReplicas(desired=3, ready=2),
        attached_jobs=[AttachedJob(job="ns/a"), AttachedJob(job="ns/b")],
        waiting_jobs=["ns/c"],
        waiting=1,
        slots=8,
        slots_in_use=4,
    )
    metrics.set_pool("ns", "shared", status)
    metrics.set_pool("ns", "new", PoolStatus())  # no pass has written its status yet: zeros, not gaps
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
    }
    pool = (("namespace", "ns"), ("pool", "shared"))
    assert samples[("grpolora_pool_replicas_desired", pool)] == 3
    assert samples[("grpolora_pool_replicas_ready", pool)] == 2
    assert samples[("grpolora_pool_jobs_attached", pool)] == 2
    assert samples[("grpolora_pool_jobs_waiting", pool)] == 1
    assert samples[("grpolora_pool_lora_slots", pool)] == 8
    assert samples[("grpolora_pool_lora_slots_free", pool)] == 4
    assert samples[("grpolora_pool_replicas_ready", (("namespace", "ns"), ("pool", "new")))] == 0
    metrics.forget_pool("ns", "shared")
    assert 'pool="shared"' not in metrics.exposition().decode()


def test_rbac_rules_have_the_shape_the_chart_test_reads():
    assert isinstance(rbac.RULES, tuple) and rbac.RULES
    for rule in rbac.RULES:
        assert dataclasses.is_dataclass(rule) and type(rule).__dataclass_params__.frozen
        assert [f.name for f in dataclasses.fields(rule)] == ["api_groups", "resources", "verbs", "reason"]
        for values in (rule.api_groups, rule.resources, rule.verbs):
            assert isinstance(values, tuple) and all(isinstance(v, str) for v in values)
        assert rule.reason.strip()
        assert set(rule.verbs) <= {"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}
    # Least privilege: no listing or watching of Secrets (only `get` of the job's own token Secret by name, to check
    # its owner), nothing cluster-wide beyond Kopf's own peering objects.
    assert not rbac.allowed("list", "", "secrets") and not rbac.allowed("watch", "", "secrets")
    assert not rbac.allowed("list", "", "namespaces")


@pytest.mark.parametrize(
    ("kind", "namespace", "name", "sub", "path"),
    [
        (kube.SECRET, "ns", None, None, "/api/v1/namespaces/ns/secrets"),
        (kube.JOB, "ns", "j", None, "/apis/batch/v1/namespaces/ns/jobs/j"),
        (kube.GRPOLORAJOB, "ns", "x", "status", "/apis/grpolora.dev/v1alpha1/namespaces/ns/grpolorajobs/x/status"),
        (kube.CLUSTER_KOPF_PEERING, None, "p", None, "/apis/kopf.dev/v1/clusterkopfpeerings/p"),
    ],
)
def test_api_paths(kind, namespace, name, sub, path):
    assert kind.path(namespace, name, sub) == path


def test_kind_of_refuses_unknown_objects():
    assert kube.kind_of({"apiVersion": "apps/v1", "kind": "StatefulSet"}) is kube.STATEFULSET
    with pytest.raises(ValueError, match="apps/v2 StatefulSet"):
        kube.kind_of({"apiVersion": "apps/v2", "kind": "StatefulSet"})


def test_event_bodies_are_core_v1_events_with_bounded_messages():
    event = kube.event_body(
        {"namespace": "ns", "name": "job", "uid": "u"}, "Warning", "Failed", "x" * 5000, now=NOW, instance="op-1"
    )
    assert event["involvedObject"] == {
        "apiVersion": "grpolora.dev/v1alpha1",
        "kind": "GRPOLoraJob",
        "name": "job",
        "namespace": "ns",
        "uid": "u",
    }
    assert event["metadata"] == {"generateName": "job.", "namespace": "ns"}
    assert len(event["message"]) == kube.EVENT_MESSAGE_MAX and event["firstTimestamp"] == "2026-01-01T12:00:00Z"


@pytest.mark.parametrize(
    ("pods", "writes", "modes", "refused", "warned"),
    [
        (3, False, ("ReadOnlyMany",), False, False),
        (3, False, ("ReadWriteMany",), False, False),
        (3, False, ("ReadWriteOnce",), False, True),  # works only if every pod lands on one node
        (3, False, ("ReadWriteOncePod",), True, False),
        (1, False, ("ReadWriteOncePod",), False, False),
        (2, True, ("ReadWriteOnce",), False, True),
        (2, True, ("ReadWriteMany",), False, False),
        (2, True, ("ReadOnlyMany",), True, False),
        (1, True, ("ReadOnlyMany",), True, False),
        (1, True, ("ReadWriteOnce",), False, False),
        (3, False, None, False, False),  # an absent claim: the scheduler says so on the pods
    ],
)
def test_shared_claims_access_modes(pods, writes, modes, refused, warned):
    check = observe.volume_check([observe.VolumeUse("c", "trainer", pods, writes)], {"c": modes})
    assert (check.refusal is not None, check.warning is not None) == (refused, warned)
    for text in filter(None, (check.refusal, check.warning)):
        assert "claim c" in text and ("ReadWriteMany" in text or "ReadWriteOnce" in text)


def test_fold_carries_the_data_figures_and_keeps_the_last_evaluation():
    report = TrainerStatus(
        phase="Running", total_steps=20, step=4, eval_reward=0.6, prompts_skipped=3, adapter_path="/out/final-adapter"
    )
    progress = fold_trainer(JobStatus(step=2, eval_reward=0.2), report)
    assert (progress.eval_reward, progress.prompts_skipped, progress.adapter_path) == (0.6, 3, "/out/final-adapter")
    later = fold_trainer(JobStatus(eval_reward=0.6), TrainerStatus(phase="Running", total_steps=20, step=5))
    assert later.eval_reward == 0.6  # a step without an evaluation keeps the last one


def test_fold_carries_the_push_figures_to_the_job_status():
    """spec.output.push: where the newest adapter went and why the last push failed reach `kubectl get glj -o yaml`,
    not only the trainer's /status (a push error is never raised in training, so the status is where it shows)."""
    report = TrainerStatus(
        phase="Running",
        total_steps=20,
        step=6,
        last_push="s3://bucket/run/step-000004/",
        last_push_step=4,
        push_error="spec.output.push.s3: 403 Forbidden",
    )
    progress = fold_trainer(JobStatus(step=4), report)
    assert (progress.last_push, progress.last_push_step, progress.push_error) == (
        "s3://bucket/run/step-000004/",
        4,
        "spec.output.push.s3: 403 Forbidden",
    )
    # A later report keeps where the last push went; its push error is the trainer's current one (cleared by a
    # push that succeeded, or by a restarted trainer that has not failed one).
    old = JobStatus(last_push="s3://bucket/run/step-000004/", last_push_step=4, push_error="spec.output.push.s3: 403")
    later = fold_trainer(old, TrainerStatus(phase="Running", total_steps=20, step=7))
    assert (later.last_push, later.last_push_step, later.push_error) == ("s3://bucket/run/step-000004/", 4, None)
    assert JobStatus(last_push_step=4).model_dump(by_alias=True, exclude_none=True)["lastPushStep"] == 4


def test_fold_carries_the_staleness_figures_to_the_job_status():
    """grpo.maxStaleness: how stale the last step's samples were and how many groups were dropped reach the job's
    status (a user tuning k reads them with kubectl, not from the trainer pod)."""
    report = TrainerStatus(phase="Running", total_steps=20, step=6, staleness=2, dropped_stale=3)
    progress = fold_trainer(JobStatus(step=5), report)
    assert (progress.staleness, progress.dropped_stale) == (2, 3)
    assert fold_trainer(JobStatus(staleness=1, dropped_stale=3), None).dropped_stale == 3
    assert JobStatus(dropped_stale=3).model_dump(by_alias=True, exclude_none=True)["droppedStale"] == 3
