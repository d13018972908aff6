"""The pure reconcile decision: table-driven cases from the job, its children and the trainer's report."""

from __future__ import annotations

import copy
import datetime
import json
from typing import Any

import pytest

from grpolora.api import constants as c
from grpolora.api.plan import plan
from grpolora.api.status import JobStatus, RestartCounts, TrainerStatus
from grpolora.operator import names
from grpolora.operator.job_status import status_patch
from grpolora.operator.job_view import JobView, changed_fields, job_view, spec_json
from grpolora.operator.job_workloads import children
from grpolora.operator.reconcile import (
    ChildRef,
    Decision,
    Observed,
    Refusal,
    decide,
    decide_refused,
    should_poll_trainer,
)
from tests.helpers import job_doc

NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
STAMP = "2026-01-01T12:00:00Z"
EARLIER = "2026-01-01T11:00:00Z"


def body(*, applied: dict[str, Any] | None = None, created: bool = True, **spec: Any) -> dict[str, Any]:
    """The job as stored; with `applied`, its children were created from that spec (unless `created` is False)."""
    doc = job_doc(**spec)
    doc["metadata"].update(uid="uid-1", generation=2)
    if applied is not None:
        doc["metadata"]["annotations"] = {names.APPLIED_SPEC_ANNOTATION: json.dumps(applied)}
        status = "True" if created else "False"
        doc["status"] = {
            "conditions": [{"type": names.CREATED, "status": status, "reason": "R", "lastTransitionTime": EARLIER}]
        }
    return doc


def applied_view(**spec: Any) -> JobView:
    """A job whose children were already created from this spec."""
    view = job_view(body(**spec))
    assert view.job is not None
    return job_view(body(applied=json.loads(spec_json(view.job.spec)), **spec))


def trainer_job(
    *, active: int = 0, ready: int = 0, condition: str | None = None, attempt: int = 0, message: str = ""
) -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {"name": "demo-trainer"}, "status": {"active": active, "ready": ready}}
    if condition:
        obj["status"]["conditions"] = [{"type": condition, "status": "True", "reason": "R", "message": message}]
    if attempt:
        obj["metadata"]["annotations"] = {names.RESTART_ATTEMPT_ANNOTATION: str(attempt)}
    return obj


def statefulset(ready: int = 0) -> dict[str, Any]:
    return {"metadata": {"name": "demo-inference"}, "status": {"readyReplicas": ready}}


def report(phase: str = "Running", **fields: Any) -> TrainerStatus:
    return TrainerStatus.model_validate({"phase": phase, "totalSteps": 100, "syncMembers": [0], **fields})


def pending() -> JobStatus:
    """The status right after the children were created (ten minutes ago: within the default startup deadline)."""
    return decide(applied_view(), JobStatus(), Observed(), NOW - datetime.timedelta(minutes=10)).status


def running(**fields: Any) -> JobStatus:
    """The status of a job that has been running for a while."""
    previous = decide(
        applied_view(),
        JobStatus(),
        Observed(trainer_job(active=1, ready=1), statefulset(1), trainer=report(step=3, syncRound=3, epoch=1)),
        NOW - datetime.timedelta(hours=1),
    ).status
    return previous.model_copy(update=fields)


def condition(decision: Decision, type_: str) -> tuple[str, str]:
    found = next(c for c in decision.status.conditions if c.type == type_)
    return found.status, found.reason


def reasons(decision: Decision) -> list[str]:
    return [event.reason for event in decision.events]


def kinds(objects: tuple[dict[str, Any], ...]) -> list[str]:
    return [o["kind"] for o in objects]


# ---- lifecycle ---------------------------------------------------------------------------------------------


def test_a_new_job_gets_both_workloads_exactly_as_rendered():
    view = job_view(body())
    decision = decide(view, JobStatus(), Observed(), NOW)
    assert kinds(decision.create) == ["Job", "StatefulSet"]
    _, rendered = children(plan(view.job), uid="uid-1", token="unused")
    assert list(decision.create) == [rendered[c.ROLE_TRAINER], rendered[c.ROLE_INFERENCE]]
    assert decision.status.phase == "Pending"
    assert condition(decision, names.CREATED) == ("True", names.R_CHILDREN_CREATED)
    assert condition(decision, names.PODS_READY) == ("False", names.R_WAITING_FOR_PODS)
    assert decision.status.start_time == STAMP and decision.status.observed_generation == 2
    assert view.record_applied == spec_json(view.job.spec)
    assert reasons(decision) == [names.E_CREATED]


def test_a_running_trainer_makes_the_job_running_with_its_figures():
    obs = Observed(
        trainer_job(active=1, ready=1),
        statefulset(1),
        trainer=report(step=7, syncRound=7, epoch=2, syncMembers=[0], rewardMean=0.5, lastSyncBytes=1024),
    )
    decision = decide(applied_view(), pending(), obs, NOW)
    s = decision.status
    assert (s.phase, s.step, s.sync_round, s.reward_mean, s.last_sync_bytes) == ("Running", 7, 7, 0.5, 1024)
    assert s.rendezvous.epoch == 2 and s.total_steps == 100
    assert s.replicas.trainer.ready == 1 and s.replicas.inference.desired == 1
    assert condition(decision, names.RENDEZVOUS_READY) == ("True", names.R_GROUP_FORMED)
    assert condition(decision, names.PROGRESSING) == ("True", names.R_TRAINING)
    assert condition(decision, names.PODS_READY) == ("True", names.R_ALL_READY)
    assert decision.create == () and decision.delete == ()
    assert reasons(decision) == [names.E_RUNNING]


@pytest.mark.parametrize(
    ("trainer_report", "expected"),
    [
        (None, ("Pending", "False", names.R_WAITING_FOR_TRAINER)),
        (report("Starting"), ("Running", "False", names.R_FORMING)),
        (report("Running"), ("Running", "True", names.R_GROUP_FORMED)),
    ],
    ids=["no-answer", "starting", "running"],
)
def test_rendezvous_follows_the_trainer_phase(trainer_report, expected):
    obs = Observed(trainer_job(active=1), statefulset(), trainer=trainer_report, trainer_error="connection refused")
    decision = decide(applied_view(), pending(), obs, NOW)
    assert (decision.status.phase, *condition(decision, names.RENDEZVOUS_READY)) == expected


def test_a_missed_poll_changes_nothing_it_cannot_know():
    before = running()
    obs = Observed(trainer_job(active=1, ready=1), statefulset(1), trainer_error="timeout")
    decision = decide(applied_view(), before, obs, NOW)
    assert decision.status.phase == "Running"
    assert condition(decision, names.RENDEZVOUS_READY) == ("True", names.R_GROUP_FORMED)
    assert decision.status.sync_round == 3 and decision.events == ()


def test_sync_round_never_goes_back_the_step_is_the_one_reached():
    before = running(last_sync_seconds=1.5, last_sync_time=EARLIER)
    # A trainer restarted from an older checkpoint reports an older round with its own (older) sync figures.
    obs = Observed(trainer_job(active=1), statefulset(1), trainer=report(step=1, syncRound=1, lastSyncSeconds=9.0))
    s = decide(applied_view(), before, obs, NOW).status
    assert (s.step, s.steps_lost, s.sync_round, s.last_sync_seconds, s.last_sync_time) == (1, 2, 3, 1.5, EARLIER)


def test_sync_group_reformed_under_a_new_epoch_is_an_event_and_the_job_goes_on():
    obs = Observed(trainer_job(active=1, ready=1), statefulset(0), trainer=report(syncRound=4, epoch=2))
    decision = decide(applied_view(), running(), obs, NOW)
    assert decision.status.phase == "Running" and decision.status.rendezvous.epoch == 2
    assert decision.delete == () and decision.create == ()  # the StatefulSet replaces its pod itself
    assert names.E_GROUP_REFORMED in reasons(decision)


def test_the_trainer_job_completing_succeeds_the_job_and_releases_inference():
    obs = Observed(trainer_job(condition="Complete"), statefulset(1))
    decision = decide(applied_view(), running(), obs, NOW)
    assert decision.status.phase == "Succeeded" and decision.status.completion_time == STAMP
    assert decision.delete == (ChildRef("StatefulSet", "demo-inference"),)
    assert condition(decision, names.SUCCEEDED) == ("True", names.R_COMPLETED)
    assert condition(decision, names.PROGRESSING) == ("False", names.R_FINISHED)
    assert reasons(decision) == [names.E_SUCCEEDED]


def test_the_trainer_reporting_succeeded_is_enough():
    obs = Observed(trainer_job(active=1), statefulset(1), trainer=report("Succeeded", step=100, syncRound=100))
    decision = decide(applied_view(), running(), obs, NOW)
    assert decision.status.phase == "Succeeded" and "100/100" in decision.status.message


def test_finished_jobs_stay_finished():
    done = running(phase="Succeeded", completion_time=EARLIER, message="trained")
    obs = Observed(trainer_job(condition="Failed"), None)
    decision = decide(applied_view(), done, obs, NOW)
    assert decision.status.phase == "Succeeded" and decision.status.completion_time == EARLIER
    assert decision.create == () and decision.delete == () and decision.events == ()


# ---- trainer failures --------------------------------------------------------------------------------------


def test_a_failed_trainer_is_restarted_in_two_phases():
    view = applied_view(trainer={"maxRestarts": 2})
    failed = trainer_job(condition="Failed", message="pod demo-trainer-0 exited with 1")
    # Phase one commits the restart in the status only.
    first = decide(view, running(), Observed(failed, statefulset(1)), NOW)
    assert first.status.trainer_restarts == 1 and first.requeue_after == 0.0
    assert first.delete == () and first.create == ()
    assert condition(first, names.PROGRESSING) == ("True", names.R_TRAINER_RESTARTING)
    assert reasons(first) == [names.E_TRAINER_RESTARTING]
    assert "restart 1 of 2" in first.events[0].message and "exited with 1" in first.events[0].message
    # Phase two (and any repeat of it) deletes the stale Job, and creates nothing while it (or its pods) is there.
    second = decide(view, first.status, Observed(failed, statefulset(1)), NOW)
    assert second.delete == (ChildRef("Job", "demo-trainer"),) and second.create == ()
    assert second.status.trainer_restarts == 1 and second.events == () and second.requeue_after is not None
    assert "waiting for the failed trainer Job and its pods to be gone" in second.status.message
    leaving = copy.deepcopy(failed)
    leaving["metadata"]["deletionTimestamp"] = STAMP
    waiting = decide(view, second.status, Observed(leaving, statefulset(1)), NOW)
    assert waiting.delete == () and waiting.create == () and waiting.requeue_after is not None
    # Gone (with its pods, deleted in the foreground): the replacement, marked as attempt 1.
    third = decide(view, waiting.status, Observed(None, statefulset(1)), NOW)
    (job,) = third.create
    assert job["metadata"]["annotations"] == {
        names.RESTART_ATTEMPT_ANNOTATION: "1",
        names.INCARNATION_ANNOTATION: "1",  # the second trainer Job
    }
    # The replacement runs: nothing more to do.
    fourth = decide(view, third.status, Observed(trainer_job(active=1, attempt=1), statefulset(1)), NOW)
    assert fourth.create == () and fourth.delete == () and fourth.status.phase == "Running"


def stale_pod(
    name: str = "demo-trainer-0-abcde",
    *,
    deleted: datetime.datetime | None = None,
    grace: int = 30,
    phase: str = "Running",
    owner: str = "trainer-uid-0",
    fenced: bool = False,
) -> dict[str, Any]:
    """A trainer pod of the Job `owner`, Terminating since `deleted` (with its grace period) when given."""
    labels = {c.LABEL_MANAGED_BY: c.OPERATOR_NAME, c.LABEL_JOB: "demo", c.LABEL_ROLE: c.ROLE_TRAINER}
    if not fenced:
        labels[c.LABEL_JOB_UID] = "uid-1"
    meta: dict[str, Any] = {
        "name": name,
        "labels": labels,
        "ownerReferences": [{"kind": "Job", "name": "demo-trainer", "uid": owner, "controller": True}],
    }
    if deleted is not None:
        meta["deletionTimestamp"] = cond_stamp(deleted + datetime.timedelta(seconds=grace))
        meta["deletionGracePeriodSeconds"] = grace
    return {"metadata": meta, "status": {"phase": phase}}


def leaving_trainer(**kw: Any) -> dict[str, Any]:
    """The failed trainer Job of attempt 0, deleted in the foreground and held by its pods."""
    job = trainer_job(condition="Failed", message="pod demo-trainer-0 exited with 1", **kw)
    job["metadata"].update(uid="trainer-uid-0", deletionTimestamp=STAMP, finalizers=["foregroundDeletion"])
    return job


def test_a_restart_waits_for_a_pod_within_its_deletion_deadline_and_says_until_when():
    """A pod slow to stop (NCCL ignores SIGTERM) is waited for: its grace period, then the margin for its kubelet to
    confirm. The Job controller waits likewise for a terminating pod before it replaces it (podReplacementPolicy
    Failed, the only value allowed with a podFailurePolicy: pkg/apis/batch/types.go)."""
    view = applied_view(trainer={"maxRestarts": 2})
    old = running(trainer_restarts=1, restarts_by_cause=RestartCounts(failure=1))
    deleted = NOW - datetime.timedelta(seconds=80)  # grace 30 s: its deadline was 50 s ago, lost 10 s from now
    pods = (stale_pod(deleted=deleted),)
    waiting = decide(view, old, Observed(leaving_trainer(), statefulset(1), pods), NOW)
    assert waiting.create == () and waiting.delete == () and waiting.release == () and waiting.fence == ()
    assert waiting.requeue_after is not None
    message = waiting.status.message
    assert "waiting for the failed trainer Job and its pods to be gone" in message
    assert "pod demo-trainer-0-abcde Terminating since 2026-01-01T11:58:40Z" in message
    assert "taken as lost at 2026-01-01T12:00:10Z if its node has not confirmed by then" in message


def test_a_pod_its_node_never_confirms_is_taken_as_lost_fenced_and_its_job_released():
    """Past its deletionTimestamp by POD_LOST_AFTER_SECONDS, the pod's kubelet has not confirmed the kill (the node
    is lost): it stops holding the restart. Its Job, held by the foregroundDeletion finalizer for as long as the pod
    exists, is deleted again in the Background, which makes the API server drop that finalizer (apiserver
    registry/generic/registry/store.go, deletionFinalizersForGarbageCollection) and frees the name; the pod loses
    the label the job's Services select it by, since a Terminating pod stays in a publishNotReadyAddresses Service's
    EndpointSlice as ready (staging/src/k8s.io/endpointslice utils.go podToEndpoint) and would share rank 0's
    rendezvous name with its replacement."""
    view = applied_view(trainer={"maxRestarts": 2})
    old = running(trainer_restarts=1, restarts_by_cause=RestartCounts(failure=1))
    deleted = NOW - datetime.timedelta(seconds=95)  # deadline 65 s ago: lost 5 s ago
    lost = stale_pod(deleted=deleted)
    stopped = stale_pod("demo-trainer-1-fghij", deleted=deleted, phase="Failed")  # its containers stopped
    released = decide(view, old, Observed(leaving_trainer(), statefulset(1), (lost, stopped)), NOW)
    assert released.release == (ChildRef("Job", "demo-trainer"),) and released.delete == ()
    assert released.fence == ("demo-trainer-0-abcde",), "only the lost pod still in the Services"
    assert released.create == () and released.requeue_after is not None
    note = (
        "pod demo-trainer-0-abcde Terminating since 2026-01-01T11:58:25Z, its node does not confirm; taken as lost "
        "at 2026-01-01T11:59:55Z"
    )
    assert note in released.status.message
    assert [(e.type, e.reason) for e in released.events] == [("Warning", names.E_TRAINER_POD_LOST)]
    assert note in released.events[0].message
    # A pass repeated before the Job has left (the pod already fenced) releases it again, quietly: one event.
    fenced = stale_pod(deleted=deleted, fenced=True)
    again = decide(view, released.status, Observed(leaving_trainer(), statefulset(1), (fenced, stopped)), NOW)
    assert again.release == (ChildRef("Job", "demo-trainer"),) and again.fence == () and again.events == ()
    # The Job gone, the fenced pod left behind no longer holds anything: the replacement is created.
    replaced = decide(view, released.status, Observed(None, statefulset(1), trainer_pods_left=(fenced,)), NOW)
    (job,) = replaced.create
    assert job["metadata"]["annotations"] == {
        names.RESTART_ATTEMPT_ANNOTATION: "1",
        names.INCARNATION_ANNOTATION: "1",  # the second trainer Job
    }
    assert replaced.fence == () and replaced.release == ()


def test_a_lost_pod_left_without_its_job_is_fenced_before_the_trainer_is_created():
    """A trainer pod that outlived its Job (e.g. `kubectl delete job --cascade=background`) on a lost node: taken out
    of the Services first, and the Job created at the next pass, after the relabel is written."""
    deleted = NOW - datetime.timedelta(minutes=5)
    first = decide(
        applied_view(), pending(), Observed(None, statefulset(1), trainer_pods_left=(stale_pod(deleted=deleted),)), NOW
    )
    assert first.fence == ("demo-trainer-0-abcde",) and first.create == () and first.requeue_after is not None
    fenced = stale_pod(deleted=deleted, fenced=True)
    second = decide(applied_view(), first.status, Observed(None, statefulset(1), trainer_pods_left=(fenced,)), NOW)
    assert kinds(second.create) == ["Job"] and second.fence == ()


def test_a_trainer_that_keeps_failing_fails_the_job_with_the_reason():
    view = applied_view(trainer={"maxRestarts": 1})
    obs = Observed(trainer_job(condition="Failed", attempt=1, message="OOMKilled"), statefulset(1))
    decision = decide(view, running(trainer_restarts=1, restarts_by_cause=RestartCounts(failure=1)), obs, NOW)
    assert decision.status.phase == "Failed" and decision.status.completion_time == STAMP
    assert condition(decision, names.FAILED) == ("True", names.R_BACKOFF_LIMIT)
    assert "maxRestarts (1)" in decision.status.message and "OOMKilled" in decision.status.message
    assert decision.delete == (ChildRef("StatefulSet", "demo-inference"),)
    assert reasons(decision) == [names.E_FAILED]
    assert decision.events[0].type == "Warning"


# ---- suspend and TTL ---------------------------------------------------------------------------------------


def test_suspend_removes_the_workloads_and_resume_recreates_them():
    suspended = decide(applied_view(suspend=True), running(), Observed(trainer_job(active=1), statefulset(1)), NOW)
    assert set(suspended.delete) == {ChildRef("Job", "demo-trainer"), ChildRef("StatefulSet", "demo-inference")}
    assert suspended.status.phase == "Suspended" and suspended.create == ()
    assert suspended.status.replicas.trainer.desired == 0
    assert condition(suspended, names.SUSPENDED) == ("True", names.R_SUSPENDED)
    assert reasons(suspended) == [names.E_SUSPENDED]
    resumed = decide(applied_view(), suspended.status, Observed(), NOW)
    assert kinds(resumed.create) == ["Job", "StatefulSet"] and resumed.status.phase == "Pending"
    assert reasons(resumed) == [names.E_RESUMED]


@pytest.mark.parametrize(
    ("ttl", "completed_minutes_ago", "deletes", "requeue"),
    [(None, 60, False, None), (600, 5, False, 300.0), (600, 10, True, None), (0, 0, True, None)],
    ids=["no-ttl", "not-yet", "expired", "zero"],
)
def test_ttl_after_finished(ttl, completed_minutes_ago, deletes, requeue):
    completed = NOW - datetime.timedelta(minutes=completed_minutes_ago)
    done = running(phase="Succeeded", completion_time=completed.strftime("%Y-%m-%dT%H:%M:%SZ"))
    decision = decide(applied_view(ttlSecondsAfterFinished=ttl), done, Observed(trainer_job(condition="Complete")), NOW)
    assert decision.delete_job is deletes and decision.requeue_after == requeue


# ---- spec problems -----------------------------------------------------------------------------------------


def test_an_invalid_job_fails_with_field_paths_and_creates_nothing():
    view = job_view(body(grpo={"generationsPerPrompt": 1}, lora={"rnk": 8}))
    assert view.job is None
    decision = decide(view, JobStatus(), Observed(), NOW)
    assert decision.status.phase == "Failed" and decision.create == ()
    assert condition(decision, names.INVALID_SPEC) == ("True", names.R_INVALID)
    assert condition(decision, names.CREATED) == ("False", names.R_INVALID)
    message = decision.status.message
    assert "spec.grpo.generationsPerPrompt" in message and "spec.lora.rnk" in message
    assert reasons(decision) == [names.E_FAILED, names.E_INVALID_SPEC]
    assert decision.status.completion_time is None  # not terminal: fixing the spec creates the job


def test_a_fixed_spec_is_not_stuck_in_failed():
    failed = decide(job_view(body(grpo={"generationsPerPrompt": 1})), JobStatus(), Observed(), NOW).status
    decision = decide(job_view(body()), failed, Observed(), NOW)
    assert decision.status.phase == "Pending" and kinds(decision.create) == ["Job", "StatefulSet"]
    assert condition(decision, names.INVALID_SPEC) == ("False", names.R_VALID)


def test_changes_that_cannot_apply_are_refused_and_the_children_keep_the_applied_spec():
    applied = json.loads(spec_json(job_view(body()).job.spec))
    view = job_view(body(applied=applied, lora={"rank": 8}, trainer={"replicas": 2}, suspend=True))
    assert view.refused == ("spec.lora.rank", "spec.trainer.replicas")
    assert view.job.spec.lora.rank == 16 and view.job.spec.suspend is True  # suspend applies, the rest not
    decision = decide(view, running(), Observed(trainer_job(active=1), statefulset(1)), NOW)
    status, reason = condition(decision, names.SPEC_CHANGE_REFUSED)
    assert (status, reason) == ("True", names.R_REFUSED)
    assert names.E_SPEC_CHANGE_REFUSED in reasons(decision)
    refused = next(e for e in decision.events if e.reason == names.E_SPEC_CHANGE_REFUSED)
    assert "spec.lora.rank, spec.trainer.replicas" in refused.message


def test_until_its_children_are_created_a_job_may_change_any_field():
    # e.g. the API server refused the trainer Job for a bad toleration: the fixed spec applies as a whole.
    applied = json.loads(spec_json(job_view(body()).job.spec))
    view = job_view(body(applied=applied, created=False, lora={"rank": 8}))
    assert view.refused == () and view.job.spec.lora.rank == 8
    assert view.record_applied is not None and json.loads(view.record_applied)["lora"]["rank"] == 8


def test_a_running_job_whose_spec_turns_invalid_keeps_running_from_the_applied_spec():
    applied = json.loads(spec_json(job_view(body()).job.spec))
    view = job_view(body(applied=applied, grpo={"generationsPerPrompt": 1}))
    assert view.job is not None and view.problems
    decision = decide(view, running(), Observed(trainer_job(active=1, ready=1), statefulset(1)), NOW)
    assert decision.status.phase == "Running" and decision.create == () and decision.delete == ()
    assert condition(decision, names.INVALID_SPEC) == ("True", names.R_INVALID)


@pytest.mark.parametrize(
    ("applied", "current", "expected"),
    [
        ({"a": 1}, {"a": 1}, []),
        ({"a": 1}, {"a": 2}, ["spec.a"]),
        ({"suspend": False, "ttlSecondsAfterFinished": 5}, {"suspend": True}, []),
        ({"lora": {"rank": 16, "alpha": 32}}, {"lora": {"rank": 8, "alpha": 32}}, ["spec.lora.rank"]),
        ({"t": {"tolerations": [{"k": 1}]}}, {"t": {"tolerations": []}}, ["spec.t.tolerations"]),
        ({"x": {"suspend": 1}}, {"x": {"suspend": 2}}, ["spec.x.suspend"]),  # only the top-level one is mutable
        ({}, {"new": {"field": 1}}, ["spec.new"]),
    ],
)
def test_changed_fields(applied, current, expected):
    assert changed_fields(applied, current) == expected


# ---- pods ----------------------------------------------------------------------------------------------


def pod(name: str, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"phase": "Pending", **status}}


def test_stuck_pods_say_why_once():
    unschedulable = pod(
        "demo-trainer-0-x",
        conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"}],
    )
    obs = Observed(trainer_job(active=1), statefulset(0), pods=(unschedulable,))
    first = decide(applied_view(), pending(), obs, NOW)
    assert condition(first, names.PODS_READY) == ("False", "Unschedulable")
    assert "demo-trainer-0-x: 0/3 nodes" in first.status.message
    assert names.E_PODS_NOT_READY in reasons(first)
    again = decide(applied_view(), first.status, obs, NOW)
    assert names.E_PODS_NOT_READY not in reasons(again)


# ---- idempotence and the status write ----------------------------------------------------------------------


def test_a_repeated_pass_decides_the_same_and_writes_nothing():
    obs = Observed(trainer_job(active=1, ready=1), statefulset(1), trainer=report(step=5, syncRound=5))
    first = decide(applied_view(), running(), obs, NOW)
    second = decide(applied_view(), first.status, obs, NOW + datetime.timedelta(seconds=10))
    assert second.status == first.status and second.events == ()
    assert status_patch(first.status.to_wire(), second.status) is None


def test_status_patch_sends_removed_fields_as_null_and_leaves_kopf_alone():
    old = {"phase": "Running", "message": "m", "kopf": {"progress": {}}, "replicas": {"trainer": {"ready": 1}}}
    new = JobStatus(phase="Suspended")
    patch = status_patch(old, new)
    assert patch == {"phase": "Suspended", "message": None, "replicas": None, "conditions": []}


def test_status_patch_recurses_into_objects():
    old = running().to_wire()
    new = running(rendezvous=running().rendezvous.model_copy(update={"epoch": 5}))
    assert status_patch(old, new) == {"rendezvous": {"epoch": 5}}


def test_failure_target_restarts_the_trainer_as_failed_would():
    """Since Kubernetes 1.31 the Job controller writes FailureTarget first and Failed only once no pod terminates
    (pkg/controller/job/job_controller.go, release-1.31: newFailureCondition, delayTerminalCondition): with a rank
    on a lost node Failed never comes. The restart is committed on FailureTarget, with its reason and message."""
    view = applied_view(trainer={"maxRestarts": 2})
    target = trainer_job(condition="FailureTarget", message="Job has reached the specified backoff limit")
    first = decide(view, running(), Observed(target, statefulset(1)), NOW)
    assert first.status.trainer_restarts == 1 and first.status.restarts_by_cause.failure == 1
    assert "Job has reached the specified backoff limit" in first.events[0].message
    second = decide(view, first.status, Observed(target, statefulset(1)), NOW)
    assert second.delete == (ChildRef("Job", "demo-trainer"),) and second.status.trainer_restarts == 1
    assert not should_poll_trainer(view, running(), trainer_job(active=1, condition="FailureTarget"))


def test_the_trainer_is_polled_only_while_its_pod_can_answer():
    view = applied_view()
    assert should_poll_trainer(view, JobStatus(), trainer_job(active=1))
    assert not should_poll_trainer(view, JobStatus(), None)
    assert not should_poll_trainer(view, JobStatus(), trainer_job(active=0))
    assert not should_poll_trainer(view, JobStatus(), trainer_job(active=1, condition="Failed"))
    assert not should_poll_trainer(applied_view(suspend=True), JobStatus(), trainer_job(active=1))


def test_a_hand_edited_applied_spec_annotation_falls_back_to_the_current_spec():
    doc = body()
    doc["metadata"]["annotations"] = {names.APPLIED_SPEC_ANNOTATION: "{not json"}
    view = job_view(copy.deepcopy(doc))
    assert view.job is not None and view.record_applied is not None and view.refused == ()


@pytest.mark.parametrize(
    ("case", "idle"),
    [
        ("running", False),
        ("suspending", False),  # the workloads are still being removed
        ("suspended", True),
        ("finished", True),
        ("finished-with-ttl", False),
        ("invalid", True),
    ],
)
def test_idle_when_only_a_spec_change_can_change_anything(case, idle):
    done = running(phase="Succeeded", completion_time=EARLIER)
    decisions = {
        "running": lambda: decide(applied_view(), running(), Observed(trainer_job(active=1), statefulset(1)), NOW),
        "suspending": lambda: decide(applied_view(suspend=True), running(), Observed(trainer_job(active=1)), NOW),
        "suspended": lambda: decide(applied_view(suspend=True), running(phase="Suspended"), Observed(), NOW),
        "finished": lambda: decide(applied_view(), done, Observed(trainer_job(condition="Complete")), NOW),
        "finished-with-ttl": lambda: decide(applied_view(ttlSecondsAfterFinished=99999), done, Observed(), NOW),
        "invalid": lambda: decide(job_view(body(grpo={"steps": 0})), JobStatus(), Observed(), NOW),
    }
    assert decisions[case]().idle is idle


def test_a_transient_api_failure_keeps_the_phase_and_retries_with_one_warning():
    refusal = Refusal("Job", "demo-trainer", 503, "etcdserver: leader changed")
    first = decide_refused(applied_view(), running(), refusal, NOW)
    assert first.status.phase == "Running" and first.requeue_after == 5.0 and not first.idle
    assert condition(first, names.PROGRESSING) == ("False", names.R_API_RETRYING)
    assert "trainer Job demo-trainer: etcdserver: leader changed" in first.status.message
    assert [(e.type, e.reason) for e in first.events] == [("Warning", names.R_API_RETRYING)]
    assert decide_refused(applied_view(), first.status, refusal, NOW).events == ()


def test_a_refused_child_fails_the_job_without_a_completion_time():
    refusal = Refusal("NetworkPolicy", "demo", 403, 'networkpolicies "demo" is forbidden: quota')
    decision = decide_refused(applied_view(), JobStatus(), refusal, NOW)
    assert decision.status.phase == "Failed" and decision.status.completion_time is None and decision.idle
    assert condition(decision, names.FAILED) == ("True", names.R_CREATE_REFUSED)
    assert ("Warning", names.E_FAILED) in [(e.type, e.reason) for e in decision.events]


def test_a_refusal_after_the_job_started_keeps_its_run_and_retries():
    """A trainer Job was created (status.trainerIncarnation): a later refusal (a restart's replacement under a policy
    added mid-run, a kept child re-made by drift repair) is not a failure to start. The run's record stays, Created
    stays True (the spec stays locked), nothing marks the Workload Finished, and the create is tried again."""
    refusal = Refusal("Job", "demo-trainer", 403, "denied by policy")
    old = running(trainer_restarts=2, trainer_incarnation=2, token_digest="abc")
    assert old.trainer_incarnation == 2 and old.step == 3
    for _ in range(2):
        decision = decide_refused(applied_view(), old, refusal, NOW)
        status = decision.status
        assert status.phase == "Running" and status.completion_time is None and not decision.idle
        assert (status.trainer_restarts, status.trainer_incarnation, status.token_digest, status.step) == (
            2,
            2,
            "abc",
            3,
        )
        assert condition(decision, names.CREATED) == ("True", names.R_CHILDREN_CREATED)
        assert condition(decision, names.FAILED) == ("False", names.R_NO_FAILURE)
        assert condition(decision, names.PROGRESSING) == ("False", names.R_CREATE_REFUSED)
        assert decision.queue_workload_write is None and decision.requeue_after is not None
        old = status
    assert decision.events == ()  # the Warning once, on the first refusal


def test_children_of_a_deleted_job_of_the_same_name_are_waited_for_never_created_over():
    blocked = (ChildRef("Job", "demo-trainer"), ChildRef("Secret", "demo-grpolora-token"))
    decision = decide(applied_view(), JobStatus(), Observed(blocked=blocked), NOW)
    assert kinds(decision.create) == ["StatefulSet"]
    assert decision.requeue_after is not None and not decision.idle
    assert condition(decision, names.CREATED) == ("False", names.R_WAITING_FOR_PREVIOUS_JOB)
    assert "Job demo-trainer, Secret demo-grpolora-token" in decision.status.message


def test_a_job_being_deleted_creates_nothing_and_writes_nothing():
    """The collector removes a foreground-deleted job's children one by one; a pass must not bring them back."""
    doc = body(applied=json.loads(spec_json(applied_view().job.spec)))
    doc["metadata"]["deletionTimestamp"] = STAMP
    view = job_view(doc)
    old = running()
    decision = decide(view, old, Observed(None, statefulset(1)), NOW)  # the trainer Job is already collected
    assert decision.create == () and decision.delete == () and not decision.delete_job
    assert decision.status == old and decision.events == () and decision.idle


def test_no_trainer_job_is_created_while_pods_of_a_previous_one_are_left():
    deleted = NOW - datetime.timedelta(seconds=10)
    left = (stale_pod(deleted=deleted), stale_pod("demo-trainer-1-fghij", deleted=deleted))
    waiting = decide(applied_view(), pending(), Observed(None, statefulset(1), trainer_pods_left=left), NOW)
    assert kinds(waiting.create) == [] and waiting.requeue_after is not None
    assert "waiting for 2 pods of a previous trainer Job to terminate" in waiting.status.message
    gone = decide(applied_view(), waiting.status, Observed(None, statefulset(1)), NOW)
    assert kinds(gone.create) == ["Job"]


def test_a_re_made_token_re_keys_the_job_as_a_whole():
    """Pods keep the token they started with: a token Secret re-made with a new token (deleted by hand) replaces every
    pod, and creates them again only once all are gone, never old and new tokens side by side."""
    view = applied_view()
    first = decide(view, running(), Observed(trainer_job(active=1), statefulset(1), token="aaaa"), NOW)
    assert first.status.token_digest == "aaaa" and first.create == () and first.delete == ()
    rekey = decide(view, first.status, Observed(trainer_job(active=1), statefulset(1), token="bbbb"), NOW)
    assert set(rekey.delete) == {ChildRef("Job", "demo-trainer"), ChildRef("StatefulSet", "demo-inference")}
    assert rekey.create == () and rekey.status.token_digest == "aaaa", "the pods still hold the old token"
    assert condition(rekey, names.PROGRESSING) == ("True", names.R_REKEYING)
    assert reasons(rekey) == [names.E_REKEYED] and "demo-grpolora-token was re-made" in rekey.events[0].message
    # One workload still leaving: still nothing created.
    leaving = decide(view, rekey.status, Observed(None, statefulset(1), token="bbbb"), NOW)
    assert leaving.create == () and leaving.events == ()
    # All gone: both come back with the new token, which the status records.
    renewed = decide(view, leaving.status, Observed(None, None, token="bbbb"), NOW)
    assert kinds(renewed.create) == ["Job", "StatefulSet"] and renewed.status.token_digest == "bbbb"


def test_a_trainer_restarted_without_checkpoints_shows_its_real_step_and_the_loss():
    old = running(step=15, sync_round=15)
    decision = decide(
        applied_view(),
        old,
        Observed(trainer_job(active=1, ready=1), statefulset(1), trainer=report(step=1, syncRound=16)),
        NOW,
    )
    assert decision.status.step == 1 and decision.status.steps_lost == 14
    assert "step 1/" in decision.status.message and "14 steps lost to trainer restarts" in decision.status.message


@pytest.mark.parametrize(
    ("checkpoint", "kept", "lost"),
    [({"pvc": {"claimName": "ckpts"}}, "checkpoints in claim ckpts are kept", None),
     ({}, None, "checkpoints were in the trainer pods' emptyDir and are gone")],
)  # fmt: skip
def test_the_suspend_message_says_what_is_really_kept(checkpoint, kept, lost):
    decision = decide(applied_view(checkpoint=checkpoint, suspend=True), running(), Observed(), NOW)
    message = decision.status.message
    assert decision.status.phase == "Suspended"
    if kept:
        assert kept in message and "resume from the latest checkpoint" in message
    else:
        assert lost in message and "from step 0" in message and "checkpoints are kept" not in message
    suspended = next(c for c in decision.status.conditions if c.type == names.SUSPENDED)
    assert suspended.message == message


def test_a_running_job_whose_claim_cannot_serve_it_keeps_running_and_says_why():
    view = applied_view(checkpoint={"pvc": {"claimName": "ckpts"}}, trainer={"replicas": 2})
    observed = Observed(trainer_job(active=2), statefulset(1), claims={"ckpts": ("ReadWriteOncePod",)})
    decision = decide(view, running(), observed, NOW)
    assert decision.status.phase == "Running"
    assert condition(decision, names.VOLUMES_SHAREABLE) == ("False", names.R_VOLUME_ACCESS_MODE)


# ---- spec.activeDeadlineSeconds ------------------------------------------------------------------------------------


def _active(deadline: int, since_minutes: float, **spec: Any) -> tuple[JobView, JobStatus, Observed]:
    view = applied_view(activeDeadlineSeconds=deadline, **spec)
    since = cond_stamp(NOW - datetime.timedelta(minutes=since_minutes))
    obs = Observed(trainer_job(active=1, ready=1), statefulset(1), trainer=report(step=3, syncRound=3, epoch=1))
    return view, running(active_since=since), obs


def cond_stamp(when: datetime.datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def test_a_job_active_past_its_deadline_fails_with_deadline_exceeded_and_its_pods_go():
    """As the Job controller: past activeDeadlineSeconds the active pods are deleted and the Job fails with reason
    DeadlineExceeded (kubernetes pkg/controller/job/job_controller.go, pastActiveDeadline)."""
    view, before, obs = _active(600, since_minutes=11)
    decision = decide(view, before, obs, NOW)
    assert decision.status.phase == "Failed" and decision.status.completion_time == STAMP
    assert condition(decision, names.FAILED) == ("True", names.R_DEADLINE_EXCEEDED)
    assert "spec.activeDeadlineSeconds (600 s" in decision.status.message
    assert decision.create == ()
    assert set(decision.delete) == {ChildRef("Job", "demo-trainer"), ChildRef("StatefulSet", "demo-inference")}
    again = decide(view, decision.status, Observed(), NOW + datetime.timedelta(minutes=1))
    assert condition(again, names.FAILED) == ("True", names.R_DEADLINE_EXCEEDED), "terminal: it sticks"


def test_within_its_deadline_a_job_runs_on_and_keeps_the_time_it_became_active():
    view, before, obs = _active(600, since_minutes=9)
    decision = decide(view, before, obs, NOW)
    assert decision.status.phase == "Running" and decision.delete == ()
    assert decision.status.active_since == before.active_since


def test_the_deadline_clock_starts_when_the_job_becomes_active_stops_while_suspended_and_starts_over():
    """A Job's startTime is set when it starts and reset on resume (suspended time does not count); under Kueue a
    job is suspended until admitted, so waiting in the queue does not spend its deadline either."""
    fresh = decide(applied_view(activeDeadlineSeconds=60), JobStatus(), Observed(), NOW)
    assert fresh.status.active_since == STAMP
    view, before, obs = _active(600, since_minutes=30, suspend=True)
    suspended = decide(view, before, obs, NOW)
    assert suspended.status.phase == "Suspended" and suspended.status.active_since is None
    later = NOW + datetime.timedelta(hours=5)
    resumed = decide(applied_view(activeDeadlineSeconds=600), suspended.status, Observed(), later)
    assert resumed.status.phase == "Pending" and resumed.status.active_since == cond_stamp(later)
    assert [o["kind"] for o in resumed.create] == ["Job", "StatefulSet"]


def test_without_a_deadline_nothing_is_capped():
    view = applied_view()
    before = running(active_since=cond_stamp(NOW - datetime.timedelta(days=30)))
    obs = Observed(trainer_job(active=1, ready=1), statefulset(1), trainer=report(step=3, syncRound=3, epoch=1))
    assert decide(view, before, obs, NOW).status.phase == "Running"


# ---- QoS --------------------------------------------------------------------------------------------------------


def test_a_job_whose_pods_would_be_best_effort_says_so_in_its_conditions():
    decision = decide(applied_view(), pending(), Observed(trainer_job(active=1), statefulset()), NOW)
    found = next(c for c in decision.status.conditions if c.type == names.PODS_BEST_EFFORT)
    assert (found.status, found.reason) == ("True", names.R_NO_RESOURCE_REQUESTS)
    assert "spec.trainer.resources" in found.message and "spec.inference.resources" in found.message
    requests = {"resources": {"requests": {"memory": "8Gi"}}}
    burstable = decide(applied_view(trainer=requests, inference=requests), pending(), Observed(), NOW)
    assert names.PODS_BEST_EFFORT not in [c.type for c in burstable.status.conditions]


def test_every_new_trainer_job_gets_the_next_incarnation_whatever_replaced_the_last():
    """Not only a restart: a resume (and a Kueue re-admission, a pool re-attachment) creates a trainer Job too, and
    a cut-off rank of the one before it must be fenced. The restart attempt stays (suspend is no restart)."""
    view = applied_view()
    first = decide(view, JobStatus(), Observed(), NOW)
    (job,) = [o for o in first.create if o["kind"] == "Job"]
    assert names.INCARNATION_ANNOTATION not in (job["metadata"].get("annotations") or {})
    assert first.status.trainer_incarnation == 0
    suspended = decide(applied_view(suspend=True), first.status, Observed(trainer_job(active=1), statefulset(1)), NOW)
    assert ChildRef("Job", "demo-trainer") in suspended.delete and suspended.status.trainer_incarnation == 0
    resumed = decide(view, suspended.status, Observed(), NOW)
    (job,) = [o for o in resumed.create if o["kind"] == "Job"]
    assert job["metadata"]["annotations"] == {names.INCARNATION_ANNOTATION: "1"}
    assert job["spec"]["template"]["metadata"]["annotations"][names.INCARNATION_ANNOTATION] == "1"
    assert resumed.status.trainer_incarnation == 1 and resumed.status.trainer_restarts == 0
    # An operator that crashed after the create and before its status write: the Job's own mark is kept.
    marked = trainer_job(active=1)
    marked["metadata"]["annotations"] = {names.INCARNATION_ANNOTATION: "2"}
    assert decide(view, resumed.status, Observed(marked, statefulset(1)), NOW).status.trainer_incarnation == 2
