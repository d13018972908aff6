"""What a job's decision reads from and writes on its Kueue Workload, pure (run by the operator's reconcile pass):
Kueue's verdict (the Admitted condition), the integration's writes while the job runs and the one ending path that
marks it Finished (grpolora.operator.kueue holds the Workload's own rules).

The seam Kueue's jobframework keeps behind its GenericJob interface (pkg/controller/jobframework/interface.go), for
a GRPOLoraJob:
- PodSets: builders.queue_workload (a pod set per role; on a pool the trainer's only).
- IsActive: `_nothing_active` (no workload left that makes pods, no pod active: as Kueue's batch/v1 Job reads
  status.active, which leaves out Terminating pods).
- PodsReady: readiness.makes_progress, written by `queue_write_of` (ranks ready or succeeded, one serving replica).
- Finished: `finish_workload` with `_finish_reason` (FailedToStart for a job that never started).
- IsSuspended / Suspend: the job's spec.suspend, and `waits_for_pool_room`: either keeps the Workload inactive
  (kueue.activation_patch), so that it holds no quota.
- RunWithPodSetsInfo: job_workloads (the admitted flavors applied to the pod templates, kueue.pod_set_infos).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from grpolora.api import constants as c
from grpolora.api.status import JobStatus
from grpolora.operator import conditions as cond
from grpolora.operator import kueue, names
from grpolora.operator import observe as obs
from grpolora.operator.job_decision import ChildRef, Decision, Observed
from grpolora.operator.job_status import TERMINAL, is_finished
from grpolora.operator.job_view import K8sObject

if TYPE_CHECKING:
    from grpolora.operator.job_course import Course
    from grpolora.operator.job_placement import JobPlacement


def finish_workload(decision: Decision, workload: K8sObject | None, stamp: str) -> Decision:
    """The one path of every ending (the main decision's, a deleted pool's, a refused child's, a managed Secret's, a
    claim the pods cannot share): a job that has ended marks its Kueue Workload Finished, as Kueue's jobframework
    does for its own kinds (reconciler.go ReconcileGenericJob, "if the job is finished, mark the workload as
    finished"), with reason FailedToStart where it never started (kueue WorkloadFinishedReasonFailedToStart), else
    its phase. Kueue counts a Workload's quota until it is Finished: an ending that skipped this held the
    ClusterQueue's GPUs until the job was deleted."""
    status = decision.status
    if workload is None or status.phase not in TERMINAL:
        return decision
    write = kueue.integration_write(
        workload,
        now=stamp,
        inactive=True,
        pods_ready=False,
        finished=(_finish_reason(status), status.message or status.phase or ""),
        suspended=False,
    )
    # Not idle until Kueue's Workload says Finished (a write that met a newer Workload is decided again).
    return dataclasses.replace(decision, queue_workload_write=write, idle=decision.idle and write is None)


def _finish_reason(status: JobStatus) -> str:
    """Kueue's Finished reason: FailedToStart for a job that never started (its children were refused, or Kueue's
    admission could not be honoured), else Succeeded or Failed."""
    failed = cond.find(status.conditions, names.FAILED)
    never_started = cond.find(status.conditions, names.CREATED)
    if status.phase == "Failed" and (
        (failed is not None and failed.reason == names.R_FAILED_TO_START)
        or (never_started is not None and never_started.status == "False")
    ):
        return names.R_FAILED_TO_START
    return str(status.phase)


def finished_workload_of_a_new_run(where: JobPlacement, old: JobStatus, observed: Observed) -> ChildRef | None:
    """The job's Kueue Workload when it is Finished but the job runs again (a spec fixed after it failed to start:
    such a failure has no completionTime). A Finished Workload is never admitted again and holds no quota, yet still
    says Admitted: it is deleted and a new one queued (the next full pass creates it), as Kueue's jobframework
    deletes a Workload that no longer matches its job (reconciler.go ensureOneWorkload)."""
    workload = observed.queue_workload
    if where.queue is None or not kueue.is_true(workload, kueue.FINISHED) or is_finished(old):
        return None
    assert workload is not None
    return ChildRef("Workload", workload["metadata"]["name"])


def waits_for_pool_room(where: JobPlacement) -> bool:
    """A queued job on a RolloutPool that has no place for it: its Workload is kept inactive (spec.active: false,
    as a suspended job's: grpolora.operator.kueue.activation_patch), so that Kueue neither admits it nor holds quota
    for it while it could not run, and waitForPodsReady never evicts and requeues it over and over (with
    backoffLimitCount, until RequeuingLimitExceeded). Made active again once the pool has a place: Kueue then queues
    and admits it, and the admitted job takes the place (pools.candidate). Two jobs that see one free place may
    both be admitted; the one the pool does not attach is made inactive again, its quota given back."""
    place = where.place
    return where.queue is not None and place is not None and not place.attached and not place.room


def pool_room_admission(where: JobPlacement) -> cond.Want:
    """The job's Admitted condition while it waits for room on its pool (waits_for_pool_room)."""
    assert where.place is not None
    return cond.Want(
        names.ADMITTED,
        "False",
        names.R_POOL_FULL,
        f"waiting for room on its RolloutPool ({where.place.message}): its Kueue Workload is kept inactive, holding "
        f"no quota, until a place is free; then it waits in LocalQueue {where.queue} to be admitted",
    )


def queue_write_of(
    where: JobPlacement, observed: Observed, course: Course, status: JobStatus, *, pods_ready: bool, stamp: str
) -> kueue.WorkloadWrite | None:
    """What to write on the job's Kueue Workload, as a job integration does (grpolora.operator.kueue)."""
    if where.queue is None or observed.queue_workload is None or course.phase in TERMINAL:
        return None  # an ending: decide's one ending path (finish_workload) marks the Workload Finished
    write = kueue.integration_write(
        observed.queue_workload,
        now=stamp,
        inactive=_nothing_active(observed),
        # What the job needs to make progress (readiness.makes_progress), not every pod of its own PodsReady.
        pods_ready=pods_ready,
        finished=None,
        suspended=where.job_plan.spec.suspend or waits_for_pool_room(where),
    )
    if (observed.queue_workload.get("spec") or {}).get("queueName") in (None, where.queue):
        return write
    # Its label moved it to another queue before Kueue admitted it (with_queue_in_effect): the Workload follows.
    moved = {"spec": {"queueName": where.queue}}
    if write is None:
        return kueue.WorkloadWrite(spec=moved)
    spec = {**(write.spec or {}), "spec": {**((write.spec or {}).get("spec") or {}), "queueName": where.queue}}
    return dataclasses.replace(write, spec=spec)


def _nothing_active(observed: Observed) -> bool:
    """No pod of the job can still run: its workloads are gone or being deleted (none will make a pod again), and
    none of its pods is active (obs.pod_active; the pass lists them while a workload is being deleted). Kueue's own
    integrations give an evicted Workload's quota back at this point (reconciler.go: once !job.IsActive()), not once
    the pods are gone: one stuck Terminating on a lost node would hold the quota for as long as it stays."""
    for workload in observed.workloads:
        if workload is not None and not obs.deleting(workload):
            return False
    return not any(obs.pod_active(pod) for pod in observed.pods)


def admission_of(queue: str | None, workload: K8sObject | None, *, api_missing: bool = False) -> cond.Want:
    """Kueue's verdict on the job's Workload: Admitted True (or no queue), else why not."""
    if queue is None:
        return cond.Want(
            names.ADMITTED, "True", names.R_NO_QUEUE, "not queued (no kueue.x-k8s.io/queue-name label or queueName)"
        )
    if workload is None and api_missing:
        return cond.Want(
            names.ADMITTED,
            "False",
            names.R_KUEUE_NOT_INSTALLED,
            f"the job waits in LocalQueue {queue} of Kueue, but the API server does not serve Kueue's Workloads "
            f"({c.KUEUE_API_VERSION}): is Kueue installed? Its Workload is created once Kueue's CRDs are there",
        )
    name = (workload or {}).get("metadata", {}).get("name", "")
    deactivated = kueue.deactivated_by_others(workload)
    if deactivated is not None:
        namespace = (workload or {}).get("metadata", {}).get("namespace", "")
        return cond.Want(
            names.ADMITTED,
            "False",
            names.R_DEACTIVATED,
            f"Kueue's Workload {name} is deactivated ({deactivated}): it stays out of the queue until it is "
            f"reactivated (kubectl patch workloads.kueue.x-k8s.io {name} -n {namespace} --type merge -p "
            '\'{"spec":{"active":true}}\', i.e. spec.active: true) or the job is re-created',
        )
    evicted = kueue.evicted(workload)
    if (
        evicted is not None
        and str(evicted.get("reason", "")).startswith("Deactivated")
        and kueue.is_active(workload)
        and not kueue.is_true(workload, kueue.QUOTA_RESERVED)
    ):
        evicted = None  # deactivated while suspended, active again: simply queued (Kueue resets Evicted on admission)
    if evicted is not None:
        why = f"evicted by Kueue ({evicted.get('reason', '')}: {evicted.get('message', '')})"
        released = "both pools released and the quota given back"
        requeued = kueue.condition(workload, kueue.REQUEUED)
        if kueue.is_true(workload, kueue.QUOTA_RESERVED):
            then = "both pools are being released; the quota goes back to Kueue once their pods are gone"
        elif requeued is not None and requeued.get("status") == "False":
            then = (
                f"{released}; Kueue requeues it once its {requeued.get('reason')} backoff is over, then it waits in "
                f"LocalQueue {queue} to be admitted again"
            )
        else:
            then = f"{released}; waiting in LocalQueue {queue} to be admitted again"
        return cond.Want(names.ADMITTED, "False", names.R_EVICTED, f"{why}; {then}")
    if kueue.is_true(workload, kueue.ADMITTED):
        return cond.Want(names.ADMITTED, "True", names.R_ADMITTED, f"admitted by Kueue from LocalQueue {queue}")
    return cond.Want(
        names.ADMITTED,
        "False",
        names.R_QUEUED,
        f"waiting in Kueue LocalQueue {queue} for both pools to be admitted together (Workload {name or 'pending'})",
    )
