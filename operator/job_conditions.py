"""A job's status after a decision, pure: its phase message and every condition, and the decisions that only fail or
invalidate it (a child that cannot start, an invalid spec)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from grpolora.api import constants as c
from grpolora.api.load import best_effort_warnings
from grpolora.api.plan import JobPlan
from grpolora.api.spec import GRPOLoraJob, GRPOLoraJobSpec
from grpolora.api.status import JobStatus, RendezvousStatus, ReplicaCounts, RoleReplicas
from grpolora.operator import conditions as cond
from grpolora.operator import names, readiness
from grpolora.operator import observe as obs
from grpolora.operator.job_decision import ChildRef, Decision, Observed
from grpolora.operator.job_events import transition_events
from grpolora.operator.job_status import TERMINAL
from grpolora.operator.job_view import JobView, K8sObject

if TYPE_CHECKING:
    from grpolora.operator.job_course import Course
    from grpolora.operator.job_placement import JobPlacement
    from grpolora.operator.job_workloads import Build


def suspended_message(spec: GRPOLoraJobSpec) -> str:
    """What suspension removes and what it really keeps (checkpoints only on a PVC)."""
    workloads = "the trainer Job and inference StatefulSet are"
    if spec.environment_server is not None:
        workloads = "the trainer Job, inference StatefulSet and environment server StatefulSet are"
    removed = f"suspended: {workloads} removed; the Secret, Services, NetworkPolicy"
    if spec.checkpoint.pvc is not None:
        return (
            f"{removed} and the checkpoints in claim {spec.checkpoint.pvc.claim_name} are kept. Set "
            "spec.suspend: false to resume from the latest checkpoint"
        )
    return (
        f"{removed} are kept, but the checkpoints were in the trainer pods' emptyDir and are gone: resuming "
        "(spec.suspend: false) trains from step 0 (set spec.checkpoint.pvc to keep checkpoints)"
    )


def status_of(
    view: JobView,
    old: JobStatus,
    observed: Observed,
    where: JobPlacement,
    course: Course,
    progress: obs.Progress,
    admission: cond.Want,
    volumes: obs.VolumeCheck,
    overdue: str | None,
    build: Build,
    stamp: str,
) -> tuple[JobStatus, bool]:
    """The job's whole status after the pass, and whether its pods let it make progress (Kueue's PodsReady)."""
    spec, place, phase = where.job_plan.spec, where.place, course.phase
    tj, sts = observed.trainer_job, observed.inference
    wanted = phase not in (*TERMINAL, "Suspended")
    environment = readiness.environment_replicas(spec, observed.environment)
    if environment is not None and not wanted:
        environment = RoleReplicas(desired=0, ready=environment.ready)
    counts = ReplicaCounts(
        trainer=RoleReplicas(
            desired=spec.trainer.replicas if wanted else 0,
            ready=readiness.trainer_ranks_up(tj) if tj is not None and course.restart_note is None else 0,
        ),
        # On a pool: the pool's server replicas, which serve this job while it is attached.
        inference=RoleReplicas(desired=spec.inference.replicas if wanted else 0, ready=obs.statefulset_ready(sts))
        if place is None
        else RoleReplicas(desired=place.desired if wanted else 0, ready=place.ready),
        environment=environment,
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
    pending_reason, pending_why = _pending_message(
        observed, where, course, pods, rendezvous, admission, build, wanted=wanted
    )
    message = {
        "Pending": pending_why or "waiting for the trainer and inference pods",
        "Running": f"{running_message}; {restart_note}" if restart_note else running_message,
        "Suspended": suspended_message(spec),
    }.get(phase, course.final_message or "")
    progressing = (
        cond.Want(names.PROGRESSING, "True", names.R_REKEYING, course.rekey_note)
        if course.rekey_note is not None
        else progressing_condition(phase, restart_note, running_message, message)
    )
    reason = {
        "Pending": pending_reason,
        "Running": progressing.reason,
        "Succeeded": names.R_COMPLETED,
        "Failed": course.failed_reason,
        "Suspended": names.R_SUSPENDED,
    }.get(phase)
    wants = [
        cond.Want(names.CREATED, "False", names.R_WAITING_FOR_PREVIOUS_JOB, _blocked_message(observed.blocked))
        if observed.blocked
        else cond.Want(names.CREATED, "True", names.R_CHILDREN_CREATED, "children created from the applied spec"),
        pods,
        rendezvous,
        progressing,
        cond.Want(names.SUCCEEDED, "True", names.R_COMPLETED, message)
        if phase == "Succeeded"
        else cond.Want(names.SUCCEEDED, "False", names.R_IN_PROGRESS),
        cond.Want(names.FAILED, "True", course.failed_reason, message)
        if phase == "Failed"
        else cond.Want(names.FAILED, "False", names.R_NO_FAILURE),
        cond.Want(names.SUSPENDED, "True", names.R_SUSPENDED, suspended_message(spec))
        if phase == "Suspended"
        else cond.Want(names.SUSPENDED, "False", names.R_NOT_SUSPENDED),
        invalid_condition(view.problems),
        refused_condition(view.refused, view.queue_refused),
        _volumes_condition(volumes),
        admission,
        *([cond.Want(names.POOL_ATTACHED, _true(place.attached), place.reason, place.message)] if place else []),
        *_best_effort_condition(where.job_plan.job),
    ]
    status = JobStatus(
        phase=phase,
        message=message,
        reason=reason,
        progress=f"{progress.step or 0}/{spec.grpo.steps}",
        ready=f"{sum(r.ready for r in _roles(counts))}/{sum(r.desired for r in _roles(counts))}",
        observed_generation=view.generation,
        conditions=cond.merge(old.conditions, wants, now=stamp, generation=view.generation),
        **progress.status_fields(),
        total_steps=spec.grpo.steps,
        replicas=counts,
        rendezvous=_rendezvous(where.job_plan, progress.epoch),
        trainer_restarts=course.restarts,
        restarts_by_cause=course.by_cause,
        trainer_incarnation=course.incarnation,
        start_time=old.start_time or stamp,
        completion_time=course.completion,
        active_since=course.active_since,
        pool=where.job_plan.pool,
        token_digest=course.token_digest,
    )
    serving = readiness.serving_replicas(spec, sts, place)
    progress_made = readiness.makes_progress(counts.trainer.ready, counts.trainer.desired, serving, environment)
    return status, wanted and progress_made


def _roles(counts: ReplicaCounts) -> tuple[RoleReplicas, ...]:
    return (counts.trainer, counts.inference, *((counts.environment,) if counts.environment is not None else ()))


def _pending_message(
    observed: Observed,
    where: JobPlacement,
    course: Course,
    pods: cond.Want,
    rendezvous: cond.Want,
    admission: cond.Want,
    build: Build,
    *,
    wanted: bool,
) -> tuple[str, str]:
    """Why a Pending job waits, the most telling reason last (each overrides those before it): the reason of the
    condition it comes from (kubectl get glj's Reason column), and the message."""
    reason, why = (pods.reason, pods.message) if pods.status == "False" and wanted else ("", "")
    if not why:  # the pods are ready: the trainer is starting (or the job waits for its pods to be made)
        reason = rendezvous.reason if wanted and rendezvous.status != "True" else names.R_WAITING_FOR_PODS
    if observed.blocked:
        reason, why = names.R_WAITING_FOR_PREVIOUS_JOB, _blocked_message(observed.blocked)
    if rendezvous.status != "True" and observed.trainer_error and wanted:
        reason = rendezvous.reason
        why = "; ".join(p for p in (why, f"trainer rank 0: {observed.trainer_error}") if p)
    pending = course.phase == "Pending"
    if pending and admission.status == "False":
        reason, why = admission.reason, admission.message
    if build.flavor_wait is not None and pending:
        reason, why = names.R_ADMITTED, build.flavor_wait
    if course.waiting_pods is not None and pending:
        reason, why = names.R_WAITING_FOR_PREVIOUS_JOB, course.waiting_pods
    place = where.place
    if place is not None and not place.attached and pending and admission.status == "True":
        reason, why = place.reason, place.message
    return reason, why


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


def _blocked_message(blocked: Sequence[ChildRef]) -> str:
    listed = ", ".join(f"{ref.kind} {ref.name}" for ref in blocked)
    return f"waiting for the garbage collector to remove {listed}, left by a deleted job of the same name"


def failed_to_start(
    view: JobView, old: JobStatus, reason: str, message: str, stamp: str, *, pool: str | None = None
) -> Decision:
    """The job cannot start as specified: Failed without a completionTime (a spec change runs a new pass, and until
    the children exist every field may change). A job that had started before (a resume or re-admission that meets
    a claim its pods cannot share, a pool it no longer fits) keeps the record of its run: restarts and their causes,
    its token digest, its incarnation, its progress."""
    wants = [
        cond.Want(names.CREATED, "False", reason, message),
        cond.Want(names.FAILED, "True", reason, message),
        invalid_condition(view.problems),
        *([cond.Want(names.POOL_ATTACHED, "False", reason, message)] if pool else []),
    ]
    status = JobStatus(
        phase="Failed",
        message=message,
        reason=reason,
        observed_generation=view.generation,
        conditions=cond.merge(old.conditions, wants, now=stamp, generation=view.generation),
        start_time=old.start_time or stamp,
        pool=pool,
        trainer_restarts=old.trainer_restarts,
        restarts_by_cause=old.restarts_by_cause,
        trainer_incarnation=old.trainer_incarnation,
        token_digest=old.token_digest,
        last_failed_attempt=old.last_failed_attempt,
        total_steps=old.total_steps,
        **obs.Progress.of(old, 0).status_fields(),
    )
    return Decision(status=status, events=tuple(transition_events(old, status)), idle=True)


def _true(value: bool) -> Literal["True", "False"]:
    return "True" if value else "False"


def decide_invalid(view: JobView, old: JobStatus, stamp: str) -> Decision:
    message = "invalid spec: " + "; ".join(view.problems)
    wants = [
        cond.Want(names.CREATED, "False", names.R_INVALID, "nothing is created for an invalid spec"),
        cond.Want(names.FAILED, "True", names.R_INVALID, message),
        invalid_condition(view.problems),
    ]
    status = JobStatus(
        phase="Failed",
        message=message,
        reason=names.R_INVALID,
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


def _pods_condition(wanted: bool, phase: str, counts: ReplicaCounts, observed: Observed) -> cond.Want:
    if not wanted:
        return cond.Want(names.PODS_READY, "False", names.R_NO_WORKLOADS, f"no pods: the job is {phase.lower()}")
    summary = readiness.summary(counts)
    if readiness.all_ready(counts):
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


def progressing_condition(phase: str, restart_note: str | None, running: str, message: str) -> cond.Want:
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


def invalid_condition(problems: Sequence[str]) -> cond.Want:
    if problems:
        return cond.Want(names.INVALID_SPEC, "True", names.R_INVALID, "; ".join(problems))
    return cond.Want(names.INVALID_SPEC, "False", names.R_VALID)


def refused_condition(refused: Sequence[str], queue: str | None = None) -> cond.Want:
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
