"""The course of a job's run in one decision, pure (grpolora.operator.reconcile.decide's middle stages): finished,
re-keyed, released or running; the trainer Job's restarts and failures and the wait for a replaced Job's pods; the
startup and active deadlines; the end (the inference released, the TTL)."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from grpolora.api import constants as c
from grpolora.api.spec import GRPOLoraJobSpec
from grpolora.api.status import JobPhase, JobStatus, ReplicaCounts, RestartCounts, RoleReplicas
from grpolora.operator import builders, job_failure, names, readiness
from grpolora.operator import conditions as cond
from grpolora.operator import observe as obs
from grpolora.operator.job_decision import REPLACE_RECHECK_SECONDS, ChildRef, Observed
from grpolora.operator.job_status import TERMINAL, is_finished
from grpolora.operator.job_view import K8sObject

if TYPE_CHECKING:
    from grpolora.operator.job_placement import JobPlacement
    from grpolora.operator.job_workloads import Build


@dataclass(frozen=True)
class Course:
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
    wanted_roles: tuple[str, ...] = ()
    """The roles whose workloads to create (built by _workloads_to_create, once Kueue's additions are known)."""
    deletes: tuple[ChildRef, ...] = ()
    requeue: float | None = None
    active_since: str | None = None
    """When the job last became active (status.activeSince); None while it is not (spec.activeDeadlineSeconds)."""
    incarnation: int | None = None
    """The newest trainer Job's incarnation (status.trainerIncarnation): the stored one, or the one a trainer Job
    created just before an operator crash carries; the workloads stage gives a new trainer Job the next."""

    @property
    def finished(self) -> bool:
        return self.phase in TERMINAL and self.completion is not None


def course_of(
    where: JobPlacement,
    old: JobStatus,
    observed: Observed,
    admission: cond.Want,
    progress: obs.Progress,
    now: datetime.datetime,
) -> Course:
    """Finished, re-keyed, released (suspended, not admitted by Kueue, not attached to its pool), or running (the
    trainer's restarts and failures: _running_course)."""
    spec = where.job_plan.spec
    tj = observed.trainer_job
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
    pods_left = any(workload is not None for workload in observed.workloads)
    course = Course(
        phase=old.phase if finished and old.phase else "Pending",
        completion=old.completion_time,
        final_message=old.message if finished else None,
        failed_reason=_failed_reason(old) if finished else names.R_BACKOFF_LIMIT,
        restarts=restarts,
        # Jobs from before restartsByCause: every restart was a failure.
        by_cause=old.restarts_by_cause or RestartCounts(failure=restarts),
        token_digest=observed.token if (stale_key and not pods_left) or old.token_digest is None else old.token_digest,
        active_since=old.active_since,
        incarnation=max(
            (n for n in (old.trainer_incarnation, obs.trainer_incarnation(tj)) if n is not None), default=None
        ),
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
            deletes=tuple(_release(observed)),
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
            deletes=tuple(_release(observed)),
            active_since=None,
        )
    course = dataclasses.replace(course, active_since=old.active_since or cond.rfc3339(now))
    return _running_course(where, old, observed, course, progress, now)


def _running_course(
    where: JobPlacement,
    old: JobStatus,
    observed: Observed,
    course: Course,
    progress: obs.Progress,
    now: datetime.datetime,
) -> Course:
    """A job that should run: its trainer Job's course (_trainer_course), then its StatefulSets (the inference
    servers', the environment server's) and its phase."""
    blocked = {ref.name for ref in observed.blocked}
    if blocked:
        course = dataclasses.replace(course, requeue=REPLACE_RECHECK_SECONDS)
    course = _trainer_course(where, observed, course, blocked, progress, now)
    if course.phase in TERMINAL:
        return course
    wanted_roles = course.wanted_roles
    report = observed.trainer
    plan = where.job_plan
    for role, sts in ((plan.inference, observed.inference), (plan.environment, observed.environment)):
        if role is None:
            continue
        if sts is None and role.workload_name not in blocked:
            wanted_roles += (role.role,)
        elif sts is not None and obs.deleting(sts):
            course = _leaving_statefulset(course, sts, role.role, observed.pods, now)
    alive = report is not None and report.phase in ("Starting", "Running")
    phase: JobPhase = "Running" if alive or old.phase == "Running" else "Pending"
    return dataclasses.replace(course, wanted_roles=wanted_roles, phase=phase)


def _trainer_course(
    where: JobPlacement,
    observed: Observed,
    course: Course,
    blocked: set[str],
    progress: obs.Progress,
    now: datetime.datetime,
) -> Course:
    """The trainer Job's course: created, replaced after a committed restart, succeeded, or failed (restarted, or
    the job fails). `blocked`: names of children still held by a deleted job of the same name."""
    spec = where.job_plan.spec
    stamp = cond.rfc3339(now)
    tj, report = observed.trainer_job, observed.trainer
    if tj is None and where.job_plan.trainer.workload_name in blocked:
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
        holding, lost, fence = _stale_pods(observed.trainer_pods_left, now)
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
        return dataclasses.replace(course, wanted_roles=(*course.wanted_roles, c.ROLE_TRAINER))
    if obs.job_succeeded(tj) or (report is not None and report.phase == "Succeeded"):
        return dataclasses.replace(
            course,
            phase="Succeeded",
            completion=stamp,
            final_message=f"trained {progress.step or 0}/{spec.grpo.steps} steps; "
            f"the inference replicas served adapter version {progress.sync_round or 0}",
        )
    if job_failure.job_failed(tj):
        failure = job_failure.trainer_failure(tj, observed.pods)
    else:
        # A pod of the current trainer Job on a lost node (deleted by the taint manager or a drain, its kubelet never
        # confirms): the Job controller counts it as terminating, neither active nor failed, so with one rank the Job
        # shows no condition for as long as the pod stays, and the podFailurePolicy's DisruptionTarget rule (matched
        # against terminal pods only) never fires. Past its lost deadline it is a disruption like any other.
        _, lost, _ = _stale_pods(_trainer_pods_of(tj, observed.pods), now)
        if not lost:
            return course
        failure = job_failure.TrainerFailure(
            names.CAUSE_DISRUPTION, f"{_lost_details(lost)} (the Job controller neither replaces nor fails it)"
        )
    then = job_failure.outcome(failure, course.restarts, course.by_cause, spec)
    if isinstance(then, job_failure.Restart):
        # requeue 0: the next pass replaces the trainer Job
        return dataclasses.replace(
            course, restarts=then.restarts, by_cause=then.by_cause, restart_note=then.note, requeue=0.0
        )
    return dataclasses.replace(
        course, phase="Failed", completion=stamp, failed_reason=then.reason, final_message=then.message
    )


def _leaving_trainer(
    course: Course, tj: K8sObject, pods: Sequence[K8sObject], now: datetime.datetime, waiting: str, *, restart: bool
) -> Course:
    """A trainer Job being deleted (in the foreground) that the job wants to replace: wait while any of its pods may
    still run; once each is stopped or lost (obs.pod_gone_for_replacement), release it: delete it again in the
    Background, so that the API server drops its foregroundDeletion finalizer and frees its name, and fence the lost
    pods. A lost pod's rank may still run, cut off: the data plane refuses an older trainer incarnation
    (GRPOLORA_TRAINER_INCARNATION, workers/sync/receiver.py), and the fence keeps its address out of the rendezvous
    name. Its pods are the pass's listing of the job's pods (taken as they are now while a workload is leaving)."""
    left = _trainer_pods_of(tj, pods)
    holding, lost, fence = _stale_pods(left, now)
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


def _trainer_pods_of(tj: K8sObject, pods: Sequence[K8sObject]) -> list[K8sObject]:
    """The trainer pods of this trainer Job (its controller uid) among the pass's listing of the job's pods."""
    return _pods_of(tj, c.ROLE_TRAINER, pods)


def _pods_of(workload: K8sObject, role: str, pods: Sequence[K8sObject]) -> list[K8sObject]:
    """The pods of this workload (its controller uid) and role among the pass's listing of the job's pods."""
    uid = (workload.get("metadata") or {}).get("uid")
    return [
        pod
        for pod in pods
        if ((pod.get("metadata") or {}).get("labels") or {}).get(c.LABEL_ROLE) == role
        and (uid is None or obs.controller_uid(pod) == uid)
    ]


def _leaving_statefulset(
    course: Course, sts: K8sObject, role: str, pods: Sequence[K8sObject], now: datetime.datetime
) -> Course:
    """The job's inference (or environment server) StatefulSet being deleted (in the foreground: a suspend, an
    eviction, a re-key) while the job wants one again: a server pod on a lost node would hold it for as long as the
    node object stays, and the job would run with no replicas (or no environment) at all. Once each of its pods has
    stopped or is lost (obs.pod_gone_for_replacement), it is released as a leaving trainer Job is (_leaving_trainer):
    deleted again in the Background, its lost pods out of the job's Services; the next pass creates the StatefulSet.
    Its pod of a lost pod's name waits for that name (a StatefulSet never makes a pod whose name is taken); the
    others run."""
    left = _pods_of(sts, role, pods)
    holding, lost, fence = _stale_pods(left, now)
    requeue = REPLACE_RECHECK_SECONDS if course.requeue is None else min(course.requeue, REPLACE_RECHECK_SECONDS)
    if holding or not left or not lost:
        return dataclasses.replace(course, requeue=requeue)
    note = (
        f"{_lost_details(lost)}: the {role} StatefulSet is deleted again in the background (its foreground "
        "deletion waits for as long as a lost pod stays) and the lost pods are taken out of the job's Services"
    )
    lost_note = f"{course.lost_note}; {note}" if course.lost_note else note
    return dataclasses.replace(
        course,
        release=(*course.release, ChildRef("StatefulSet", sts["metadata"]["name"])),
        fence=(*course.fence, *fence),
        lost_note=lost_note,
        requeue=requeue,
    )


def released_while_deleting(
    workloads: Sequence[K8sObject | None], pods: Sequence[K8sObject], now: datetime.datetime
) -> tuple[tuple[ChildRef, ...], tuple[str, ...], bool]:
    """For a job being deleted: (its workloads to release, the lost pods to fence, whether any workload is still
    leaving). The garbage collector deletes them in the foreground when the job is (`kubectl delete --cascade=
    foreground`, Argo CD), and a pod on a lost node would hold them, and so the job's removal, for as long as the node
    object stays; each whose pods have all stopped or are lost is deleted again in the Background, as on a restart
    (_leaving_trainer)."""
    release: tuple[ChildRef, ...] = ()
    fence: tuple[str, ...] = ()
    leaving = False
    for workload in workloads:
        if workload is None or not obs.deleting(workload):
            continue
        leaving = True
        left = _pods_of(workload, _role_of(workload), pods)
        holding, lost, lost_fence = _stale_pods(left, now)
        if left and lost and not holding:
            release += (ChildRef(str(workload.get("kind")), workload["metadata"]["name"]),)
            fence += lost_fence
    return release, fence, leaving


def _role_of(workload: K8sObject) -> str:
    """The role whose pods a workload of the job runs (its role label, as builders.labels sets it)."""
    return str(((workload.get("metadata") or {}).get("labels") or {}).get(c.LABEL_ROLE, ""))


def _stale_pods(
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


def startup_deadline(
    where: JobPlacement,
    old: JobStatus,
    observed: Observed,
    course: Course,
    build: Build,
    now: datetime.datetime,
    stamp: str,
) -> tuple[str | None, Course, Build]:
    """Why the job's pods are overdue (spec.scheduling.startupDeadlineSeconds), if they are; with
    onStartupDeadline: Fail (the default), a job that cannot make progress fails and creates nothing. One that
    trains on the replicas it has is only reported: Fail gives back GPUs held idle, not a running job's."""
    spec = where.job_plan.spec
    tj = observed.trainer_job
    serving = readiness.serving_replicas(spec, observed.inference, where.place)
    overdue = _startup_overdue(spec, old, course.phase, tj, serving, observed, now, on_pool=where.place is not None)
    if overdue is None or spec.scheduling.on_startup_deadline != "Fail":
        return overdue, course, build
    assert tj is not None  # overdue only with a trainer Job
    environment = readiness.environment_replicas(spec, observed.environment)
    if readiness.makes_progress(readiness.trainer_ranks_up(tj), spec.trainer.replicas, serving, environment):
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


def active_deadline(
    spec: GRPOLoraJobSpec, observed: Observed, course: Course, build: Build, now: datetime.datetime, stamp: str
) -> tuple[Course, Build]:
    """spec.activeDeadlineSeconds: a job active for longer fails with reason DeadlineExceeded and creates nothing;
    its trainer Job goes here, its StatefulSet with every finished job's (release_at_end). As the Job controller does
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
    failed = failed_now(course, observed, stamp, names.R_DEADLINE_EXCEEDED, message)
    return failed, dataclasses.replace(build, creates=())


def failed_now(course: Course, observed: Observed, stamp: str, reason: str, message: str) -> Course:
    """The course of a job that fails in this pass: Failed with `reason` and `message`, and its trainer Job deleted
    (its StatefulSet goes with every finished job's, in release_at_end)."""
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


def release_at_end(
    spec: GRPOLoraJobSpec, course: Course, servers: Sequence[K8sObject | None], now: datetime.datetime
) -> tuple[Course, bool]:
    """A finished job releases its inference GPUs and its environment server (`servers`: their StatefulSets), and
    is deleted once ttlSecondsAfterFinished has passed (True)."""
    if not course.finished:
        return course, False
    deletes = course.deletes
    for sts in servers:
        if sts is not None and not obs.deleting(sts):
            deletes += (ChildRef("StatefulSet", sts["metadata"]["name"]),)
    requeue, delete_job = course.requeue, False
    left = ttl_left(spec, course.completion, now)
    if left is not None:
        delete_job = left <= 0
        requeue = None if delete_job else min(left, requeue if requeue is not None else left)
    return dataclasses.replace(course, deletes=deletes, requeue=requeue), delete_job


def _release(observed: Observed) -> list[ChildRef]:
    """Delete every workload (those not already leaving): no pod of the job holds a GPU, or an old token, after."""
    kinds = ("Job", "StatefulSet", "StatefulSet")  # as Observed.workloads lists them
    return [
        ChildRef(kind, obj["metadata"]["name"])
        for kind, obj in zip(kinds, observed.workloads, strict=True)
        if obj is not None and not obs.deleting(obj)
    ]


def _failed_reason(old: JobStatus) -> str:
    """A finished job keeps the reason it failed with."""
    found = next((c for c in old.conditions if c.type == names.FAILED and c.status == "True"), None)
    return found.reason if found is not None else names.R_BACKOFF_LIMIT


def ttl_left(spec: GRPOLoraJobSpec, completion: str | None, now: datetime.datetime) -> float | None:
    """Seconds until a finished job is deleted (spec.ttlSecondsAfterFinished); None without a TTL."""
    ttl = spec.ttl_seconds_after_finished
    if ttl is None or completion is None:
        return None
    return (_parse_time(completion) + datetime.timedelta(seconds=ttl) - now).total_seconds()


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
    if deadline == 0 or phase not in ("Pending", "Running") or tj is None or serving is None:
        return None
    trainer_up = readiness.trainer_ranks_up(tj)
    environment = readiness.environment_replicas(spec, observed.environment)
    trainer = RoleReplicas(desired=spec.trainer.replicas, ready=trainer_up)
    counts = ReplicaCounts(trainer=trainer, inference=serving, environment=environment)
    if (
        readiness.makes_progress(trainer_up, spec.trainer.replicas, serving, environment)
        if on_pool
        else readiness.all_ready(counts)
    ):
        return None
    since = cond.find(old.conditions, names.PODS_READY)
    if since is None or since.status != "False" or not since.last_transition_time:
        return None
    if (now - _parse_time(since.last_transition_time)).total_seconds() < deadline:
        return None
    why = observed.warnings[0] if observed.warnings else obs.why_not_ready(observed.pods)
    ready = readiness.summary(counts)
    detail = f"{why.reason}: {why.message}" if why is not None else "no reason reported"
    return f"pods not all ready {deadline}s (spec.scheduling.startupDeadlineSeconds) after they were created: {ready}; {detail}"  # noqa: E501


def _parse_time(value: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
