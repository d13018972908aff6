"""The workloads a job's decision creates, pure: its children as `grpolora render` builds them, the trainer Job marked
with its restart attempt, and what Kueue's admission adds to their pod templates (or why they wait for it)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpolora.api import constants as c
from grpolora.api.plan import JobPlan
from grpolora.operator import builders, kueue, names
from grpolora.operator.job_course import failed_now
from grpolora.operator.job_decision import API_RETRY_SECONDS, REPLACE_RECHECK_SECONDS, WORKLOAD_KINDS, Observed
from grpolora.operator.job_view import JobView, K8sObject

if TYPE_CHECKING:
    from grpolora.operator.job_course import Course
    from grpolora.operator.job_placement import JobPlacement


def children(
    job_plan: JobPlan,
    *,
    uid: str,
    token: str,
    operator_namespace: str = c.DEFAULT_OPERATOR_NAMESPACE,
    admitted: Mapping[str, kueue.PodSetInfo] | None = None,
    priority: tuple[str, int] | None = None,
) -> tuple[list[K8sObject], dict[str, K8sObject]]:
    """(the objects kept while suspended, the workloads by role), exactly as `grpolora render` builds them, with
    what Kueue's admission adds to the workloads' pod templates (raises kueue.PodSetConflict). By role, not kind:
    the inference servers and the environment server are both StatefulSets."""
    objects = builders.build_children(
        job_plan,
        owner_uid=uid,
        token=token,
        operator_namespace=operator_namespace,
        admitted=admitted,
        priority=priority,
    )
    kept = [o for o in objects if o["kind"] not in WORKLOAD_KINDS]
    return kept, {o["metadata"]["labels"][c.LABEL_ROLE]: o for o in objects if o["kind"] in WORKLOAD_KINDS}


def with_restart_attempt(trainer_job: K8sObject, attempt: int, incarnation: int | None = None) -> K8sObject:
    """The trainer Job marked with the restart that creates it and its incarnation (by default the attempt), each
    left unmarked at 0, as rendered. The incarnation goes on its pod template too: the pods' GRPOLORA_TRAINER_
    INCARNATION reads it (pod_spec._env), so that replicas refuse an earlier trainer that still runs (fencing,
    workers/sync/receiver.py)."""
    incarnation = attempt if incarnation is None else incarnation
    if attempt == 0 and incarnation == 0:
        return trainer_job
    marked = copy.deepcopy(trainer_job)
    template = marked["spec"]["template"].setdefault("metadata", {})
    for key, value in ((names.RESTART_ATTEMPT_ANNOTATION, attempt), (names.INCARNATION_ANNOTATION, incarnation)):
        if value:
            marked["metadata"].setdefault("annotations", {})[key] = str(value)
            template.setdefault("annotations", {})[key] = str(value)
    return marked


@dataclass(frozen=True)
class Build:
    """The workloads to create (decide's create stage), or what they wait for."""

    creates: tuple[K8sObject, ...] = ()
    read_flavors: tuple[str, ...] = ()
    flavor_wait: str | None = None


def workloads_to_create(
    view: JobView, where: JobPlacement, observed: Observed, course: Course, stamp: str
) -> tuple[Course, Build]:
    """The workloads the course wants, with what Kueue's admission adds to their pod templates; a conflict with the
    admission fails the job."""
    if not course.wanted_roles:
        return course, Build()
    placed = _placed_workloads(where.job_plan, view.uid, where.queue, observed)
    if isinstance(placed, kueue.PodSetConflict):
        message = (
            f"cannot start the pods where Kueue admitted them: {placed}. Kueue's own integrations refuse this too: "
            f"the Workload is marked Finished ({names.R_FAILED_TO_START}) and its quota returned. Re-create the job "
            f"with {placed.field_name} {placed.key} unset or set to {placed.wanted}"
        )
        return failed_now(course, observed, stamp, names.R_FAILED_TO_START, message), Build()
    if isinstance(placed, _FlavorsMissing):
        requeue = API_RETRY_SECONDS if not placed.unread else REPLACE_RECHECK_SECONDS
        return dataclasses.replace(course, requeue=requeue), Build(
            read_flavors=placed.unread, flavor_wait=placed.message
        )
    incarnation = course.incarnation
    if c.ROLE_TRAINER in course.wanted_roles:
        # Every new trainer Job is a new incarnation, whatever replaced the last one (names.INCARNATION_ANNOTATION).
        incarnation = 0 if course.incarnation is None else course.incarnation + 1
        course = dataclasses.replace(course, incarnation=incarnation)
    creates = tuple(
        with_restart_attempt(placed[role], course.restarts, incarnation) if role == c.ROLE_TRAINER else placed[role]
        for role in course.wanted_roles
    )
    return course, Build(creates=creates)


@dataclass(frozen=True)
class _FlavorsMissing:
    unread: tuple[str, ...]
    """Not read yet: read them and decide again."""
    message: str


def _placed_workloads(
    job_plan: JobPlan, uid: str, queue: str | None, observed: Observed
) -> dict[str, K8sObject] | kueue.PodSetConflict | _FlavorsMissing:
    """The workloads by role with what Kueue's admission adds (grpolora.operator.kueue); or why they cannot be built
    yet (ResourceFlavors to read, or one that does not exist), or the conflict that keeps them from starting."""
    workload = observed.queue_workload if queue is not None else None
    wanted = kueue.flavor_names(workload)
    flavors = observed.flavors or {}
    unread = tuple(name for name in wanted if name not in flavors)
    if unread:
        return _FlavorsMissing(unread, f"reading the ResourceFlavors Kueue admitted the job to: {', '.join(unread)}")
    absent = [name for name in wanted if flavors[name] is None]
    if absent:
        listed = ", ".join(f"ResourceFlavor {name}" for name in absent)
        return _FlavorsMissing(
            (),
            f"admitted by Kueue, but {listed} cannot be read (not found, or not allowed: the operator needs get on "
            "resourceflavors.kueue.x-k8s.io, the chart's kueue.resourceFlavors); retrying",
        )
    try:
        admitted = kueue.pod_set_infos(workload, flavors) if workload is not None else None
        return children(job_plan, uid=uid, token="", admitted=admitted)[1]
    except kueue.PodSetConflict as conflict:
        return conflict
