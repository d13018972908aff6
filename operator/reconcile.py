"""The reconcile decision, pure: from the job, what exists and what the trainer reports, decide which workloads to
create or delete and what the status is. No I/O, no clock (`now` is passed in), no randomness; the controller
(grpolora.operator.controller) reads the inputs and carries the decision out.
What a pass knows of the job itself (JobView) is grpolora.operator.job_view's, the events of a status change
grpolora.operator.job_events', and the stored status and its write grpolora.operator.job_status'. `decide` is a
pipeline of stages, each in a module of its own: what a pass observes and decides (job_decision), where the job runs
(job_placement), its course: restarts, failures, deadlines, the end (job_course), the workloads to create
(job_workloads), its Kueue Workload (job_queue) and its status and conditions (job_conditions).

Level-triggered: every pass decides from scratch, so a pass that is repeated or interrupted decides the same
again. The trainer restart is two-phase, as in JobSet: one pass commits `status.trainerRestarts + 1` (the status
write is the commit point); later passes see a trainer Job whose restart attempt is older than that count, delete
it (the controller deletes workloads in the foreground, so it stays until its pods are gone) and, once it has
left, create its replacement. A crash between the phases therefore neither loses nor doubles a restart, and old
and new trainer pods never run side by side.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import TYPE_CHECKING, Final

from grpolora.api import constants as c
from grpolora.api.spec import GRPOLoraJobSpec
from grpolora.api.status import JobStatus
from grpolora.operator import conditions as cond
from grpolora.operator import job_failure, kueue, names
from grpolora.operator import observe as obs
from grpolora.operator.job_conditions import (
    decide_invalid,
    failed_to_start,
    invalid_condition,
    progressing_condition,
    status_of,
)
from grpolora.operator.job_course import (
    active_deadline,
    course_of,
    release_at_end,
    released_while_deleting,
    startup_deadline,
)
from grpolora.operator.job_decision import (
    API_RETRY_SECONDS,
    REPLACE_RECHECK_SECONDS,
    WORKLOAD_KINDS,
    ChildRef,
    Decision,
    Needs,
    Observed,
    Refusal,
)
from grpolora.operator.job_events import Event, transition_events
from grpolora.operator.job_placement import placement_of
from grpolora.operator.job_queue import (
    admission_of,
    finish_workload,
    finished_workload_of_a_new_run,
    pool_room_admission,
    queue_write_of,
    waits_for_pool_room,
)
from grpolora.operator.job_status import failed_at_this_generation, is_finished
from grpolora.operator.job_view import JobView, K8sObject
from grpolora.operator.job_workloads import workloads_to_create

if TYPE_CHECKING:
    from grpolora.operator.job_course import Course
    from grpolora.operator.job_workloads import Build


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
    return obs.job_active(trainer_job) > 0 and not job_failure.job_failed(trainer_job)


def decide(view: JobView, old: JobStatus, observed: Observed, now: datetime.datetime) -> Decision:
    """The decision of one pass (_decide); a job on a runtime also says which one it runs on, or waits for it."""
    stamp = cond.rfc3339(now)
    if observed.owner_deleting:
        view = dataclasses.replace(view, deleting=True)
    if not view.deleting and failed_at_this_generation(old, view.generation):
        # Failed to start for a reason only a create finds (job_status, the completionTime rule): it holds until the
        # spec changes. Its Workload stays Finished (Kueue never admits it again); nothing is created or re-queued.
        return finish_workload(Decision(status=old, idle=True), observed.queue_workload, stamp)
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
    return finish_workload(decision, observed.queue_workload if not view.deleting else None, stamp)


def _decide_waiting_for_runtime(view: JobView, old: JobStatus, stamp: str) -> Decision:
    """A job whose runtime does not exist (or is invalid) yet: Pending, nothing created; its monitor looks again at
    the regular interval (one read of the runtime a pass, and none once the job has started)."""
    assert view.runtime_wait is not None
    reason, message = view.runtime_wait
    wants = [
        cond.Want(names.CREATED, "False", reason, message),
        progressing_condition("Pending", None, "", message),
        cond.Want(names.SUCCEEDED, "False", names.R_IN_PROGRESS),
        cond.Want(names.FAILED, "False", names.R_NO_FAILURE),
        invalid_condition(()),
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
        return decide_invalid(view, old, stamp)
    where = placement_of(view, old, observed, now)
    if isinstance(where, Decision):
        return where
    spec = where.job_plan.spec  # on a pool: bound to it (its inference fields are the pool's)
    volumes = obs.volume_check(volume_uses(spec), observed.claims)
    if volumes.refusal and not is_finished(old) and not spec.suspend and observed.trainer_job is None:
        return failed_to_start(view, old, names.R_VOLUME_ACCESS_MODE, volumes.refusal, stamp)
    stale = finished_workload_of_a_new_run(where, old, observed)
    if stale is not None:
        observed = dataclasses.replace(observed, queue_workload=None)
    progress = obs.fold_trainer(old, observed.trainer)
    admission = admission_of(where.queue, observed.queue_workload, api_missing=observed.queue_api_missing)
    if waits_for_pool_room(where):
        admission = pool_room_admission(where)
    course = course_of(where, old, observed, admission, progress, now)
    if stale is not None:
        course = dataclasses.replace(course, deletes=(*course.deletes, stale), requeue=REPLACE_RECHECK_SECONDS)
    if view.queue_left is not None:  # the label removed before Kueue admitted it: it runs without a queue
        course = dataclasses.replace(course, deletes=(*course.deletes, ChildRef("Workload", view.queue_left)))
    course, build = workloads_to_create(view, where, observed, course, stamp)
    overdue, course, build = startup_deadline(where, old, observed, course, build, now, stamp)
    course, build = active_deadline(spec, observed, course, build, now, stamp)
    course, delete_job = release_at_end(spec, course, (observed.inference, observed.environment), now)
    status, pods_ready = status_of(
        view, old, observed, where, course, progress, admission, volumes, overdue, build, stamp
    )
    queue_write = queue_write_of(where, observed, course, status, pods_ready=pods_ready, stamp=stamp)
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
        # Once, with the fence that takes the pods out (a pass repeated before the Job has left writes none).
        + (
            (Event("Warning", names.E_TRAINER_POD_LOST, course.lost_note),) if course.lost_note and course.fence else ()
        ),
        # A suspended job's Workload may still hold quota: Kueue evicts it once deactivated, and the release is ours.
        idle=settled and (course.finished or course.phase == "Suspended") and queue_write is None and not holds_quota,
    )


def _needs(view: JobView, observed: Observed, course: Course, build: Build) -> Needs:
    """What must be read before the workloads this pass creates (or would, once their flavors are read) are
    created: the job's owner again (not on a new job's first pass, whose body is fresh), the flavors, the trainer
    pods left of its name, the Secrets it names. Each only once: what the observation holds is not asked again."""
    creating = course.wanted_roles if build.creates or build.read_flavors else ()
    if not creating:
        return Needs()
    return Needs(
        owner=view.record_applied is None and observed.owner_deleting is None,
        flavors=build.read_flavors,
        trainer_pods=c.ROLE_TRAINER in creating and observed.trainer_pods_left is None,
        secrets=not observed.secrets_checked,
    )


def decide_deleting(view: JobView, old: JobStatus, observed: Observed, now: datetime.datetime) -> Decision:
    """A job being deleted: nothing is created or written for it, but its workloads that lost pods hold in the
    garbage collector's foreground deletion are released (job_course.released_while_deleting); it is looked at again
    while any of them is leaving."""
    release, fence, leaving = released_while_deleting(observed.workloads, observed.pods, now)
    return Decision(
        status=old,
        release=release,
        fence=fence,
        requeue_after=REPLACE_RECHECK_SECONDS if leaving else None,
        idle=not leaving,
    )


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
    words = _KIND_WORDS.get(refusal.kind, refusal.kind)
    if refusal.kind == "StatefulSet" and refusal.name.endswith(f"-{c.ENVIRONMENT_WORKLOAD_SUFFIX}"):
        words = "environment server StatefulSet"  # (`<job>-env`: never an inference StatefulSet's name)
    what = f"{words} {refusal.name}"
    if refusal.transient:
        message = f"retrying: the Kubernetes API failed to create the {what}: {refusal.message}"
        return _retrying(
            view, old, names.R_API_RETRYING, message, stamp, API_RETRY_SECONDS, start_time=old.start_time or stamp
        )
    if old.trainer_incarnation is not None:  # a trainer Job was created: the job has started
        return _refused_after_start(view, old, what, refusal, stamp)
    failed = failed_to_start(
        view, old, names.R_CREATE_REFUSED, f"the API server refused the {what}: {refusal.message}", stamp
    )
    return finish_workload(failed, queue_workload, stamp)


REFUSED_RETRY_SECONDS: Final = 30.0
"""How soon a started job tries a refused create again (a policy or quota lifted; its events wake it sooner)."""


def _refused_after_start(view: JobView, old: JobStatus, what: str, refusal: Refusal, stamp: str) -> Decision:
    """A create refused for a job that has started (a restart's replacement trainer Job under a policy added mid-run
    or a count/jobs.batch quota; a kept child re-created by drift repair): not "failed to start". Its run goes on as
    far as it can: the status keeps its restarts and their causes, its token digest, its progress and Created (the
    spec stays locked), the Workload keeps its quota while its pods run (no Finished), and a later replacement gets
    the next restart attempt. Progressing says what was refused; the create is tried again."""
    message = f"the API server refused the {what}: {refusal.message}; retrying"
    return _retrying(view, old, names.R_CREATE_REFUSED, message, stamp, REFUSED_RETRY_SECONDS)


def _retrying(
    view: JobView, old: JobStatus, reason: str, message: str, stamp: str, retry_seconds: float, **updates: object
) -> Decision:
    """The job as it was, with Progressing False for `reason` and the create tried again after `retry_seconds`; the
    Warning event goes out once, when Progressing first takes that reason (not on every retry)."""
    wants = [cond.Want(k.type, k.status, k.reason, k.message) for k in old.conditions if k.type != names.PROGRESSING]
    wants.append(cond.Want(names.PROGRESSING, "False", reason, message))
    status = old.model_copy(
        update={
            "phase": old.phase or "Pending",
            "message": message,
            "conditions": cond.merge(old.conditions, wants, now=stamp, generation=view.generation),
            **updates,
        }
    )
    before = cond.find(old.conditions, names.PROGRESSING)
    events = () if before is not None and before.reason == reason else (Event("Warning", reason, message),)
    return Decision(status=status, requeue_after=retry_seconds, events=events)


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
    return finish_workload(failed_to_start(view, old, names.R_MANAGED_SECRET, message, stamp), queue_workload, stamp)
