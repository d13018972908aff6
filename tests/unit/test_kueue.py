"""Kueue: a job labelled kueue.x-k8s.io/queue-name gets one Kueue Workload with a pod set per role, so Kueue admits
both pools' pods together or neither; its workloads exist only while that Workload is admitted, and a finished job
marks it Finished (Kueue releases the quota)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from grpolora.api import constants as c
from grpolora.api.load import parse_job
from grpolora.api.plan import plan
from grpolora.api.status import JobStatus, PoolStatus
from grpolora.operator import builders, kueue, names
from grpolora.operator.job_view import job_view, spec_json, with_queue_in_effect
from grpolora.operator.pools import PoolView
from grpolora.operator.reconcile import ChildRef, Observed, Refusal, decide, decide_managed_secret, decide_refused
from tests.helpers import job_doc
from tests.unit.test_operator_reconcile import NOW, body, condition, statefulset, trainer_job


def queued_doc(**spec: Any) -> dict[str, Any]:
    doc = job_doc(**spec)
    doc["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "gpu-queue"}
    return doc


def test_a_queued_job_renders_one_workload_with_a_pod_set_per_role():
    objects = builders.build_children(
        plan(parse_job(queued_doc(trainer={"replicas": 2}, inference={"replicas": 3}))), owner_uid="u", token="t"
    )
    (workload,) = [o for o in objects if o["kind"] == "Workload"]
    assert workload["apiVersion"] == "kueue.x-k8s.io/v1beta1" and workload["metadata"]["name"] == "demo"
    assert workload["spec"]["queueName"] == "gpu-queue"
    trainer = next(o for o in objects if o["kind"] == "Job")["spec"]["template"]
    inference = next(o for o in objects if o["kind"] == "StatefulSet")["spec"]["template"]
    assert workload["spec"]["podSets"] == [
        {"name": "trainer", "count": 2, "template": trainer},
        {"name": "inference", "count": 3, "template": inference},
    ]
    assert workload["metadata"]["ownerReferences"][0]["controller"] is True
    assert not [
        o
        for o in builders.build_children(plan(parse_job(job_doc())), owner_uid="u", token="t")
        if o["kind"] == "Workload"
    ]


def view_of(doc: dict[str, Any]):
    doc = json.loads(json.dumps(doc))
    doc["metadata"].update(uid="uid-1", generation=2)
    first = job_view(doc)
    applied = json.loads(spec_json(first.job.spec))
    stored = body(applied=applied, suspend=doc["spec"].get("suspend", False))
    stored["metadata"]["labels"] = doc["metadata"]["labels"]
    return job_view(stored)


def admitted(status: str = "True", evicted: bool = False) -> dict[str, Any]:
    conditions = [
        {"type": "QuotaReserved", "status": status, "reason": "QuotaReserved" if status == "True" else "Pending"},
        {"type": "Admitted", "status": status, "reason": "Admitted" if status == "True" else "NoReservation"},
    ]
    if evicted:
        conditions.append({"type": "Evicted", "status": "True", "reason": "Preempted", "message": "preempted by x"})
    meta = {"name": "demo", "resourceVersion": "7", "generation": 1}
    return {"metadata": meta, "status": {"admission": {"clusterQueue": "cq"}, "conditions": conditions}}


def written_conditions(decision) -> dict[str, tuple[str, str]]:
    write = decision.queue_workload_write
    assert write is not None and write.status is not None
    assert write.status["metadata"] == {"resourceVersion": "7"}, "written only over the Workload it was decided from"
    return {x["type"]: (x["status"], x["reason"]) for x in write.status["status"]["conditions"]}


def test_until_kueue_admits_both_pools_no_workload_is_created():
    view = view_of(queued_doc())
    decision = decide(view, JobStatus(), Observed(queue_workload={"metadata": {"name": "demo"}}), NOW)
    assert decision.create == () and decision.status.phase == "Pending"
    assert condition(decision, names.ADMITTED) == ("False", names.R_QUEUED)
    assert "gpu-queue" in decision.status.message


def test_once_admitted_the_workloads_are_created():
    decision = decide(view_of(queued_doc()), JobStatus(), Observed(queue_workload=admitted()), NOW)
    assert sorted(o["kind"] for o in decision.create) == ["Job", "StatefulSet"]
    assert condition(decision, names.ADMITTED) == ("True", names.R_ADMITTED)


def test_an_evicted_job_gives_both_pools_back_then_its_quota():
    """Kueue sets Evicted and keeps the quota reserved; the integration gives it back once the job's pods are gone
    (pkg/controller/jobframework/reconciler.go, "handle eviction")."""
    observed = Observed(trainer_job(active=1), statefulset(1), queue_workload=admitted(evicted=True))
    decision = decide(view_of(queued_doc()), JobStatus(), observed, NOW)
    assert set(decision.delete) == {ChildRef("Job", "demo-trainer"), ChildRef("StatefulSet", "demo-inference")}
    assert decision.create == () and decision.status.phase == "Pending"
    assert condition(decision, names.ADMITTED) == ("False", names.R_EVICTED)
    assert "preempted by x" in decision.status.message and "being released" in decision.status.message
    assert not decision.queue_workload_write.released, "the quota stays reserved while the pods may still run"
    assert "admission" not in decision.queue_workload_write.status["status"]

    gone = decide(view_of(queued_doc()), decision.status, Observed(queue_workload=admitted(evicted=True)), NOW)
    assert written_conditions(gone) == {
        "QuotaReserved": ("False", "Pending"),
        "Admitted": ("False", "NoReservation"),
        "Evicted": ("True", "Preempted"),
        "Requeued": ("True", "Preempted"),
        "PodsReady": ("False", "WaitForStart"),
    }
    assert gone.queue_workload_write.status["status"]["admission"] is None
    quota = next(x for x in gone.queue_workload_write.status["status"]["conditions"] if x["type"] == "QuotaReserved")
    assert quota["message"] == "preempted by x" and quota["lastTransitionTime"] == "2026-01-01T12:00:00Z"


def test_after_other_evictions_kueue_requeues_the_workload_itself_and_the_job_says_so():
    workload = admitted(evicted=True)
    workload["status"]["conditions"][-1].update(reason="PodsReadyTimeout", message="Exceeded the PodsReady timeout")
    decision = decide(view_of(queued_doc()), JobStatus(), Observed(queue_workload=workload), NOW)
    assert written_conditions(decision)["Requeued"] == ("False", "PodsReadyTimeout")
    released = json.loads(json.dumps(workload))
    released["status"]["conditions"] = decision.queue_workload_write.status["status"]["conditions"]
    again = decide(view_of(queued_doc()), decision.status, Observed(queue_workload=released), NOW)
    assert again.queue_workload_write is None
    assert "requeues it once its PodsReadyTimeout backoff is over" in again.status.message


def test_a_finished_job_marks_its_workload_finished():
    observed = Observed(trainer_job(condition="Complete"), statefulset(1), queue_workload=admitted())
    decision = decide(view_of(queued_doc()), JobStatus(), observed, NOW)
    assert decision.status.phase == "Succeeded" and written_conditions(decision)["Finished"] == ("True", "Succeeded")
    again = decide(view_of(queued_doc()), decision.status, observed, NOW)
    assert written_conditions(again)["Finished"] == ("True", "Succeeded")  # until the Workload says Finished
    done = admitted()
    done["status"]["conditions"].append({"type": "Finished", "status": "True", "reason": "Succeeded"})
    assert (
        decide(view_of(queued_doc()), decision.status, Observed(queue_workload=done), NOW).queue_workload_write is None
    )


def test_pods_ready_follows_the_jobs_own_counts_as_kueue_words_it():
    """jobframework/reconciler.go generatePodsReadyCondition: WaitForStart until ready, Started, WaitForRecovery
    after a loss, Recovered; written only when its status or reason changes."""

    def write(workload, *objects):
        observed = Observed(*objects, queue_workload=workload)
        decision = decide(view_of(queued_doc()), JobStatus(), observed, NOW)
        return decision.queue_workload_write

    workload = admitted()
    first = write(workload, trainer_job(active=1), statefulset(0))
    assert written_conditions_of(first)["PodsReady"] == ("False", "WaitForStart")
    workload["status"]["conditions"] = first.status["status"]["conditions"]
    assert write(workload, trainer_job(active=1), statefulset(0)) is None, "nothing new, nothing written"
    ready = write(workload, trainer_job(active=1, ready=1), statefulset(1))
    assert written_conditions_of(ready)["PodsReady"] == ("True", "Started")
    workload["status"]["conditions"] = ready.status["status"]["conditions"]
    lost = write(workload, trainer_job(active=1, ready=1), statefulset(0))
    assert written_conditions_of(lost)["PodsReady"] == ("False", "WaitForRecovery")
    workload["status"]["conditions"] = lost.status["status"]["conditions"]
    back = write(workload, trainer_job(active=1, ready=1), statefulset(1))
    assert written_conditions_of(back)["PodsReady"] == ("True", "Recovered")


def written_conditions_of(write) -> dict[str, tuple[str, str]]:
    return {x["type"]: (x["status"], x["reason"]) for x in write.status["status"]["conditions"]}


def test_a_suspended_jobs_workload_is_inactive_and_reactivated_only_by_whom_deactivated_it():
    """JobWithCustomWorkloadActivation (jobframework/reconciler.go): a suspended job neither holds nor waits for
    quota. A Workload that Kueue deactivated (RequeuingLimitExceeded, a rejected check) is not reactivated."""
    objects = builders.build_children(plan(parse_job(queued_doc(suspend=True))), owner_uid="u", token="t")
    (workload,) = [o for o in objects if o["kind"] == "Workload"]
    assert workload["spec"]["active"] is False
    assert workload["metadata"]["annotations"] == {kueue.DEACTIVATED_FOR_SUSPEND: "true"}

    suspended = view_of(queued_doc(suspend=True))
    decision = decide(suspended, JobStatus(), Observed(queue_workload=admitted()), NOW)
    assert decision.queue_workload_write.spec == {
        "metadata": {"annotations": {kueue.DEACTIVATED_FOR_SUSPEND: "true"}},
        "spec": {"active": False},
    }
    assert not decision.idle, "Kueue evicts the deactivated Workload next, and giving its quota back is ours"
    ours = admitted("False")
    ours["metadata"]["annotations"] = {kueue.DEACTIVATED_FOR_SUSPEND: "true"}
    ours["spec"] = {"active": False}
    resumed = decide(view_of(queued_doc()), JobStatus(), Observed(queue_workload=ours), NOW)
    assert resumed.queue_workload_write.spec == {
        "metadata": {"annotations": {kueue.DEACTIVATED_FOR_SUSPEND: None}},
        "spec": {"active": True},
    }
    by_kueue = admitted("False")
    by_kueue["spec"] = {"active": False}
    left = decide(view_of(queued_doc()), JobStatus(), Observed(queue_workload=by_kueue), NOW)
    assert left.queue_workload_write is None or left.queue_workload_write.spec is None


@pytest.mark.parametrize(
    ("evicted_reason", "check", "shown"),
    [
        ("DeactivatedDueToRequeuingLimitExceeded", None, "DeactivatedDueToRequeuingLimitExceeded"),
        ("Deactivated", None, "Deactivated"),
        ("AdmissionCheck", {"name": "prov", "state": "Rejected", "message": "no capacity"}, "prov rejected"),
    ],
)
def test_a_workload_kueue_deactivated_is_not_shown_as_waiting_to_be_admitted_again(evicted_reason, check, shown):
    """Kueue deactivates a Workload after too many requeues (RequeuingLimitExceeded), a rejected admission check, or
    a person's `spec.active: false`: it is not admitted again until someone reactivates it."""
    workload = admitted("False", evicted=True)
    workload["status"]["conditions"][-1].update(reason=evicted_reason, message="The workload is deactivated")
    workload["status"]["conditions"].append({"type": "Requeued", "status": "False", "reason": evicted_reason})
    workload["spec"] = {"active": False}
    if check is not None:
        workload["status"]["admissionChecks"] = [check]
    decision = decide(view_of(queued_doc()), JobStatus(), Observed(queue_workload=workload), NOW)
    assert condition(decision, names.ADMITTED) == ("False", names.R_DEACTIVATED)
    message = decision.status.message
    assert "to be admitted again" not in message and "deactivated" in message and shown in message
    assert "spec.active" in message and "kubectl patch" in message
    assert decision.queue_workload_write is None or decision.queue_workload_write.spec is None


# ---- what Kueue applies on admission: the admitted ResourceFlavors' node labels and tolerations -----------------

GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def flavor(name: str, node_labels: dict[str, str] | None = None, tolerations: list | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "ResourceFlavor",
        "metadata": {"name": name},
        "spec": {"nodeLabels": node_labels or {}, "tolerations": tolerations or []},
    }


FLAVORS = {
    "h100": flavor("h100", {"pool": "h100", "zone": "a"}, [GPU_TAINT]),
    "cpu": flavor("cpu", {"cpu-pool": "general"}),
    "l4": flavor("l4", {"pool": "l4"}, [{"key": "spot", "operator": "Equal", "value": "yes", "effect": "NoSchedule"}]),
}


def admitted_to(trainer: dict[str, str], inference: dict[str, str], checks: list | None = None) -> dict[str, Any]:
    """An admitted Workload whose pod sets got these flavors (resource -> ResourceFlavor name)."""
    workload = admitted()
    workload["status"]["admission"] = {
        "clusterQueue": "cq",
        "podSetAssignments": [
            {"name": "trainer", "flavors": trainer, "count": 1},
            {"name": "inference", "flavors": inference, "count": 1},
        ],
    }
    if checks:
        workload["status"]["admissionChecks"] = checks
    return workload


H100_L4 = admitted_to({"nvidia.com/gpu": "h100", "cpu": "cpu"}, {"nvidia.com/gpu": "l4"})


def test_the_flavors_of_each_pod_set_become_its_node_selector_and_tolerations():
    infos = kueue.pod_set_infos(H100_L4, FLAVORS)
    assert kueue.flavor_names(H100_L4) == ("cpu", "h100", "l4")
    trainer, inference = infos["trainer"], infos["inference"]
    assert trainer.node_selector == {"pool": "h100", "zone": "a", "cpu-pool": "general"}
    assert trainer.tolerations == [GPU_TAINT]
    assert inference.node_selector == {"pool": "l4"}
    assert inference.labels == {kueue.PODSET_LABEL: "inference"}


def test_merging_adds_to_the_template_and_never_duplicates_a_toleration():
    template = {
        "metadata": {"labels": {"app": "x"}},
        "spec": {
            "nodeSelector": {"zone": "a"},  # the same value as the flavor's: no clash
            # The same toleration, spelled with the default operator: kept once.
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [],
        },
    }
    merged = kueue.apply(template, kueue.pod_set_infos(H100_L4, FLAVORS)["trainer"])
    assert merged["spec"]["nodeSelector"] == {"zone": "a", "pool": "h100", "cpu-pool": "general"}
    assert merged["spec"]["tolerations"] == [GPU_TAINT]
    assert merged["metadata"]["labels"] == {"app": "x", kueue.PODSET_LABEL: "trainer"}
    assert template["spec"]["nodeSelector"] == {"zone": "a"}, "the input is not modified"
    equal_default = {"key": "spot", "value": "yes", "effect": "NoSchedule"}  # operator "" means Equal
    infos = kueue.pod_set_infos(H100_L4, FLAVORS)
    inference = kueue.apply({"spec": {"tolerations": [equal_default]}}, infos["inference"])
    assert inference["spec"]["tolerations"] == [equal_default]


def test_a_node_selector_the_flavor_contradicts_is_a_conflict_naming_both_values():
    template = {"spec": {"nodeSelector": {"pool": "a100"}}}
    with pytest.raises(kueue.PodSetConflict) as caught:
        kueue.apply(template, kueue.pod_set_infos(H100_L4, FLAVORS)["trainer"])
    message = str(caught.value)
    assert "nodeSelector" in message and "pool" in message and "a100" in message and "h100" in message
    assert "ResourceFlavor h100" in message


def test_admission_check_pod_set_updates_are_merged_and_may_clash_with_the_flavors():
    checks = [
        {
            "name": "provisioning",
            "state": "Ready",
            "podSetUpdates": [
                {"name": "trainer", "annotations": {"cluster-autoscaler.kubernetes.io/consume": "pr-1"}},
                {"name": "inference", "nodeSelector": {"pool": "h100"}},  # the flavor says l4
            ],
        }
    ]
    workload = admitted_to({"nvidia.com/gpu": "h100"}, {"nvidia.com/gpu": "l4"}, checks)
    with pytest.raises(kueue.PodSetConflict, match="admission check provisioning"):
        kueue.pod_set_infos(workload, FLAVORS)
    checks[0]["podSetUpdates"].pop()
    infos = kueue.pod_set_infos(workload, FLAVORS)
    assert infos["trainer"].annotations == {"cluster-autoscaler.kubernetes.io/consume": "pr-1"}


def test_once_admitted_the_workloads_carry_the_admitted_flavors():
    observed = Observed(queue_workload=H100_L4, flavors=FLAVORS)
    decision = decide(view_of(queued_doc()), JobStatus(), observed, NOW)
    created = {o["kind"]: o["spec"]["template"]["spec"] for o in decision.create}
    assert created["Job"]["nodeSelector"] == {"pool": "h100", "zone": "a", "cpu-pool": "general"}
    assert created["Job"]["tolerations"] == [GPU_TAINT]
    assert created["StatefulSet"]["nodeSelector"] == {"pool": "l4"}
    assert decision.read_flavors == ()


def test_the_flavors_are_read_before_the_workloads_are_created():
    decision = decide(view_of(queued_doc()), JobStatus(), Observed(queue_workload=H100_L4), NOW)
    assert decision.create == () and decision.read_flavors == ("cpu", "h100", "l4")
    gone = {**FLAVORS, "l4": None}  # read, and not there
    decision = decide(view_of(queued_doc()), JobStatus(), Observed(queue_workload=H100_L4, flavors=gone), NOW)
    assert decision.create == () and decision.read_flavors == () and decision.requeue_after is not None
    assert decision.status.phase == "Pending" and "ResourceFlavor l4" in decision.status.message


def test_a_restarted_trainer_job_gets_the_flavors_too():
    # Restart 1 committed and the failed trainer Job gone (with its pods): its replacement is created.
    observed = Observed(None, statefulset(1), queue_workload=H100_L4, flavors=FLAVORS)
    status = JobStatus(trainer_restarts=1)
    (created,) = decide(view_of(queued_doc()), status, observed, NOW).create
    assert created["kind"] == "Job" and created["spec"]["template"]["spec"]["nodeSelector"]["pool"] == "h100"


def test_a_flavor_that_contradicts_the_node_selector_fails_the_job_as_kueue_does():
    doc = queued_doc(trainer={"nodeSelector": {"pool": "a100"}})
    observed = Observed(queue_workload=H100_L4, flavors=FLAVORS)
    decision = decide(view_of(doc), JobStatus(), observed, NOW)
    assert decision.create == ()
    assert decision.status.phase == "Failed" and decision.status.completion_time is not None
    assert condition(decision, names.FAILED) == ("True", names.R_FAILED_TO_START)
    assert "pool" in decision.status.message and "a100" in decision.status.message
    assert "spec.trainer.nodeSelector" in decision.status.message
    assert [(e.type, e.reason) for e in decision.events if e.reason == "Failed"] == [("Warning", "Failed")]
    # Kueue's own integrations mark the Workload Finished with reason FailedToStart (its quota goes back).
    assert written_conditions(decision)["Finished"] == ("True", "FailedToStart")


# ---- every ending gives the quota back -----------------------------------------------------------------------------
# Kueue's jobframework marks a Workload Finished whenever its job has ended, whatever ended it
# (pkg/controller/jobframework/reconciler.go ReconcileGenericJob: "if the job is finished, mark the workload as
# finished"; FinishWorkload with reason Succeeded or Failed), and with reason FailedToStart where the job could not
# start at all (kueue.WorkloadFinishedReasonFailedToStart, e.g. on a podset info conflict). A Workload not Finished
# keeps its QuotaReserved: Kueue's cache counts its usage until it finishes.


def test_a_job_whose_pool_is_deleted_marks_its_workload_finished():
    from tests.unit.test_pool_reconcile import attached_before, view

    gone = PoolView("shared", None, PoolStatus())
    observed = Observed(trainer_job=trainer_job(active=1), pool=gone, queue_workload=admitted())
    decision = decide(_queued(view()), attached_before(), observed, NOW)
    assert decision.status.phase == "Failed" and condition(decision, names.FAILED)[1] == names.R_POOL_DELETED
    assert written_conditions(decision)["Finished"] == ("True", "Failed")


def _queued(view):
    """The view with its job in a Kueue queue (the label, as a user sets it)."""
    meta = view.job.metadata.model_copy(update={"labels": {c.KUEUE_QUEUE_LABEL: "gpu-queue"}})
    return dataclasses.replace(view, job=view.job.model_copy(update={"metadata": meta}))


def test_a_job_that_cannot_share_its_claim_marks_its_workload_finished_failed_to_start():
    doc = queued_doc(checkpoint={"pvc": {"claimName": "ckpts"}}, trainer={"replicas": 2})
    observed = Observed(claims={"ckpts": ("ReadWriteOncePod",)}, queue_workload=admitted())
    decision = decide(view_of(doc), JobStatus(), observed, NOW)
    assert decision.status.phase == "Failed" and condition(decision, names.FAILED)[1] == names.R_VOLUME_ACCESS_MODE
    assert written_conditions(decision)["Finished"] == ("True", "FailedToStart")


def test_a_refused_child_or_a_managed_secret_marks_the_workload_finished_failed_to_start():
    refusal = Refusal("Job", "demo-trainer", 403, "forbidden")
    refused = decide_refused(view_of(queued_doc()), JobStatus(), refusal, NOW, queue_workload=admitted())
    assert condition(refused, names.FAILED)[1] == names.R_CREATE_REFUSED
    assert written_conditions(refused)["Finished"] == ("True", "FailedToStart")
    managed = decide_managed_secret(
        view_of(queued_doc()), JobStatus(), "model.hfTokenSecret", "x", NOW, queue_workload=admitted()
    )
    assert condition(managed, names.FAILED)[1] == names.R_MANAGED_SECRET
    assert written_conditions(managed)["Finished"] == ("True", "FailedToStart")
    # A transient refusal ends nothing: the Workload keeps its quota while the create is retried.
    transient = decide_refused(
        view_of(queued_doc()), JobStatus(), Refusal("Job", "demo-trainer", 503, "x"), NOW, queue_workload=admitted()
    )
    assert transient.queue_workload_write is None


def test_a_refused_create_holds_its_finished_workload_until_the_spec_changes():
    """The review's W2, pass after pass: a refusal known only from the create stays Failed at its generation, and its
    Finished Workload is neither deleted nor re-queued; a new generation runs it again (a new Workload)."""
    doc = queued_doc()
    refused = decide_refused(
        view_of(doc), JobStatus(), Refusal("Job", "demo-trainer", 403, "denied"), NOW, queue_workload=admitted()
    )
    finished = admitted()
    finished["status"]["conditions"].append({"type": "Finished", "status": "True", "reason": "FailedToStart"})
    status = refused.status
    for _ in range(3):
        again = decide(view_of(doc), status, Observed(queue_workload=finished), NOW)
        assert again.status.phase == "Failed" and again.delete == () and again.create == () and again.idle
        assert again.queue_workload_write is None
        status = again.status
    changed = dataclasses.replace(view_of(doc), generation=3)  # the spec changed
    fixed = decide(changed, status, Observed(queue_workload=finished), NOW)
    assert fixed.status.phase == "Pending" and fixed.delete == (ChildRef("Workload", "demo"),)


def test_a_job_started_again_after_it_failed_to_start_queues_a_new_workload():
    """A spec fix runs a job that failed to start again (it has no completionTime); its Finished Workload holds no
    quota and is never admitted again, so it is deleted and a new one made (by the next full pass)."""
    doc = queued_doc(checkpoint={"pvc": {"claimName": "ckpts"}}, trainer={"replicas": 2})
    observed = Observed(claims={"ckpts": ("ReadWriteOncePod",)}, queue_workload=admitted())
    failed = decide(view_of(doc), JobStatus(), observed, NOW)
    finished = admitted()
    finished["status"]["conditions"].append({"type": "Finished", "status": "True", "reason": "FailedToStart"})
    fixed = Observed(claims={"ckpts": ("ReadWriteMany",)}, queue_workload=finished)
    again = decide(view_of(doc), failed.status, fixed, NOW)
    assert again.create == () and ChildRef("Workload", "demo") in again.delete
    assert condition(again, names.ADMITTED) == ("False", names.R_QUEUED)


def test_the_workloads_pods_ready_is_what_the_job_needs_to_make_progress():
    """Every trainer rank and at least one serving replica (the rule of the startup deadline): the job trains on the
    replicas that serve, so a replica lost or not yet scheduled must not let Kueue's waitForPodsReady (timeout, and
    since 0.16 recoveryTimeout, which defaults to timeout) evict a job that makes progress. The job's own PodsReady
    still counts every pod."""
    doc = queued_doc(inference={"replicas": 2})
    observed = Observed(trainer_job(active=1, ready=1), statefulset(1), queue_workload=admitted())
    decision = decide(view_of(doc), JobStatus(), observed, NOW)
    assert written_conditions(decision)["PodsReady"] == ("True", "Started")
    assert condition(decision, names.PODS_READY)[0] == "False", "the job's own condition counts every pod"
    no_server = Observed(trainer_job(active=1, ready=1), statefulset(0), queue_workload=admitted())
    assert written_conditions(decide(view_of(doc), JobStatus(), no_server, NOW))["PodsReady"][0] == "False"
    no_trainer = Observed(trainer_job(active=1, ready=0), statefulset(2), queue_workload=admitted())
    assert written_conditions(decide(view_of(doc), JobStatus(), no_trainer, NOW))["PodsReady"][0] == "False"


# ---- the queue label, followed; held while Kueue admits the job ------------------------------------------------------
# Kueue's webhooks refuse a change of a Job's queue-name label unless the Job is suspended
# (pkg/controller/jobframework/validation.go: the queue name is immutable while the job is not suspended, and a
# Kueue-managed job runs only once admitted); its Workload's spec.queueName may change until quota is reserved
# (pkg/webhooks/workload_webhook.go ValidateWorkloadUpdate).


def labelled(queue: str | None, **spec: Any):
    """view_of a job whose queue label now says `queue` (None: removed)."""
    doc = queued_doc(**spec)
    view = view_of(doc)
    labels = {c.KUEUE_QUEUE_LABEL: queue} if queue is not None else {}
    return dataclasses.replace(
        view, job=view.job.model_copy(update={"metadata": view.job.metadata.model_copy(update={"labels": labels})})
    )


def workload_in(queue: str, admitted_now: bool) -> dict[str, Any]:
    workload = admitted() if admitted_now else {"metadata": {"name": "demo", "resourceVersion": "7"}, "status": {}}
    workload["spec"] = {"queueName": queue}
    return workload


def test_the_queue_of_a_job_kueue_admitted_cannot_change():
    view = with_queue_in_effect(labelled("other-queue"), JobStatus(), workload_in("gpu-queue", True))
    assert view.job.queue_name == "gpu-queue" and view.queue_refused is not None
    observed = Observed(trainer_job(active=1, ready=1), statefulset(1), queue_workload=workload_in("gpu-queue", True))
    decision = decide(view, JobStatus(), observed, NOW)
    assert decision.delete == () and decision.create == ()
    refused = next(x for x in decision.status.conditions if x.type == names.SPEC_CHANGE_REFUSED)
    assert refused.status == "True" and c.KUEUE_QUEUE_LABEL in refused.message and "gpu-queue" in refused.message
    assert (decision.queue_workload_write is None) or (decision.queue_workload_write.spec is None)
    # Removed, the same: the job keeps its place and runs on.
    assert with_queue_in_effect(labelled(None), JobStatus(), workload_in("gpu-queue", True)).job.queue_name == (
        "gpu-queue"
    )


def test_the_queue_of_a_waiting_job_follows_its_label():
    view = with_queue_in_effect(labelled("other-queue"), JobStatus(), workload_in("gpu-queue", False))
    assert view.job.queue_name == "other-queue" and view.queue_refused is None
    decision = decide(view, JobStatus(), Observed(queue_workload=workload_in("gpu-queue", False)), NOW)
    assert decision.queue_workload_write.spec == {"spec": {"queueName": "other-queue"}}
    assert decision.create == ()


def test_a_waiting_job_whose_label_is_removed_leaves_kueue():
    view = with_queue_in_effect(labelled(None), JobStatus(), workload_in("gpu-queue", False))
    assert view.job.queue_name is None and view.queue_left == "demo"
    decision = decide(view, JobStatus(), Observed(), NOW)
    assert ChildRef("Workload", "demo") in decision.delete
    assert sorted(o["kind"] for o in decision.create) == ["Job", "StatefulSet"]


def test_a_job_running_without_a_queue_does_not_join_one():
    running_status = decide(labelled(None), JobStatus(), Observed(), NOW).status
    view = with_queue_in_effect(labelled("gpu-queue"), running_status, None)
    assert view.job.queue_name is None and view.queue_refused is not None
    # Suspended, it may: it then waits in the queue when resumed.
    suspended = with_queue_in_effect(labelled("gpu-queue", suspend=True), running_status, None)
    assert suspended.job.queue_name == "gpu-queue" and suspended.queue_refused is None


# ---- priority ------------------------------------------------------------------------------------------------------


def test_the_jobs_priority_class_reaches_its_pods_and_its_workload():
    """Kueue's integrations give a Workload the priority of its pods' PriorityClass (jobframework
    PrepareWorkloadPriority: spec.priorityClassName, spec.priority, priorityClassSource
    scheduling.k8s.io/priorityclass): Kueue orders a queue and preempts by it. Without one, every GRPOLoraJob
    ranked at 0 (below a cluster default)."""
    job_plan = plan(parse_job(queued_doc(scheduling={"priorityClassName": "research-high"})))
    assert builders.pods_priority_class(job_plan) == "research-high"
    objects = builders.build_children(job_plan, owner_uid="u", token="t", priority=("research-high", 1000))
    (workload,) = [o for o in objects if o["kind"] == "Workload"]
    assert {k: workload["spec"][k] for k in ("priorityClassName", "priority", "priorityClassSource")} == {
        "priorityClassName": "research-high",
        "priority": 1000,
        "priorityClassSource": "scheduling.k8s.io/priorityclass",
    }
    for kind in ("Job", "StatefulSet"):
        pod = next(o for o in objects if o["kind"] == kind)["spec"]["template"]["spec"]
        assert pod["priorityClassName"] == "research-high", kind
    # A role's podTemplate names its own: the pods keep it, and the Workload ranks with the trainer's.
    own = queued_doc(trainer={"podTemplate": {"spec": {"priorityClassName": "urgent"}}})
    assert builders.pods_priority_class(plan(parse_job(own))) == "urgent"
    # None known (no class, no cluster default): no priority fields (Kueue ranks it at 0).
    plain = [o for o in builders.build_children(plan(parse_job(queued_doc())), owner_uid="u", token="t")]
    assert "priority" not in next(o for o in plain if o["kind"] == "Workload")["spec"]


def test_a_jobs_services_select_only_the_pods_of_its_own_incarnation():
    """A job deleted and applied again under its name (a new uid): the old pods, still Terminating, keep their DNS
    records in a headless Service that publishes not-ready addresses, so a Service that selects by name alone lets
    the new trainer reach an old inference replica. Every pod carries its job's uid, and the Services select by it."""
    objects = builders.build_children(plan(parse_job(queued_doc())), owner_uid="uid-2", token="t")
    services = [o for o in objects if o["kind"] == "Service"]
    assert services and all(s["spec"]["selector"][builders.JOB_UID_LABEL] == "uid-2" for s in services)
    for kind in ("Job", "StatefulSet"):
        template = next(o for o in objects if o["kind"] == kind)["spec"]["template"]
        assert template["metadata"]["labels"][builders.JOB_UID_LABEL] == "uid-2", kind
    (workload,) = [o for o in objects if o["kind"] == "Workload"]
    pod_sets = workload["spec"]["podSets"]
    assert all(p["template"]["metadata"]["labels"][builders.JOB_UID_LABEL] == "uid-2" for p in pod_sets)
