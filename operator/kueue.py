"""Kueue, pure: what a job integration owes its Workload, and what admission applies to the pod templates.

The operator is the job integration of its GRPOLoraJobs, as Kueue's jobframework (pkg/controller/jobframework) is for
Kueue's built-in kinds. Kueue's own controllers reserve quota, admit and evict; the integration must, on its side
(reconciler.go, JobReconciler.ReconcileGenericJob; kubernetes-sigs/kueue main of 2026-08, the same since 0.9):
- after an eviction (Evicted True), once its pods are gone: clear `status.admission`, set QuotaReserved False
  (reason Pending, the eviction's message) and with it Admitted False (NoReservation), and Requeued (True for a
  preemption or node failures, else False with the eviction's reason, which Kueue's Workload controller turns True
  after its backoff or on reactivation): workload.UnsetQuotaReservationWithCondition, SetRequeuedCondition,
  SyncAdmittedCondition. Until then Kueue counts the quota as used, and a preemptor is never admitted;
- write PodsReady from its pods (generatePodsReadyCondition): False WaitForStart until the pods of an admitted
  Workload are all ready, then True Started; False WaitForRecovery when they stop being ready, True Recovered after.
  Kueue's waitForPodsReady evicts a Workload whose PodsReady does not turn True in time (5 minutes by default);
- deactivate it (`spec.active: false`) while the job is suspended (as integrations with custom activation do:
  reconciler.go JobWithCustomWorkloadActivation), so that a suspended job neither holds quota nor is admitted; Kueue
  then evicts it (Deactivated) and the release above gives the quota back. On resume it is reactivated (Kueue
  requeues it: Requeued True, Reactivated), but only if the operator deactivated it;
- mark it Finished (reason Succeeded or Failed, or FailedToStart when the admission cannot be honoured), which
  returns the quota.
Every status write carries the Workload's resourceVersion as a precondition: it replaces the conditions list
(a merge patch replaces lists), and Kueue writes the same list; a conflict means "read again and decide again".

Kueue's jobframework, on admission (pkg/podset: FromAssignment, PodSetInfo.Merge, Merge), for each pod set:
- the ResourceFlavors named in `status.admission.podSetAssignments[].flavors` (resource -> flavor): each flavor's
  `spec.nodeLabels` join the pod template's nodeSelector and its `spec.tolerations` its tolerations (a flavor named
  for several resources counts once; of two flavors that label the same key, the later in the assignment wins, as in
  Kueue);
- the pod set's label `kueue.x-k8s.io/podset: <pod set name>` (Kueue 0.9+);
- the `podSetUpdates` of the Workload's admission checks (labels, annotations, nodeSelector, tolerations), e.g. the
  ProvisioningRequest check's; an update that contradicts the flavors is a conflict.
Merging into the template adds keys and appends tolerations that are not there yet (Kueue's toleration equality:
key, operator with "" meaning Equal, value, effect). A key the template already sets to another value is a conflict:
Kueue then refuses to start the job and marks the Workload Finished with reason FailedToStart; the operator does the
same (grpolora.operator.reconcile). Nothing is restored on eviction: the operator deletes the workloads then, and
builds them afresh from the job's spec on the next admission.
Not applied: topology-aware scheduling (its scheduling gate and topology assignment) and partial admission (the
pod sets have no minCount, so Kueue admits each with its full count).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

K8sObject = dict[str, Any]
PODSET_LABEL: Final = "kueue.x-k8s.io/podset"
_FIELDS: Final = ("labels", "annotations", "nodeSelector")

# Workload condition types and the reasons the integration writes (apis/kueue/v1beta1/workload_types.go).
ADMITTED: Final = "Admitted"
QUOTA_RESERVED: Final = "QuotaReserved"
EVICTED: Final = "Evicted"
REQUEUED: Final = "Requeued"
PODS_READY: Final = "PodsReady"
FINISHED: Final = "Finished"
# The eviction reasons after which the integration marks the Workload Requeued True at once (reconciler.go:
# setRequeued); after the others Kueue's Workload controller does, once the cause is over.
REQUEUED_AT_ONCE: Final = ("Preempted", "NodeFailures")
PENDING: Final = "Pending"  # QuotaReserved False after an eviction (WorkloadPending, the reason without the
# UnadmittedWorkloadsObservability feature gate; with it Kueue's own integrations write PendingEvaluation)
NO_RESERVATION: Final = "NoReservation"  # Admitted False without quota (WorkloadAdmittedReasonNoReservation)
WAIT_FOR_START: Final = "WaitForStart"
WAIT_FOR_RECOVERY: Final = "WaitForRecovery"
STARTED: Final = "Started"
RECOVERED: Final = "Recovered"
_NOT_READY: Final = "Not all pods are ready or succeeded"
_RECOVERING: Final = "At least one pod has failed, waiting for recovery"
_READY: Final = "All pods reached readiness and the workload is running"


@dataclass(frozen=True)
class PodSetInfo:
    """What Kueue's admission adds to one pod set's pod template."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    origins: dict[tuple[str, str], str] = field(default_factory=dict)
    """(field, key) -> where the value came from ("ResourceFlavor h100", "admission check provisioning")."""

    def values(self, field_name: str) -> dict[str, str]:
        return {"labels": self.labels, "annotations": self.annotations, "nodeSelector": self.node_selector}[field_name]


class PodSetConflict(ValueError):
    """The admission sets a key of a pod template's labels, annotations or nodeSelector to another value."""

    def __init__(self, pod_set: str, field_name: str, key: str, have: str, wanted: str, origin: str, holder: str):
        self.pod_set, self.field_name, self.key, self.have, self.wanted = pod_set, field_name, key, have, wanted
        self.origin, self.holder = origin, holder
        super().__init__(
            f"Kueue's admission of pod set {pod_set} sets {field_name} {key}={wanted} ({origin}), but {holder} "
            f"sets {key}={have}"
        )


def assignments(workload: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    admission = ((workload or {}).get("status") or {}).get("admission") or {}
    return list(admission.get("podSetAssignments") or [])


def flavor_names(workload: Mapping[str, Any] | None) -> tuple[str, ...]:
    """Every ResourceFlavor the Workload's admission names, sorted."""
    return tuple(sorted({str(f) for a in assignments(workload) for f in (a.get("flavors") or {}).values()}))


def pod_set_infos(
    workload: Mapping[str, Any], flavors: Mapping[str, Mapping[str, Any] | None]
) -> dict[str, PodSetInfo]:
    """What the admission adds to each pod set, by pod set name. `flavors`: every flavor of flavor_names(), read
    (KeyError for one that is missing). Raises PodSetConflict where an admission check contradicts the flavors."""
    infos: dict[str, PodSetInfo] = {}
    for assignment in assignments(workload):
        name = str(assignment.get("name", ""))
        info = PodSetInfo(name, labels={PODSET_LABEL: name})
        info.origins[("labels", PODSET_LABEL)] = "the pod set label Kueue adds"
        seen: list[str] = []
        for flavor_name in (assignment.get("flavors") or {}).values():
            if flavor_name in seen:
                continue
            seen.append(flavor_name)
            spec = (flavors[flavor_name] or {}).get("spec") or {}
            for key, value in (spec.get("nodeLabels") or {}).items():
                info.node_selector[key] = str(value)
                info.origins[("nodeSelector", key)] = f"ResourceFlavor {flavor_name}"
            _add_tolerations(info.tolerations, spec.get("tolerations") or [])
        infos[name] = info
    for check in ((workload.get("status") or {}).get("admissionChecks")) or []:
        for update in check.get("podSetUpdates") or []:
            info = infos.get(str(update.get("name", "")))
            if info is not None:
                _merge_into(info, update, f"admission check {check.get('name', '')}", holder="the admitted flavors")
    return infos


def apply(template: Mapping[str, Any], info: PodSetInfo, *, holder: str = "the pod template") -> K8sObject:
    """The pod template with the admission's additions (a copy). Raises PodSetConflict on a contradiction; `holder`
    names where the template's own values come from, for the message."""
    merged = copy.deepcopy(dict(template))
    meta, spec = merged.setdefault("metadata", {}), merged.setdefault("spec", {})
    ours = {"labels": meta.get("labels") or {}, "annotations": meta.get("annotations") or {}}
    ours["nodeSelector"] = spec.get("nodeSelector") or {}
    for field_name in _FIELDS:
        for key, wanted in info.values(field_name).items():
            have = ours[field_name].get(key)
            if have is not None and have != wanted:
                origin = info.origins.get((field_name, key), "Kueue's admission")
                raise PodSetConflict(info.name, field_name, key, have, wanted, origin, holder)
    for field_name, where in (("labels", meta), ("annotations", meta), ("nodeSelector", spec)):
        if info.values(field_name):
            where[field_name] = {**ours[field_name], **info.values(field_name)}
    tolerations = list(spec.get("tolerations") or [])
    _add_tolerations(tolerations, info.tolerations)
    if tolerations:
        spec["tolerations"] = tolerations
    return merged


def _merge_into(info: PodSetInfo, update: Mapping[str, Any], origin: str, *, holder: str) -> None:
    for field_name in _FIELDS:
        values = info.values(field_name)
        for key, wanted in (update.get(field_name) or {}).items():
            have = values.get(key)
            if have is not None and have != wanted:
                raise PodSetConflict(info.name, field_name, key, have, str(wanted), origin, holder)
            values[key] = str(wanted)
            info.origins[(field_name, key)] = origin
    _add_tolerations(info.tolerations, update.get("tolerations") or [])


def _add_tolerations(into: list[dict[str, Any]], more: list[Mapping[str, Any]]) -> None:
    for toleration in more:
        if not any(_same_toleration(have, toleration) for have in into):
            into.append(copy.deepcopy(dict(toleration)))


def _same_toleration(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Kueue's equality (pkg/util/tolerations): key, effect, value and operator, with "" meaning Equal."""

    def norm(t: Mapping[str, Any]) -> tuple[Any, ...]:
        return (t.get("key", ""), t.get("operator") or "Equal", t.get("value", ""), t.get("effect", ""))

    return norm(a) == norm(b)


# ---- the Workload's life, as a job integration owns it ---------------------------------------------------------


def conditions(workload: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    return list(((workload or {}).get("status") or {}).get("conditions") or [])


def condition(workload: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any] | None:
    """The Workload's condition of this type, whatever its status."""
    return next((x for x in conditions(workload) if x.get("type") == type_), None)


def is_true(workload: Mapping[str, Any] | None, type_: str) -> bool:
    found = condition(workload, type_)
    return found is not None and found.get("status") == "True"


def evicted(workload: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The Evicted condition while it is True."""
    return condition(workload, EVICTED) if is_true(workload, EVICTED) else None


def is_active(workload: Mapping[str, Any] | None) -> bool:
    """spec.active, true when unset (workload.IsActive)."""
    return ((workload or {}).get("spec") or {}).get("active") is not False


def deactivated_by_others(workload: Mapping[str, Any] | None) -> str | None:
    """Why Kueue (or a person) deactivated the Workload, or is about to; None when it is active, or inactive because
    the operator deactivated it for a suspended job. Kueue deactivates a Workload after too many requeues
    (RequeuingLimitExceeded) and after a rejected admission check, through the DeactivationTarget condition
    (workload_controller.go); the Evicted condition then carries the cause (DeactivatedDueTo<cause>)."""
    if workload is None:
        return None
    ours = DEACTIVATED_FOR_SUSPEND in ((workload.get("metadata") or {}).get("annotations") or {})
    rejected = [
        f"admission check {x.get('name', '')} rejected it: {x.get('message', '')}"
        for x in ((workload.get("status") or {}).get("admissionChecks") or [])
        if x.get("state") == "Rejected"
    ]
    target = condition(workload, "DeactivationTarget") if is_true(workload, "DeactivationTarget") else None
    if is_active(workload) and not rejected and target is None:
        return None
    if not is_active(workload) and ours:
        return None
    eviction = evicted(workload)
    reasons = [*rejected]
    if target is not None:
        reasons.append(f"{target.get('reason', '')}: {target.get('message', '')}")
    elif eviction is not None:
        reasons.append(f"{eviction.get('reason', '')}: {eviction.get('message', '')}")
    return "; ".join(reasons) or "spec.active is false"


@dataclass(frozen=True)
class WorkloadWrite:
    """What a pass writes on the job's Workload (the controller sends it after the job's status)."""

    status: dict[str, Any] | None = None
    """Merge patch of the Workload's status subresource: the whole conditions list (and `admission: null` when the
    quota is given back), with the resourceVersion it was computed from as a precondition."""
    spec: dict[str, Any] | None = None
    """Merge patch of the Workload itself: spec.active, and the annotation saying that the operator set it."""
    released: bool = False
    """The status patch gives the quota back (for the log)."""


# On a Workload the operator deactivated because its job is suspended; only such a Workload is reactivated when the
# job resumes (one that Kueue deactivated, e.g. RequeuingLimitExceeded, stays so: that is Kueue's or a person's call).
DEACTIVATED_FOR_SUSPEND: Final = "grpolora.dev/deactivated-for-suspend"


def integration_write(
    workload: Mapping[str, Any],
    *,
    now: str,
    inactive: bool,
    pods_ready: bool,
    finished: tuple[str, str] | None,
    suspended: bool,
) -> WorkloadWrite | None:
    """The integration's writes on the Workload (see the module docstring); None when there is nothing to write.

    `inactive`: the job's workloads are gone (no pod can hold the quota); `pods_ready`: every pod of the job is ready
    (the counts of the job's own PodsReady condition); `finished`: (reason, message) once the job has ended;
    `suspended`: the job's spec.suspend."""
    meta = workload.get("metadata") or {}
    generation = meta.get("generation")
    new = [dict(x) for x in conditions(workload)]
    released = False
    if is_true(workload, FINISHED):
        pass  # Kueue's reconciler stops here too: a Finished Workload is left alone
    elif finished is not None:
        _set(new, FINISHED, "True", finished[0], finished[1], now, generation)
    else:
        eviction = evicted(workload)
        if eviction is not None and is_true(workload, QUOTA_RESERVED) and inactive:
            reason, message = str(eviction.get("reason", "")), str(eviction.get("message", ""))
            _set(new, REQUEUED, _bool(reason in REQUEUED_AT_ONCE), reason, message, now, generation)
            _set(new, QUOTA_RESERVED, "False", PENDING, message, now, generation)
            if is_true(workload, ADMITTED):
                _set(new, ADMITTED, "False", NO_RESERVATION, "The workload has no reservation", now, generation)
            released = True
        admitted = any(x.get("type") == ADMITTED and x.get("status") == "True" for x in new)
        before = condition(workload, PODS_READY)
        status, reason, message = pods_ready_condition(before, admitted=admitted, ready=pods_ready)
        if before is None or (before.get("status"), before.get("reason")) != (status, reason):
            _set(new, PODS_READY, status, reason, message, now, generation)
    patch: dict[str, Any] | None = None
    if new != conditions(workload) or released:
        patch = {"status": {"conditions": new}}
        if released:
            patch["status"]["admission"] = None
        if meta.get("resourceVersion"):
            patch["metadata"] = {"resourceVersion": meta["resourceVersion"]}
    spec = activation_patch(workload, suspended=suspended) if finished is None else None
    if patch is None and spec is None:
        return None
    return WorkloadWrite(status=patch, spec=spec, released=released)


def activation_patch(workload: Mapping[str, Any], *, suspended: bool) -> dict[str, Any] | None:
    """Deactivate the Workload of a suspended job; reactivate it on resume if the operator deactivated it."""
    ours = DEACTIVATED_FOR_SUSPEND in ((workload.get("metadata") or {}).get("annotations") or {})
    if suspended and is_active(workload):
        return {"metadata": {"annotations": {DEACTIVATED_FOR_SUSPEND: "true"}}, "spec": {"active": False}}
    if not suspended and ours:
        return {"metadata": {"annotations": {DEACTIVATED_FOR_SUSPEND: None}}, "spec": {"active": True}}
    return None


def pods_ready_condition(before: Mapping[str, Any] | None, *, admitted: bool, ready: bool) -> tuple[str, str, str]:
    """(status, reason, message) of the Workload's PodsReady, as Kueue's generatePodsReadyCondition words it; written
    only when its status or reason changes (workload.HasConditionWithTypeAndReason)."""
    if not admitted:
        return "False", WAIT_FOR_START, _NOT_READY
    previous = (before or {}).get("reason")
    if ready:
        return "True", RECOVERED if previous in (WAIT_FOR_RECOVERY, RECOVERED) else STARTED, _READY
    if before is not None and (before.get("status") == "True" or previous == WAIT_FOR_RECOVERY):
        return "False", WAIT_FOR_RECOVERY, _RECOVERING
    return "False", WAIT_FOR_START, _NOT_READY


def _bool(value: bool) -> str:
    return "True" if value else "False"


def _set(
    into: list[dict[str, Any]], type_: str, status: str, reason: str, message: str, now: str, generation: Any
) -> None:
    """apimeta.SetStatusCondition: a condition's transition time moves only when its status changes."""
    wanted = {"type": type_, "status": status, "reason": reason or type_, "message": message}
    if generation is not None:
        wanted["observedGeneration"] = generation
    for existing in into:
        if existing.get("type") == type_:
            stamp = existing.get("lastTransitionTime") if existing.get("status") == status else now
            existing.update(wanted, lastTransitionTime=stamp or now)
            return
    into.append({**wanted, "lastTransitionTime": now})
