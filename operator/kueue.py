"""What Kueue's own job integrations apply to a job's pod templates when its Workload is admitted, pure.

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
