"""The reconcile decision, pure: from the job, what exists and what the trainer reports, decide which workloads to
create or delete and what the status is. No I/O, no clock (`now` is passed in), no randomness; the controller
(grpolora.operator.controller) reads the inputs and carries the decision out.
What a pass knows of the job itself (JobView) is grpolora.operator.job_view's, the events of a status change
grpolora.operator.job_events', and the stored status and its write grpolora.operator.job_status'.

Level-triggered: every pass decides from scratch, so a pass that is repeated or interrupted decides the same
again. The trainer restart is two-phase, as in JobSet: one pass commits `status.trainerRestarts + 1` (the status
write is the commit point); later passes see a trainer Job whose restart attempt is older than that count, delete
it (the controller deletes workloads in the foreground, so it stays until its pods are gone) and, once it has
left, create its replacement. A crash between the phases therefore neither loses nor doubles a restart, and old
and new trainer pods never run side by side.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from grpolora.api import constants as c
from grpolora.api.load import best_effort_warnings
from grpolora.api.plan import JobPlan, plan
from grpolora.api.pool import job_key
from grpolora.api.spec import GRPOLoraJob, GRPOLoraJobSpec
from grpolora.api.status import (
    JobPhase,
    JobStatus,
    RendezvousStatus,
    ReplicaCounts,
    RestartCounts,
    RoleReplicas,
    TrainerStatus,
)
from grpolora.operator import builders, kueue, names, pools
from grpolora.operator import conditions as cond
from grpolora.operator import observe as obs
from grpolora.operator.job_events import Event, transition_events
from grpolora.operator.job_status import TERMINAL, is_finished
from grpolora.operator.job_view import JobView, K8sObject

WORKLOAD_KINDS: Final = ("Job", "StatefulSet")
# After replacing a trainer Job, look again soon: the old one may take a moment to leave the API.
REPLACE_RECHECK_SECONDS: Final = 1.0


def suspended_message(spec: GRPOLoraJobSpec) -> str:
    """What suspension removes and what it really keeps (checkpoints only on a PVC)."""
    removed = "suspended: the trainer Job and inference StatefulSet are removed; the Secret, Services, NetworkPolicy"
    if spec.checkpoint.pvc is not None:
        return (
            f"{removed} and the checkpoints in claim {spec.checkpoint.pvc.claim_name} are kept. Set "
            "spec.suspend: false to resume from the latest checkpoint"
        )
    return (
        f"{removed} are kept, but the checkpoints were in the trainer pods' emptyDir and are gone: resuming "
        "(spec.suspend: false) trains from step 0 (set spec.checkpoint.pvc to keep checkpoints)"
    )


# ---- children ----------------------------------------------------------------------------------------------


def children(
    job_plan: JobPlan,
    *,
    uid: str,
    token: str,
    operator_namespace: str = c.DEFAULT_OPERATOR_NAMESPACE,
    admitted: Mapping[str, kueue.PodSetInfo] | None = None,
    priority: tuple[str, int] | None = None,
) -> tuple[list[K8sObject], dict[str, K8sObject]]:
    """(the objects kept while suspended, the workloads by kind), exactly as `grpolora render` builds them, with
    what Kueue's admission adds to the workloads' pod templates (raises kueue.PodSetConflict)."""
    objects = builders.build_children(
        job_plan,
        owner_uid=uid,
        token=token,
        operator_namespace=operator_namespace,
        admitted=admitted,
        priority=priority,
    )
    kept = [o for o in objects if o["kind"] not in WORKLOAD_KINDS]
    return kept, {o["kind"]: o for o in objects if o["kind"] in WORKLOAD_KINDS}


def with_restart_attempt(trainer_job: K8sObject, attempt: int) -> K8sObject:
    """The trainer Job marked with the restart that creates it (unmarked for the first, as rendered)."""
    if attempt == 0:
        return trainer_job
    marked = copy.deepcopy(trainer_job)
    marked["metadata"].setdefault("annotations", {})[names.RESTART_ATTEMPT_ANNOTATION] = str(attempt)
    # And its pods: their GRPOLORA_TRAINER_INCARNATION reads it (builders._env), so that replicas refuse the trainer
    # of an earlier attempt that still runs (fencing, workers/sync/receiver.py).
    template = marked["spec"]["template"].setdefault("metadata", {})
    template.setdefault("annotations", {})[names.RESTART_ATTEMPT_ANNOTATION] = str(attempt)
    return marked


# ---- the decision ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChildRef:
    kind: str
    name: str


@dataclass(frozen=True)
class Observed:
    """What one pass read: the workloads (None = absent), the job's pods, trainer rank 0's report."""

    trainer_job: K8sObject | None = None
    inference: K8sObject | None = None
    pods: tuple[K8sObject, ...] = ()
    trainer: TrainerStatus | None = None
    trainer_error: str | None = None
    blocked: tuple[ChildRef, ...] = ()
    """Children of this job's names that still belong to a deleted job of the same name (read as absent, never
    created over, never read as this job's): the garbage collector removes them shortly."""
    warnings: tuple[obs.NotReady, ...] = ()
    """Why pods are missing or stuck, from Warning events (see observe.pod_warnings)."""
    claims: Mapping[str, tuple[str, ...] | None] = field(default_factory=dict)
    """Access modes of the PersistentVolumeClaims the job mounts (None: the claim does not exist)."""
    queue_workload: K8sObject | None = None
    """The job's Kueue Workload (jobs with the queue label only; None: not there yet)."""
    queue_api_missing: bool = False
    """Creating the Workload answered 404: the API server does not serve Kueue's Workloads (Kueue not installed)."""
    flavors: Mapping[str, K8sObject | None] | None = None
    """The Kueue ResourceFlavors its admission names, by name (None in the map: no such flavor). Read only when a
    decision asks (Needs.flavors): the workloads of an admitted job are about to be created."""
    pool: pools.PoolView | None = None
    """The job's RolloutPool (jobs with spec.inference.poolRef only): its spec and status (the attachment list)."""
    trainer_pods_left: tuple[K8sObject, ...] | None = None
    """Trainer pods of this job's name that outlived their Job (deleted in the background by someone else, or by
    the collector after a delete of a job of the same name): read only when a decision would create a trainer Job
    (Needs.trainer_pods); None: not read."""
    owner_deleting: bool | None = None
    """The job read again from the API is being deleted (Needs.owner); None: not read."""
    managed_secret: tuple[str, str] | None = None
    """(field path, name) of a Secret the job names that is one of the operator's (Needs.secrets)."""
    secrets_checked: bool = False
    """The Secrets the job names were read (Needs.secrets): managed_secret says what was found."""
    token: str | None = None
    """Fingerprint of the token in the job's token Secret (grpolora.api.pool.token_fingerprint), as the last full
    pass read or made it; None: not known (the pods' token is then taken as current)."""


@dataclass(frozen=True)
class Refusal:
    """The API server refused to create a child."""

    kind: str
    name: str
    status: int
    message: str

    @property
    def transient(self) -> bool:
        """Unreachable, throttled or a server-side failure: retried as is (as kube.ApiError.transient)."""
        return self.status == 0 or self.status == 429 or self.status >= 500


@dataclass(frozen=True)
class Needs:
    """What a decision still needs read before it can be carried out: its pass reads all of it at once and decides
    a second and last time (JobPass._pass). Asked for only when workloads are about to be created."""

    owner: bool = False
    """Read the job again: is it being deleted? (a later pass creating children; the body it decides on may be older
    than the deletion, and a child created now would hold a foreground deletion)."""
    flavors: tuple[str, ...] = ()
    """The Kueue ResourceFlavors the admission names that were not read (Observed.flavors)."""
    trainer_pods: bool = False
    """List the trainer pods of the job's name (Observed.trainer_pods_left)."""
    secrets: bool = False
    """Read the Secrets the job names (Observed.managed_secret)."""

    def __bool__(self) -> bool:
        return self.owner or bool(self.flavors) or self.trainer_pods or self.secrets


@dataclass(frozen=True)
class Decision:
    status: JobStatus
    create: tuple[K8sObject, ...] = ()
    delete: tuple[ChildRef, ...] = ()
    delete_job: bool = False
    """ttlSecondsAfterFinished has passed: delete the GRPOLoraJob (its children follow by ownerReferences)."""
    requeue_after: float | None = None
    """Look again after this many seconds instead of the regular interval."""
    events: tuple[Event, ...] = ()
    queue_workload_write: kueue.WorkloadWrite | None = None
    """What to write on the job's Kueue Workload, as a job integration does (grpolora.operator.kueue): give the quota
    back after an eviction once the workloads are gone, mark it Finished when the job ends (Kueue then returns its
    quota)."""
    needs: Needs = Needs()
    """What to read, then decide again, before anything of this decision is carried out."""
    release: tuple[ChildRef, ...] = ()
    """Workloads to delete again, in the Background: their foreground deletion waits for pods that no longer hold
    anything back (stopped, or on a node that does not confirm their end: observe.pod_gone_for_replacement). The
    API server then drops their foregroundDeletion finalizer and removes them, freeing the name."""
    fence: tuple[str, ...] = ()
    """Pods taken as lost: remove their job-uid label (builders.JOB_UID_LABEL), so that no Service of the job selects
    them any more (a Terminating pod stays in a publishNotReadyAddresses Service's endpoints)."""
    idle: bool = False
    """Nothing can change until the spec does (finished without a pending TTL, suspended, never valid): no need to
    keep watching; a spec change runs a new pass."""

    @property
    def read_flavors(self) -> tuple[str, ...]:
        """The ResourceFlavors the workloads wait for (Needs.flavors)."""
        return self.needs.flavors


def volume_uses(spec: GRPOLoraJobSpec) -> list[obs.VolumeUse]:
    """The claims the job's pods share: the model on every pod (read-only), checkpoints on every trainer rank."""
    uses = []
    if spec.model.source is not None:
        pods = spec.trainer.replicas + spec.inference.replicas
        uses.append(obs.VolumeUse(spec.model.source.pvc.claim_name, "trainer and inference", pods, writes=False))
    if spec.checkpoint.pvc is not None:
        uses.append(obs.VolumeUse(spec.checkpoint.pvc.claim_name, "trainer", spec.trainer.replicas, writes=True))
    return uses


def should_poll_trainer(view: JobView, old: JobStatus, trainer_job: K8sObject | None) -> bool:
    """Poll trainer rank 0 only while its pod can answer (saves a connection error per pass while pending)."""
    if view.job is None or view.job.spec.suspend or is_finished(old) or trainer_job is None:
        return False
    return obs.job_active(trainer_job) > 0 and not obs.job_failed(trainer_job)


def decide(view: JobView, old: JobStatus, observed: Observed, now: datetime.datetime) -> Decision:
    """The decision of one pass (_decide); a job on a runtime also says which one it runs on, or waits for it."""
    stamp = cond.rfc3339(now)
    if observed.owner_deleting:
        view = dataclasses.replace(view, deleting=True)
    if view.runtime_wait is not None and not view.deleting:
        return _decide_waiting_for_runtime(view, old, stamp)
    decision = _decide(view, old, observed, now)
    if observed.managed_secret is not None and any(obj["kind"] in WORKLOAD_KINDS for obj in decision.create):
        return decide_managed_secret(view, old, *observed.managed_secret, now, queue_workload=observed.queue_workload)
    if view.runtime is not None:
        want = cond.Want(names.RUNTIME_RESOLVED, "True", names.R_RUNTIME_RESOLVED, f"runs on {view.runtime}")
        before = cond.find(old.conditions, names.RUNTIME_RESOLVED)  # its transition time, kept while it holds
        (resolved,) = cond.merge([before] if before else [], [want], now=stamp, generation=view.generation)
        conditions = [*(x for x in decision.status.conditions if x.type != names.RUNTIME_RESOLVED), resolved]
        decision = dataclasses.replace(decision, status=decision.status.model_copy(update={"conditions": conditions}))
    return _ended(decision, observed.queue_workload if not view.deleting else None, stamp)


def _ended(decision: Decision, workload: K8sObject | None, stamp: str) -> Decision:
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


def _decide_waiting_for_runtime(view: JobView, old: JobStatus, stamp: str) -> Decision:
    """A job whose runtime does not exist (or is invalid) yet: Pending, nothing created; its monitor looks again at
    the regular interval (one read of the runtime a pass, and none once the job has started)."""
    assert view.runtime_wait is not None
    reason, message = view.runtime_wait
    wants = [
        cond.Want(names.CREATED, "False", reason, message),
        _progressing_condition("Pending", None, "", message),
        cond.Want(names.SUCCEEDED, "False", names.R_IN_PROGRESS),
        cond.Want(names.FAILED, "False", names.R_NO_FAILURE),
        _invalid_condition(()),
        cond.Want(names.RUNTIME_RESOLVED, "False", reason, message),
    ]
    status = old.model_copy(
        update={
            "phase": "Pending",
            "message": message,
            "observed_generation": view.generation,
            "conditions": cond.merge(old.conditions, wants, now=stamp, generation=view.generation),
        }
    )
    return Decision(status=status, events=tuple(transition_events(old, status)))


def _decide(view: JobView, old: JobStatus, observed: Observed, now: datetime.datetime) -> Decision:
    """The decision of one pass, as a pipeline of stages that each return their part of it: where the job runs (its
    plan, its place on a pool, its Kueue queue), its course (phase, restarts, failures, what to delete), the workloads
    to create, the startup deadline, the end (releases, TTL), the status, and what to write on its Kueue Workload."""
    if view.deleting:
        # Being deleted: whatever the collector has removed so far stays removed (a child created now would only be
        # collected again, and in the foreground hold the job's removal). Nothing to do until the job is gone.
        return Decision(status=old, idle=True)
    stamp = cond.rfc3339(now)
    if view.job is None:
        return _decide_invalid(view, old, stamp)
    where = _placement(view, old, observed, now)
    if isinstance(where, Decision):
        return where
    spec = where.job_plan.spec  # on a pool: bound to it (its inference fields are the pool's)
    volumes = obs.volume_check(volume_uses(spec), observed.claims)
    if volumes.refusal and not is_finished(old) and not spec.suspend and observed.trainer_job is None:
        return _failed_to_start(view, old, names.R_VOLUME_ACCESS_MODE, volumes.refusal, stamp)
    stale = _finished_workload_of_a_new_run(where, old, observed)
    if stale is not None:
        observed = dataclasses.replace(observed, queue_workload=None)
    progress = obs.fold_trainer(old, observed.trainer)
    admission = _admission(where.queue, observed.queue_workload, api_missing=observed.queue_api_missing)
    course = _course(where, old, observed, admission, progress, now)
    if stale is not None:
        course = dataclasses.replace(course, deletes=(*course.deletes, stale), requeue=REPLACE_RECHECK_SECONDS)
    if view.queue_left is not None:  # the label removed before Kueue admitted it: it runs without a queue
        course = dataclasses.replace(course, deletes=(*course.deletes, ChildRef("Workload", view.queue_left)))
    course, build = _workloads_to_create(view, where, observed, course, stamp)
    overdue, course, build = _startup_deadline(where, old, observed, course, build, now, stamp)
    course, build = _active_deadline(spec, observed, course, build, now, stamp)
    course, delete_job = _end(spec, course, observed.inference, now)
    status, pods_ready = _status(
        view, old, observed, where, course, progress, admission, volumes, overdue, build, stamp
    )
    queue_write = _queue_write(where, observed, course, status, pods_ready=pods_ready, stamp=stamp)
    settled = (
        not build.creates
        and not course.deletes
        and not course.release
        and not course.fence
        and not delete_job
        and course.requeue is None
    )
    holds_quota = kueue.is_true(observed.queue_workload, kueue.QUOTA_RESERVED) and not kueue.is_true(
        observed.queue_workload, kueue.FINISHED
    )
    return Decision(
        queue_workload_write=queue_write,
        needs=_needs(view, observed, course, build),
        status=status,
        create=build.creates,
        delete=course.deletes,
        release=course.release,
        fence=course.fence,
        delete_job=delete_job,
        requeue_after=course.requeue,
        events=tuple(transition_events(old, status))
        + ((Event("Warning", names.E_TRAINER_POD_LOST, course.lost_note),) if course.lost_note else ()),
        # A suspended job's Workload may still hold quota: Kueue evicts it once deactivated, and the release is ours.
        idle=settled and (course.finished or course.phase == "Suspended") and queue_write is None and not holds_quota,
    )


def _needs(view: JobView, observed: Observed, course: _Course, build: _Build) -> Needs:
    """What must be read before the workloads this pass creates (or would, once their flavors are read) are
    created: the job's owner again (not on a new job's first pass, whose body is fresh), the flavors, the trainer
    pods left of its name, the Secrets it names. Each only once: what the observation holds is not asked again."""
    creating = course.wanted_kinds if build.creates or build.read_flavors else ()
    if not creating:
        return Needs()
    return Needs(
        owner=view.record_applied is None and observed.owner_deleting is None,
        flavors=build.read_flavors,
        trainer_pods="Job" in creating and observed.trainer_pods_left is None,
        secrets=not observed.secrets_checked,
    )


def _finished_workload_of_a_new_run(where: _Placement, old: JobStatus, observed: Observed) -> ChildRef | None:
    """The job's Kueue Workload when it is Finished but the job runs again (a spec fixed after it failed to start:
    such a failure has no completionTime). A Finished Workload is never admitted again and holds no quota, yet still
    says Admitted: it is deleted and a new one queued (the next full pass creates it), as Kueue's jobframework
    deletes a Workload that no longer matches its job (reconciler.go ensureOneWorkload)."""
    workload = observed.queue_workload
    if where.queue is None or not kueue.is_true(workload, kueue.FINISHED) or is_finished(old):
        return None
    assert workload is not None
    return ChildRef("Workload", workload["metadata"]["name"])


@dataclass(frozen=True)
class _Placement:
    """Where the job runs (decide's first stage)."""

    job_plan: JobPlan
    """On a pool: planned with it (its spec's inference fields are the pool's)."""
    place: pools.PoolPlace | None
    """Its place on its RolloutPool (None: not on a pool)."""
    queue: str | None
    """Its Kueue LocalQueue (None: not queued)."""


def _placement(view: JobView, old: JobStatus, observed: Observed, now: datetime.datetime) -> _Placement | Decision:
    """The job's plan, on its own or on its RolloutPool with its place there; the whole decision instead when its
    pool is missing or does not fit (_decide_without_pool)."""
    job = view.job
    assert job is not None
    place: pools.PoolPlace | None = None
    if job.spec.inference.pool_ref is not None:
        assert observed.pool is not None, "a job on a RolloutPool is decided with its pool"
        unusable = _decide_without_pool(view, old, observed, now)
        if unusable is not None:
            return unusable
        assert observed.pool.pool is not None
        job_plan = plan(job, pool=observed.pool.pool)
        key = job_key(view.namespace, view.name)
        place = pools.place(observed.pool.pool, observed.pool.status, key, view.uid, observed.token)
    else:
        job_plan = plan(job)
    return _Placement(job_plan, place, job_plan.job.queue_name)


@dataclass(frozen=True)
class _Course:
    """Where the job's run stands after this pass, as the stages after _placement decide it in turn."""

    phase: JobPhase
    completion: str | None
    final_message: str | None
    """The message of a terminal phase."""
    failed_reason: str
    restarts: int
    by_cause: RestartCounts
    token_digest: str | None
    restart_note: str | None = None
    rekey_note: str | None = None
    waiting_pods: str | None = None
    """Why a trainer Job is not created yet: pods of a previous one are still terminating."""
    lost_note: str | None = None
    """Pods of a previous trainer Job taken as lost in this pass, and when (a Warning event)."""
    release: tuple[ChildRef, ...] = ()
    fence: tuple[str, ...] = ()
    wanted_kinds: tuple[str, ...] = ()
    """The workloads to create (built by _workloads_to_create, once Kueue's additions are known)."""
    deletes: tuple[ChildRef, ...] = ()
    requeue: float | None = None
    active_since: str | None = None
    """When the job last became active (status.activeSince); None while it is not (spec.activeDeadlineSeconds)."""

    @property
    def finished(self) -> bool:
        return self.phase in TERMINAL and self.completion is not None


def _course(
    where: _Placement,
    old: JobStatus,
    observed: Observed,
    admission: cond.Want,
    progress: obs.Progress,
    now: datetime.datetime,
) -> _Course:
    """Finished, re-keyed, released (suspended, not admitted by Kueue, not attached to its pool), or running (the
    trainer's restarts and failures: _running_course)."""
    spec = where.job_plan.spec
    tj, sts = observed.trainer_job, observed.inference
    finished = is_finished(old)
    restarts = old.trainer_restarts or 0
    # A token Secret re-made with a new token (deleted by hand): pods keep the token they started with, so the job
    # is re-keyed as a whole -- every pod goes, then all come back with the new token (and the pool renews its
    # attachment, see pools.place) -- never old and new tokens side by side (401s, MACs that do not verify).
    stale_key = (
        observed.token is not None
        and old.token_digest is not None
        and observed.token != old.token_digest
        and not finished
    )
    pods_left = tj is not None or sts is not None
    course = _Course(
        phase=old.phase if finished and old.phase else "Pending",
        completion=old.completion_time,
        final_message=old.message if finished else None,
        failed_reason=_failed_reason(old) if finished else names.R_BACKOFF_LIMIT,
        restarts=restarts,
        # Jobs from before restartsByCause: every restart was a failure.
        by_cause=old.restarts_by_cause or RestartCounts(failure=restarts),
        token_digest=observed.token if (stale_key and not pods_left) or old.token_digest is None else old.token_digest,
        active_since=old.active_since,
    )
    if finished:
        return course  # terminal phases stick; only releasing the inference pods and the TTL are left
    if stale_key and pods_left and not spec.suspend and admission.status != "False":
        note = (
            f"re-keying: the token Secret {where.job_plan.token_secret} was re-made with a new token (was it "
            "deleted?); every pod is replaced, and created again with the new token once all are gone"
        )
        return dataclasses.replace(
            course,
            phase="Running" if old.phase == "Running" else "Pending",
            deletes=tuple(_release(tj, sts)),
            rekey_note=note,
            restart_note=note,
            requeue=REPLACE_RECHECK_SECONDS,
        )
    if spec.suspend or admission.status == "False" or (where.place is not None and not where.place.attached):
        # Suspended, not (or no longer) admitted by Kueue, or not (or no longer) served by its RolloutPool (whose
        # servers would refuse the trainer): no pods hold any GPU.
        # Not active: the deadline's clock stops, and starts over when it is again (as a Job's startTime on resume).
        return dataclasses.replace(
            course,
            phase="Suspended" if spec.suspend else "Pending",
            deletes=tuple(_release(tj, sts)),
            active_since=None,
        )
    course = dataclasses.replace(course, active_since=old.active_since or cond.rfc3339(now))
    return _running_course(where, old, observed, course, progress, now)


def _running_course(
    where: _Placement,
    old: JobStatus,
    observed: Observed,
    course: _Course,
    progress: obs.Progress,
    now: datetime.datetime,
) -> _Course:
    """A job that should run: its trainer Job's course (_trainer_course), then its StatefulSet and its phase."""
    blocked_kinds = {ref.kind for ref in observed.blocked}
    if blocked_kinds:
        course = dataclasses.replace(course, requeue=REPLACE_RECHECK_SECONDS)
    course = _trainer_course(where, observed, course, blocked_kinds, progress, now)
    if course.phase in TERMINAL:
        return course
    wanted_kinds = course.wanted_kinds
    sts, report = observed.inference, observed.trainer
    if sts is None and "StatefulSet" not in blocked_kinds and where.job_plan.inference is not None:
        wanted_kinds += ("StatefulSet",)
    alive = report is not None and report.phase in ("Starting", "Running")
    phase: JobPhase = "Running" if alive or old.phase == "Running" else "Pending"
    return dataclasses.replace(course, wanted_kinds=wanted_kinds, phase=phase)


def _trainer_course(
    where: _Placement,
    observed: Observed,
    course: _Course,
    blocked_kinds: set[str],
    progress: obs.Progress,
    now: datetime.datetime,
) -> _Course:
    """The trainer Job's course: created, replaced after a committed restart, succeeded, or failed (restarted, or
    the job fails)."""
    spec = where.job_plan.spec
    stamp = cond.rfc3339(now)
    tj, report = observed.trainer_job, observed.trainer
    if tj is None and "Job" in blocked_kinds:
        return course  # the previous job's trainer Job is still being collected
    if tj is not None and obs.restart_attempt(tj) < course.restarts:
        # Committed restart: delete the stale Job (in the foreground: it stays until its pods are gone) and
        # create the replacement only once it has left, as JobSet does (kubernetes-sigs/jobset#392, #684).
        # Old and new ranks never overlap: a dying rank 0 still answers to the rendezvous name (the Services
        # publish not-ready addresses) and would spend a restart, and its GPUs are the ones the new pods need.
        # Except a pod whose node never confirms its end (_leaving_trainer): it would hold the restart forever.
        waiting = (
            f"restart {course.restarts}: waiting for the failed trainer Job and its pods to be gone before creating "
            "its replacement"
        )
        if not obs.deleting(tj):
            stale = ChildRef("Job", where.job_plan.trainer.workload_name)
            return dataclasses.replace(
                course, deletes=(*course.deletes, stale), restart_note=waiting, requeue=REPLACE_RECHECK_SECONDS
            )
        return _leaving_trainer(course, tj, observed.pods, now, waiting, restart=True)
    if tj is not None and obs.deleting(tj):
        # Deleted by a release (suspended, evicted, re-keyed) and wanted again: the same wait as a restart's.
        waiting = "waiting for the previous trainer Job and its pods to be gone before creating the trainer Job"
        return _leaving_trainer(course, tj, observed.pods, now, waiting, restart=False)
    if tj is None and observed.trainer_pods_left:
        # Old ranks still terminating: the new ones would meet them at the rendezvous name and wait for their
        # GPUs. Our own deletes are in the foreground (the Job stays until its pods are gone); this covers the
        # rest, e.g. `kubectl delete` in the background and a job re-applied under the same name.
        holding, lost, fence = _stale_trainer_pods(observed.trainer_pods_left, now)
        if holding:
            count = len(holding)
            waiting = f"waiting for {count} pod{'s' if count > 1 else ''} of a previous trainer Job to terminate"
            waiting = f"{waiting}: {_waiting_details(holding)}"
            return dataclasses.replace(course, waiting_pods=waiting, requeue=REPLACE_RECHECK_SECONDS)
        if fence:
            # Out of the Services first; the trainer Job comes at the next pass, after the relabel is written.
            note = f"{_lost_details(lost)}: taken out of the job's Services before the trainer Job is created"
            return dataclasses.replace(
                course, fence=fence, lost_note=note, waiting_pods=note, requeue=REPLACE_RECHECK_SECONDS
            )
    if tj is None:
        return dataclasses.replace(course, wanted_kinds=(*course.wanted_kinds, "Job"))
    if obs.job_succeeded(tj) or (report is not None and report.phase == "Succeeded"):
        return dataclasses.replace(
            course,
            phase="Succeeded",
            completion=stamp,
            final_message=f"trained {progress.step or 0}/{spec.grpo.steps} steps; "
            f"the inference replicas served adapter version {progress.sync_round or 0}",
        )
    if not obs.job_failed(tj):
        return course
    failure = obs.trainer_failure(tj, observed.pods)
    if failure.cause == names.CAUSE_INVALID_INPUT:
        return dataclasses.replace(
            course,
            phase="Failed",
            completion=stamp,
            failed_reason=names.R_POD_FAILURE_POLICY,
            final_message=f"the trainer cannot work with its spec or data (a restart would not help): "
            f"{failure.message}",
        )
    if failure.cause == names.CAUSE_DISRUPTION or course.by_cause.failure < spec.trainer.max_restarts:
        restarts, by_cause, note = _commit_restart(course.restarts, course.by_cause, failure, spec)
        # requeue 0: the next pass replaces the trainer Job
        return dataclasses.replace(course, restarts=restarts, by_cause=by_cause, restart_note=note, requeue=0.0)
    return dataclasses.replace(
        course,
        phase="Failed",
        completion=stamp,
        final_message=f"the trainer failed and spec.trainer.maxRestarts ({spec.trainer.max_restarts}) restarts are "
        f"used up; last failure: {failure.message}",
    )


def _leaving_trainer(
    course: _Course, tj: K8sObject, pods: Sequence[K8sObject], now: datetime.datetime, waiting: str, *, restart: bool
) -> _Course:
    """A trainer Job being deleted (in the foreground) that the job wants to replace: wait while any of its pods may
    still run; once each is stopped or lost (obs.pod_gone_for_replacement), release it: delete it again in the
    Background, so that the API server drops its foregroundDeletion finalizer and frees its name, and fence the lost
    pods. A lost pod's rank may still run, cut off: the data plane refuses an older trainer incarnation
    (GRPOLORA_TRAINER_INCARNATION, workers/sync/receiver.py), and the fence keeps its address out of the rendezvous
    name. Its pods are the pass's listing of the job's pods (taken as they are now while a workload is leaving)."""
    uid = (tj.get("metadata") or {}).get("uid")
    left = [
        pod
        for pod in pods
        if ((pod.get("metadata") or {}).get("labels") or {}).get(c.LABEL_ROLE) == c.ROLE_TRAINER
        and (uid is None or obs.controller_uid(pod) == uid)
    ]
    holding, lost, fence = _stale_trainer_pods(left, now)
    if holding or not left:  # (none left: the collector is about to drop the finalizer)
        note = f"{waiting}: {_waiting_details(holding)}" if holding else waiting
    else:
        release = (ChildRef("Job", tj["metadata"]["name"]),)
        lost_note = (
            f"{_lost_details(lost)}: the trainer Job is deleted again in the background (its foreground deletion "
            "waits for as long as a lost pod stays) and the lost pods are taken out of the job's Services"
            if lost
            else None
        )
        note = f"{waiting}: {lost_note}" if lost_note else waiting
        course = dataclasses.replace(course, release=release, fence=fence, lost_note=lost_note)
    if restart:
        return dataclasses.replace(course, restart_note=note, requeue=REPLACE_RECHECK_SECONDS)
    return dataclasses.replace(course, waiting_pods=note, requeue=REPLACE_RECHECK_SECONDS)


def _stale_trainer_pods(
    pods: Sequence[K8sObject], now: datetime.datetime
) -> tuple[list[K8sObject], list[K8sObject], tuple[str, ...]]:
    """(the pods that still hold a replacement back, those taken as lost, the names of the lost ones that a Service
    of the job still selects: the fence to write)."""
    holding = [pod for pod in pods if not obs.pod_gone_for_replacement(pod, now)]
    lost = [pod for pod in pods if not obs.pod_terminal(pod) and obs.pod_gone_for_replacement(pod, now)]
    fence = tuple(
        str(pod["metadata"]["name"])
        for pod in lost
        if builders.JOB_UID_LABEL in ((pod.get("metadata") or {}).get("labels") or {})
    )
    return holding, lost, fence


def _waiting_details(pods: Sequence[K8sObject]) -> str:
    """What each pod waited for is doing, and when the wait ends (the first few)."""
    details = []
    for pod in pods[:_PODS_NAMED]:
        name, asked, lost_at = pod["metadata"]["name"], obs.pod_deletion_asked(pod), obs.pod_lost_at(pod)
        if asked is None or lost_at is None:
            details.append(f"pod {name} not deleted yet")
            continue
        deadline = pod["metadata"]["deletionTimestamp"]
        details.append(
            f"pod {name} Terminating since {cond.rfc3339(asked)} (its grace period ends at {deadline}); taken as lost "
            f"at {cond.rfc3339(lost_at)} if its node has not confirmed by then"
        )
    more = len(pods) - _PODS_NAMED
    return "; ".join(details) + (f"; and {more} more" if more > 0 else "")


def _lost_details(pods: Sequence[K8sObject]) -> str:
    details = []
    for pod in pods[:_PODS_NAMED]:
        asked, lost_at = obs.pod_deletion_asked(pod), obs.pod_lost_at(pod)
        assert asked is not None and lost_at is not None, "a lost pod is Terminating"
        details.append(
            f"pod {pod['metadata']['name']} Terminating since {cond.rfc3339(asked)}, its node does not confirm; "
            f"taken as lost at {cond.rfc3339(lost_at)}"
        )
    more = len(pods) - _PODS_NAMED
    return "; ".join(details) + (f"; and {more} more" if more > 0 else "")


_PODS_NAMED: Final = 3


@dataclass(frozen=True)
class _Build:
    """The workloads to create (decide's create stage), or what they wait for."""

    creates: tuple[K8sObject, ...] = ()
    read_flavors: tuple[str, ...] = ()
    flavor_wait: str | None = None


def _workloads_to_create(
    view: JobView, where: _Placement, observed: Observed, course: _Course, stamp: str
) -> tuple[_Course, _Build]:
    """The workloads the course wants, with what Kueue's admission adds to their pod templates; a conflict with the
    admission fails the job."""
    if not course.wanted_kinds:
        return course, _Build()
    placed = _placed_workloads(where.job_plan, view.uid, where.queue, observed)
    if isinstance(placed, kueue.PodSetConflict):
        message = (
            f"cannot start the pods where Kueue admitted them: {placed}. Kueue's own integrations refuse this too: "
            f"the Workload is marked Finished ({names.R_FAILED_TO_START}) and its quota returned. Re-create the job "
            f"with {placed.field_name} {placed.key} unset or set to {placed.wanted}"
        )
        return _failed_now(course, observed, stamp, names.R_FAILED_TO_START, message), _Build()
    if isinstance(placed, _FlavorsMissing):
        requeue = API_RETRY_SECONDS if not placed.unread else REPLACE_RECHECK_SECONDS
        return dataclasses.replace(course, requeue=requeue), _Build(
            read_flavors=placed.unread, flavor_wait=placed.message
        )
    creates = tuple(
        with_restart_attempt(placed[kind], course.restarts) if kind == "Job" else placed[kind]
        for kind in course.wanted_kinds
    )
    return course, _Build(creates=creates)


def _startup_deadline(
    where: _Placement,
    old: JobStatus,
    observed: Observed,
    course: _Course,
    build: _Build,
    now: datetime.datetime,
    stamp: str,
) -> tuple[str | None, _Course, _Build]:
    """Why the job's pods are overdue (spec.scheduling.startupDeadlineSeconds), if they are; with
    onStartupDeadline: Fail, the job fails and creates nothing."""
    spec = where.job_plan.spec
    tj = observed.trainer_job
    serving = _serving_replicas(spec, observed.inference, where.place)
    overdue = _startup_overdue(spec, old, course.phase, tj, serving, observed, now, on_pool=where.place is not None)
    if overdue is None or spec.scheduling.on_startup_deadline != "Fail":
        return overdue, course, build
    deletes = course.deletes
    if tj is not None and not obs.deleting(tj):
        deletes += (ChildRef("Job", tj["metadata"]["name"]),)  # release the trainer pool too
    failed = dataclasses.replace(
        course,
        phase="Failed",
        completion=stamp,
        failed_reason=names.R_STARTUP_DEADLINE,
        final_message=overdue,
        deletes=deletes,
    )
    return overdue, failed, dataclasses.replace(build, creates=())


def _active_deadline(
    spec: GRPOLoraJobSpec, observed: Observed, course: _Course, build: _Build, now: datetime.datetime, stamp: str
) -> tuple[_Course, _Build]:
    """spec.activeDeadlineSeconds: a job active for longer fails with reason DeadlineExceeded and creates nothing;
    its trainer Job goes here, its StatefulSet with every finished job's (_end). As the Job controller does
    (pkg/controller/job: pastActiveDeadline, then every active pod deleted and the Job Failed, DeadlineExceeded)."""
    deadline = spec.active_deadline_seconds
    if deadline is None or course.phase in TERMINAL or course.active_since is None:
        return course, build
    if (now - _parse_time(course.active_since)).total_seconds() < deadline:
        return course, build
    message = (
        f"active for longer than spec.activeDeadlineSeconds ({deadline} s, since {course.active_since}): its pods "
        "are deleted"
    )
    failed = _failed_now(course, observed, stamp, names.R_DEADLINE_EXCEEDED, message)
    return failed, dataclasses.replace(build, creates=())


def _failed_now(course: _Course, observed: Observed, stamp: str, reason: str, message: str) -> _Course:
    """The course of a job that fails in this pass: Failed with `reason` and `message`, and its trainer Job deleted
    (its StatefulSet goes with every finished job's, in _end)."""
    tj = observed.trainer_job
    deletes = course.deletes
    if tj is not None and not obs.deleting(tj) and ChildRef("Job", tj["metadata"]["name"]) not in deletes:
        deletes += (ChildRef("Job", tj["metadata"]["name"]),)
    return dataclasses.replace(
        course,
        phase="Failed",
        completion=stamp,
        failed_reason=reason,
        final_message=message,
        restart_note=None,
        deletes=deletes,
    )


def _end(spec: GRPOLoraJobSpec, course: _Course, sts: K8sObject | None, now: datetime.datetime) -> tuple[_Course, bool]:
    """A finished job releases its inference GPUs, and is deleted once ttlSecondsAfterFinished has passed (True)."""
    if not course.finished:
        return course, False
    deletes = course.deletes
    if sts is not None and not obs.deleting(sts):
        deletes += (ChildRef("StatefulSet", sts["metadata"]["name"]),)  # release the inference GPUs
    requeue, delete_job = course.requeue, False
    left = _ttl_left(spec, course.completion, now)
    if left is not None:
        delete_job = left <= 0
        requeue = None if delete_job else min(left, requeue if requeue is not None else left)
    return dataclasses.replace(course, deletes=deletes, requeue=requeue), delete_job


def _status(
    view: JobView,
    old: JobStatus,
    observed: Observed,
    where: _Placement,
    course: _Course,
    progress: obs.Progress,
    admission: cond.Want,
    volumes: obs.VolumeCheck,
    overdue: str | None,
    build: _Build,
    stamp: str,
) -> tuple[JobStatus, bool]:
    """The job's whole status after the pass, and whether its pods let it make progress (Kueue's PodsReady)."""
    spec, place, phase = where.job_plan.spec, where.place, course.phase
    tj, sts = observed.trainer_job, observed.inference
    wanted = phase not in (*TERMINAL, "Suspended")
    counts = ReplicaCounts(
        trainer=RoleReplicas(
            desired=spec.trainer.replicas if wanted else 0,
            ready=obs.job_ready(tj) if tj is not None and course.restart_note is None else 0,
        ),
        # On a pool: the pool's server replicas, which serve this job while it is attached.
        inference=RoleReplicas(desired=spec.inference.replicas if wanted else 0, ready=obs.statefulset_ready(sts))
        if place is None
        else RoleReplicas(desired=place.desired if wanted else 0, ready=place.ready),
    )
    pods = _pods_condition(wanted, phase, counts, observed)
    if overdue is not None and wanted:
        pods = cond.Want(names.PODS_READY, "False", names.R_STARTUP_DEADLINE, overdue)
    elif wanted and tj is not None and (tj.get("spec") or {}).get("suspend"):
        pods = cond.Want(
            names.PODS_READY, "False", names.R_TRAINER_JOB_SUSPENDED, _suspended_by_another(tj, where.queue)
        )
    rendezvous = _rendezvous_condition(
        wanted, phase, old, observed, progress, where.job_plan, replaced=course.restart_note
    )
    lost = f" ({progress.steps_lost} steps lost to trainer restarts)" if progress.steps_lost else ""
    running_message = (
        f"step {progress.step or 0}/{spec.grpo.steps}{lost}, sync round {progress.sync_round or 0}, "
        f"sync-group epoch {progress.epoch}"
    )
    restart_note = course.restart_note
    message = {
        "Pending": _pending_message(observed, where, course, pods, rendezvous, admission, build, wanted=wanted)
        or "waiting for the trainer and inference pods",
        "Running": f"{running_message}; {restart_note}" if restart_note else running_message,
        "Suspended": suspended_message(spec),
    }.get(phase, course.final_message or "")
    wants = [
        cond.Want(names.CREATED, "False", names.R_WAITING_FOR_PREVIOUS_JOB, _blocked_message(observed.blocked))
        if observed.blocked
        else cond.Want(names.CREATED, "True", names.R_CHILDREN_CREATED, "children created from the applied spec"),
        pods,
        rendezvous,
        cond.Want(names.PROGRESSING, "True", names.R_REKEYING, course.rekey_note)
        if course.rekey_note is not None
        else _progressing_condition(phase, restart_note, running_message, message),
        cond.Want(names.SUCCEEDED, "True", names.R_COMPLETED, message)
        if phase == "Succeeded"
        else cond.Want(names.SUCCEEDED, "False", names.R_IN_PROGRESS),
        cond.Want(names.FAILED, "True", course.failed_reason, message)
        if phase == "Failed"
        else cond.Want(names.FAILED, "False", names.R_NO_FAILURE),
        cond.Want(names.SUSPENDED, "True", names.R_SUSPENDED, suspended_message(spec))
        if phase == "Suspended"
        else cond.Want(names.SUSPENDED, "False", names.R_NOT_SUSPENDED),
        _invalid_condition(view.problems),
        _refused_condition(view.refused, view.queue_refused),
        _volumes_condition(volumes),
        admission,
        *([cond.Want(names.POOL_ATTACHED, _true(place.attached), place.reason, place.message)] if place else []),
        *_best_effort_condition(where.job_plan.job),
    ]
    status = JobStatus(
        phase=phase,
        message=message,
        observed_generation=view.generation,
        conditions=cond.merge(old.conditions, wants, now=stamp, generation=view.generation),
        **progress.status_fields(),
        total_steps=spec.grpo.steps,
        replicas=counts,
        rendezvous=_rendezvous(where.job_plan, progress.epoch),
        trainer_restarts=course.restarts,
        restarts_by_cause=course.by_cause,
        start_time=old.start_time or stamp,
        completion_time=course.completion,
        active_since=course.active_since,
        pool=where.job_plan.pool,
        token_digest=course.token_digest,
    )
    serving = _serving_replicas(spec, sts, place)
    return status, wanted and makes_progress(counts.trainer.ready, counts.trainer.desired, serving)


def _pending_message(
    observed: Observed,
    where: _Placement,
    course: _Course,
    pods: cond.Want,
    rendezvous: cond.Want,
    admission: cond.Want,
    build: _Build,
    *,
    wanted: bool,
) -> str:
    """Why a Pending job waits, the most telling reason last (each overrides those before it)."""
    why = pods.message if pods.status == "False" and wanted else ""
    if observed.blocked:
        why = _blocked_message(observed.blocked)
    if rendezvous.status != "True" and observed.trainer_error and wanted:
        why = "; ".join(p for p in (why, f"trainer rank 0: {observed.trainer_error}") if p)
    pending = course.phase == "Pending"
    if pending and admission.status == "False":
        why = admission.message
    if build.flavor_wait is not None and pending:
        why = build.flavor_wait
    if course.waiting_pods is not None and pending:
        why = course.waiting_pods
    place = where.place
    if place is not None and not place.attached and pending and admission.status == "True":
        why = place.message
    return why


def _queue_write(
    where: _Placement, observed: Observed, course: _Course, status: JobStatus, *, pods_ready: bool, stamp: str
) -> kueue.WorkloadWrite | None:
    """What to write on the job's Kueue Workload, as a job integration does (grpolora.operator.kueue)."""
    if where.queue is None or observed.queue_workload is None or course.phase in TERMINAL:
        return None  # an ending: decide's one ending path (_ended) marks the Workload Finished
    write = kueue.integration_write(
        observed.queue_workload,
        now=stamp,
        inactive=_nothing_active(observed),
        # What the job needs to make progress (makes_progress), not every pod of its own PodsReady condition.
        pods_ready=pods_ready,
        finished=None,
        suspended=where.job_plan.spec.suspend,
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
    for workload in (observed.trainer_job, observed.inference):
        if workload is not None and not obs.deleting(workload):
            return False
    return not any(obs.pod_active(pod) for pod in observed.pods)


def _release(tj: K8sObject | None, sts: K8sObject | None) -> list[ChildRef]:
    """Delete both workloads (those not already leaving): no pod of the job holds a GPU, or an old token, after."""
    found = (("Job", tj), ("StatefulSet", sts))
    return [ChildRef(kind, obj["metadata"]["name"]) for kind, obj in found if obj is not None and not obs.deleting(obj)]


def _commit_restart(
    restarts: int, by_cause: RestartCounts, failure: obs.TrainerFailure, spec: GRPOLoraJobSpec
) -> tuple[int, RestartCounts, str]:
    """One more trainer restart (committed by the status write), counted under its cause: a disruption does not
    spend spec.trainer.maxRestarts, a failure does. Returns the counts and the note for the Progressing condition."""
    if failure.cause == names.CAUSE_DISRUPTION:
        counted = by_cause.model_copy(update={"disruption": by_cause.disruption + 1})
        note = (
            f"restart {restarts + 1} from the latest checkpoint after a disruption (not counted against "
            f"spec.trainer.maxRestarts): {failure.message}"
        )
    else:
        counted = by_cause.model_copy(update={"failure": by_cause.failure + 1})
        limit = spec.trainer.max_restarts
        note = f"restart {counted.failure} of {limit} from the latest checkpoint: {failure.message}"
    return restarts + 1, counted, note


@dataclass(frozen=True)
class _FlavorsMissing:
    unread: tuple[str, ...]
    """Not read yet: read them and decide again."""
    message: str


def _placed_workloads(
    job_plan: JobPlan, uid: str, queue: str | None, observed: Observed
) -> dict[str, K8sObject] | kueue.PodSetConflict | _FlavorsMissing:
    """The workloads by kind with what Kueue's admission adds (grpolora.operator.kueue); or why they cannot be built
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


def _admission(queue: str | None, workload: K8sObject | None, *, api_missing: bool = False) -> cond.Want:
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


def _suspended_by_another(trainer_job: K8sObject, queue: str | None) -> str:
    """Why a trainer Job that the operator created unsuspended is suspended: most likely Kueue's batch/v1 Job
    integration, under manageJobsWithoutQueueName (see docs/operator.md, Kueue's manageJobsWithoutQueueName)."""
    name = trainer_job["metadata"]["name"]
    fix = (
        f"list {c.KIND}.{c.VERSION}.{c.GROUP} in Kueue's integrations.externalFrameworks, so that Kueue takes the "
        "job for the trainer Job's Kueue-managed owner"
    )
    if queue is None:
        fix += f", and give the job a {c.KUEUE_QUEUE_LABEL} label or spec.scheduling.queueName (Kueue holds a "
        fix += "Kueue-managed job's Jobs until its Workload is admitted)"
    return (
        f"the trainer Job {name} is suspended (spec.suspend: true), not by the operator: no trainer pod runs. Kueue's "
        f"Job integration does this under manageJobsWithoutQueueName; {fix}"
    )


def _failed_reason(old: JobStatus) -> str:
    """A finished job keeps the reason it failed with."""
    found = next((c for c in old.conditions if c.type == names.FAILED and c.status == "True"), None)
    return found.reason if found is not None else names.R_BACKOFF_LIMIT


def _blocked_message(blocked: Sequence[ChildRef]) -> str:
    listed = ", ".join(f"{ref.kind} {ref.name}" for ref in blocked)
    return f"waiting for the garbage collector to remove {listed}, left by a deleted job of the same name"


API_RETRY_SECONDS: Final = 5.0
_KIND_WORDS: Final = {
    "Secret": "token Secret",
    "Service": "headless Service",
    "NetworkPolicy": "NetworkPolicy",
    "Job": "trainer Job",
    "StatefulSet": "inference StatefulSet",
}


def decide_refused(
    view: JobView, old: JobStatus, refusal: Refusal, now: datetime.datetime, *, queue_workload: K8sObject | None = None
) -> Decision:
    """The API server refused to create a child: the job fails with its message, or waits if it may pass later.

    A refusal (invalid object, forbidden by RBAC or an admission webhook, quota) repeats until something changes,
    so the job fails with the API's message (no completionTime: a spec change runs a new pass, and until the
    children exist every field may change). A transient failure keeps the phase and is retried.
    """
    stamp = cond.rfc3339(now)
    what = f"{_KIND_WORDS.get(refusal.kind, refusal.kind)} {refusal.name}"
    if refusal.transient:
        message = f"retrying: the Kubernetes API failed to create the {what}: {refusal.message}"
        wants = [
            cond.Want(k.type, k.status, k.reason, k.message) for k in old.conditions if k.type != names.PROGRESSING
        ]
        wants.append(cond.Want(names.PROGRESSING, "False", names.R_API_RETRYING, message))
        status = old.model_copy(
            update={
                "phase": old.phase or "Pending",
                "message": message,
                "conditions": cond.merge(old.conditions, wants, now=stamp, generation=view.generation),
                "start_time": old.start_time or stamp,
            }
        )
        before = cond.find(old.conditions, names.PROGRESSING)
        events = () if before is not None and before.reason == names.R_API_RETRYING else (
            Event("Warning", names.R_API_RETRYING, message),
        )  # fmt: skip
        return Decision(status=status, requeue_after=API_RETRY_SECONDS, events=events)
    failed = _failed_to_start(
        view, old, names.R_CREATE_REFUSED, f"the API server refused the {what}: {refusal.message}", stamp
    )
    return _ended(failed, queue_workload, stamp)


def decide_managed_secret(
    view: JobView,
    old: JobStatus,
    path: str,
    name: str,
    now: datetime.datetime,
    *,
    queue_workload: K8sObject | None = None,
) -> Decision:
    """A Secret the job names (at `path`) is one of the operator's (its managed-by label): the job fails before any
    of its pods could mount it. Spec validation and the CRD refuse the names the operator gives its Secrets; this
    catches the rest (a job applied before that rule, a CRD installed without its CEL rules, another naming)."""
    message = (
        f"spec.{path}: Secret {name!r} is managed by the operator (label {c.LABEL_MANAGED_BY}={c.OPERATOR_NAME}): a "
        "job may not mount the operator's Secrets (with another job's token it could act as that job). Name a Secret "
        "of your own"
    )
    stamp = cond.rfc3339(now)
    return _ended(_failed_to_start(view, old, names.R_MANAGED_SECRET, message, stamp), queue_workload, stamp)


def _failed_to_start(
    view: JobView, old: JobStatus, reason: str, message: str, stamp: str, *, pool: str | None = None
) -> Decision:
    """The job cannot start as specified: Failed without a completionTime (a spec change runs a new pass, and until
    the children exist every field may change)."""
    wants = [
        cond.Want(names.CREATED, "False", reason, message),
        cond.Want(names.FAILED, "True", reason, message),
        _invalid_condition(view.problems),
        *([cond.Want(names.POOL_ATTACHED, "False", reason, message)] if pool else []),
    ]
    status = JobStatus(
        phase="Failed",
        message=message,
        observed_generation=view.generation,
        conditions=cond.merge(old.conditions, wants, now=stamp, generation=view.generation),
        start_time=old.start_time or stamp,
        pool=pool,
    )
    return Decision(status=status, events=tuple(transition_events(old, status)), idle=True)


def _decide_without_pool(view: JobView, old: JobStatus, observed: Observed, now: datetime.datetime) -> Decision | None:
    """A job on a RolloutPool that cannot be planned on it: the pool is missing or invalid, or the job does not fit
    it. None when it can (the regular decision follows).

    Does not fit: Failed at once, naming each mismatch (field and both values); nothing is created. Missing: a job
    that has not run on it waits (Pending, PoolNotFound) for it to be created; a job that ran on it fails
    (PoolDeleted): its servers and its sync group are gone with the pool, so its trainer Job is deleted (the
    checkpoints on spec.checkpoint.pvc stay; re-create the pool and the job to go on from the latest)."""
    assert view.job is not None and observed.pool is not None
    stamp = cond.rfc3339(now)
    pool, ref = observed.pool, observed.pool.name
    where = f"RolloutPool {view.namespace}/{ref}"
    if pool.usable_by(view.job):
        return None
    if is_finished(old):  # terminal phases stick; only the TTL is left
        left = _ttl_left(view.job.spec, old.completion_time, now)
        return Decision(status=old, delete_job=left is not None and left <= 0, requeue_after=left, idle=left is None)
    mismatch = pool.fit_errors(view.job)
    if mismatch:
        message = f"cannot run on {where}: " + "; ".join(f"spec.{path}: {why}" for path, why in mismatch)
        return _failed_to_start(view, old, names.R_POOL_MISMATCH, message, stamp, pool=ref)
    deletes: tuple[ChildRef, ...] = ()
    if pools.attached_condition(old.conditions):
        phase: JobPhase = "Failed"
        reason = names.R_POOL_DELETED
        message = (
            f"{where} was deleted while the job ran on it: its servers and sync group are gone. Re-create the pool "
            "and the job (with spec.checkpoint.pvc, training goes on from the latest checkpoint)"
        )
        tj = observed.trainer_job
        if tj is not None and not obs.deleting(tj):
            deletes = (ChildRef("Job", tj["metadata"]["name"]),)
    else:
        phase = "Pending"
        reason = names.R_POOL_INVALID if pool.problems else names.R_POOL_NOT_FOUND
        message = (
            f"waiting for {where}, which is invalid: {'; '.join(pool.problems)}"
            if pool.problems
            else f"waiting for {where}, which does not exist (spec.inference.poolRef); nothing is created until it does"
        )
    created = cond.find(old.conditions, names.CREATED)
    wants = [
        cond.Want(created.type, created.status, created.reason, created.message)
        if created is not None
        else cond.Want(names.CREATED, "False", reason, message),
        _progressing_condition(phase, None, "", message),
        cond.Want(names.SUCCEEDED, "False", names.R_IN_PROGRESS),
        cond.Want(names.FAILED, "True", reason, message)
        if phase == "Failed"
        else cond.Want(names.FAILED, "False", names.R_NO_FAILURE),
        _invalid_condition(view.problems),
        _refused_condition(view.refused, view.queue_refused),
        cond.Want(names.POOL_ATTACHED, "False", reason, message),
    ]
    status = old.model_copy(
        update={
            "phase": phase,
            "message": message,
            "observed_generation": view.generation,
            "conditions": cond.merge(old.conditions, wants, now=stamp, generation=view.generation),
            "completion_time": stamp if phase == "Failed" else None,
            "pool": ref,
        }
    )
    return Decision(status=status, delete=deletes, events=tuple(transition_events(old, status)))


def _ttl_left(spec: GRPOLoraJobSpec, completion: str | None, now: datetime.datetime) -> float | None:
    """Seconds until a finished job is deleted (spec.ttlSecondsAfterFinished); None without a TTL."""
    ttl = spec.ttl_seconds_after_finished
    if ttl is None or completion is None:
        return None
    return (_parse_time(completion) + datetime.timedelta(seconds=ttl) - now).total_seconds()


def _true(value: bool) -> Literal["True", "False"]:
    return "True" if value else "False"


def _decide_invalid(view: JobView, old: JobStatus, stamp: str) -> Decision:
    message = "invalid spec: " + "; ".join(view.problems)
    wants = [
        cond.Want(names.CREATED, "False", names.R_INVALID, "nothing is created for an invalid spec"),
        cond.Want(names.FAILED, "True", names.R_INVALID, message),
        _invalid_condition(view.problems),
    ]
    status = JobStatus(
        phase="Failed",
        message=message,
        observed_generation=view.generation,
        conditions=cond.merge(old.conditions, wants, now=stamp, generation=view.generation),
    )
    return Decision(status=status, events=tuple(transition_events(old, status)), idle=True)


def _rendezvous(job_plan: JobPlan, epoch: int) -> RendezvousStatus:
    return RendezvousStatus(
        master_addr=job_plan.master_addr,
        master_port=job_plan.master_port,
        trainer_world_size=job_plan.trainer_world_size,
        sync_addr=job_plan.sync.addr,
        sync_port=job_plan.sync.port,
        sync_world_size=job_plan.sync.world_size,
        sync_backend=job_plan.sync.backend,
        epoch=epoch,
        inference_endpoints=list(job_plan.inference_endpoints),
    )


def _serving_replicas(
    spec: GRPOLoraJobSpec, sts: K8sObject | None, place: pools.PoolPlace | None
) -> RoleReplicas | None:
    """The inference replicas serving the job: its own StatefulSet's, or on a pool the pool's servers (while it is
    attached); None while it has none."""
    if place is not None:
        return RoleReplicas(desired=place.desired, ready=place.ready) if place.attached else None
    return None if sts is None else RoleReplicas(desired=spec.inference.replicas, ready=obs.statefulset_ready(sts))


def makes_progress(trainer_ready: int, trainer_desired: int, serving: RoleReplicas | None) -> bool:
    """What a job needs to make progress: every trainer rank ready (the ranks train together) and at least one
    serving replica ready (the trainer generates on the replicas that serve and syncs the adapter to those; a lost or
    unscheduled replica rejoins at the next sync round). Kueue's PodsReady on the job's Workload says this, so that
    waitForPodsReady (timeout, and since Kueue 0.16 recoveryTimeout, which defaults to timeout) evicts only a job that
    cannot go on; the job's own PodsReady condition counts every pod."""
    return serving is not None and trainer_ready >= trainer_desired and serving.ready >= min(1, serving.desired)


def _startup_overdue(
    spec: GRPOLoraJobSpec,
    old: JobStatus,
    phase: str,
    tj: K8sObject | None,
    serving: RoleReplicas | None,
    observed: Observed,
    now: datetime.datetime,
    *,
    on_pool: bool,
) -> str | None:
    """Why the pods are overdue, when spec.scheduling.startupDeadlineSeconds has passed since PodsReady turned
    False (the children's creation, or the loss of a pod) and they are still not all ready; else None. On a pool
    the job's own pods are only the trainer's, and one ready server of the pool is enough: the job trains on the
    pool's ready servers, and a pool short of its desired replicas (scaled up beyond what the cluster can place, a
    replica lost) is the pool's to report (its Ready condition and events), never a reason to fail its jobs."""
    deadline = spec.scheduling.startup_deadline_seconds
    if deadline is None or phase not in ("Pending", "Running") or tj is None or serving is None:
        return None
    trainer_ready = obs.job_ready(tj)
    if (
        makes_progress(trainer_ready, spec.trainer.replicas, serving)
        if on_pool
        else (trainer_ready >= spec.trainer.replicas and serving.ready >= serving.desired)
    ):
        return None
    since = cond.find(old.conditions, names.PODS_READY)
    if since is None or since.status != "False" or not since.last_transition_time:
        return None
    if (now - _parse_time(since.last_transition_time)).total_seconds() < deadline:
        return None
    why = observed.warnings[0] if observed.warnings else obs.why_not_ready(observed.pods)
    ready = (
        f"trainer {obs.job_ready(tj)}/{spec.trainer.replicas} ready, inference {serving.ready}/{serving.desired} ready"
    )
    detail = f"{why.reason}: {why.message}" if why is not None else "no reason reported"
    return f"pods not all ready {deadline}s (spec.scheduling.startupDeadlineSeconds) after they were created: {ready}; {detail}"  # noqa: E501


def _pods_condition(wanted: bool, phase: str, counts: ReplicaCounts, observed: Observed) -> cond.Want:
    if not wanted:
        return cond.Want(names.PODS_READY, "False", names.R_NO_WORKLOADS, f"no pods: the job is {phase.lower()}")
    t, i = counts.trainer, counts.inference
    summary = f"trainer {t.ready}/{t.desired} ready, inference {i.ready}/{i.desired} ready"
    if t.ready >= t.desired and i.ready >= i.desired:
        return cond.Want(names.PODS_READY, "True", names.R_ALL_READY, summary)
    # Pods never created (FailedCreate) or stuck mounting say more than the pods' own "ContainerCreating".
    why = observed.warnings[0] if observed.warnings else obs.why_not_ready(observed.pods)
    if why is None:
        return cond.Want(names.PODS_READY, "False", names.R_WAITING_FOR_PODS, summary)
    return cond.Want(names.PODS_READY, "False", why.reason, f"{summary}; {why.message}")


def _rendezvous_condition(
    wanted: bool,
    phase: str,
    old: JobStatus,
    observed: Observed,
    progress: obs.Progress,
    job_plan: JobPlan,
    *,
    replaced: str | None,
) -> cond.Want:
    report = observed.trainer
    if not wanted:
        reason = names.R_SUSPENDED if phase == "Suspended" else names.R_FINISHED
        return cond.Want(names.RENDEZVOUS_READY, "False", reason, f"the job is {phase.lower()}")
    if report is not None and report.phase == "Running":
        members = ", ".join(map(str, report.sync_members)) or "none"
        return cond.Want(
            names.RENDEZVOUS_READY,
            "True",
            names.R_GROUP_FORMED,
            f"epoch {progress.epoch}: trainer rank 0 and inference replicas [{members}] "
            f"({len(report.sync_members)}/{job_plan.sync.world_size - 1}) at {job_plan.sync.addr}:{job_plan.sync.port}",
        )
    if report is not None:
        detail = f": {report.message}" if report.message else ""
        return cond.Want(
            names.RENDEZVOUS_READY,
            "False",
            names.R_FORMING,
            f"trainer rank 0 is {report.phase.lower()}, forming the process groups{detail}",
        )
    previous = cond.find(old.conditions, names.RENDEZVOUS_READY)
    if previous is not None and replaced is None and observed.trainer_job is not None and old.phase == "Running":
        # No new report (a missed poll): no new information, so no flip.
        return cond.Want(previous.type, previous.status, previous.reason, previous.message)
    why = observed.trainer_error or "trainer rank 0 is not running yet"
    return cond.Want(names.RENDEZVOUS_READY, "False", names.R_WAITING_FOR_TRAINER, why)


def _progressing_condition(phase: str, restart_note: str | None, running: str, message: str) -> cond.Want:
    if phase in TERMINAL:
        return cond.Want(names.PROGRESSING, "False", names.R_FINISHED, f"the job {phase.lower()}")
    if phase == "Suspended":
        return cond.Want(names.PROGRESSING, "False", names.R_SUSPENDED, "suspended")
    if restart_note is not None:
        return cond.Want(names.PROGRESSING, "True", names.R_TRAINER_RESTARTING, restart_note)
    if phase == "Running":
        return cond.Want(names.PROGRESSING, "True", names.R_TRAINING, running)
    return cond.Want(names.PROGRESSING, "False", names.R_PENDING, message)


def _best_effort_condition(job: GRPOLoraJob) -> list[cond.Want]:
    """PodsBestEffort, only when a role's pods would be BestEffort (the same rule and words as `grpolora validate`)."""
    warned = best_effort_warnings(job)
    if not warned:
        return []
    message = "; ".join(f"{w.path}: {w.message}" for w in warned)
    return [cond.Want(names.PODS_BEST_EFFORT, "True", names.R_NO_RESOURCE_REQUESTS, message)]


def _volumes_condition(volumes: obs.VolumeCheck) -> cond.Want:
    if volumes.refusal:  # a running job whose claim changed under it: it keeps running, the condition says why not
        return cond.Want(names.VOLUMES_SHAREABLE, "False", names.R_VOLUME_ACCESS_MODE, volumes.refusal)
    if volumes.warning:
        return cond.Want(names.VOLUMES_SHAREABLE, "False", names.R_SINGLE_NODE_ACCESS, volumes.warning)
    return cond.Want(names.VOLUMES_SHAREABLE, "True", names.R_ACCESS_MODES_FIT)


def _invalid_condition(problems: Sequence[str]) -> cond.Want:
    if problems:
        return cond.Want(names.INVALID_SPEC, "True", names.R_INVALID, "; ".join(problems))
    return cond.Want(names.INVALID_SPEC, "False", names.R_VALID)


def _refused_condition(refused: Sequence[str], queue: str | None = None) -> cond.Want:
    if not refused and queue is None:
        return cond.Want(names.SPEC_CHANGE_REFUSED, "False", names.R_UNCHANGED)
    messages = [queue] if queue is not None else []
    if refused:
        messages.insert(
            0,
            f"{', '.join(refused)} cannot change on a created job (only spec.suspend and spec.ttlSecondsAfterFinished "
            "can); the children keep the applied spec. Delete and re-create the job to apply the change",
        )
    return cond.Want(names.SPEC_CHANGE_REFUSED, "True", names.R_REFUSED, "; ".join(messages))


def _parse_time(value: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
