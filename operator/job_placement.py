"""Where a job runs, pure (decide's first stage): its plan, on its own or on its RolloutPool with its place there, or
the whole decision when its pool is missing or does not fit."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from grpolora.api.plan import JobPlan, plan
from grpolora.api.pool import job_key
from grpolora.api.status import JobPhase, JobStatus
from grpolora.operator import conditions as cond
from grpolora.operator import names, pools
from grpolora.operator import observe as obs
from grpolora.operator.job_conditions import (
    failed_to_start,
    invalid_condition,
    progressing_condition,
    refused_condition,
)
from grpolora.operator.job_course import ttl_left
from grpolora.operator.job_decision import ChildRef, Decision, Observed
from grpolora.operator.job_events import transition_events
from grpolora.operator.job_status import is_finished
from grpolora.operator.job_view import JobView


@dataclass(frozen=True)
class JobPlacement:
    """Where the job runs (decide's first stage)."""

    job_plan: JobPlan
    """On a pool: planned with it (its spec's inference fields are the pool's)."""
    place: pools.PoolPlace | None
    """Its place on its RolloutPool (None: not on a pool)."""
    queue: str | None
    """Its Kueue LocalQueue (None: not queued)."""


def placement_of(view: JobView, old: JobStatus, observed: Observed, now: datetime.datetime) -> JobPlacement | Decision:
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
    return JobPlacement(job_plan, place, job_plan.job.queue_name)


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
        left = ttl_left(view.job.spec, old.completion_time, now)
        return Decision(status=old, delete_job=left is not None and left <= 0, requeue_after=left, idle=left is None)
    mismatch = pool.fit_errors(view.job)
    if mismatch:
        message = f"cannot run on {where}: " + "; ".join(f"spec.{path}: {why}" for path, why in mismatch)
        return failed_to_start(view, old, names.R_POOL_MISMATCH, message, stamp, pool=ref)
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
        progressing_condition(phase, None, "", message),
        cond.Want(names.SUCCEEDED, "False", names.R_IN_PROGRESS),
        cond.Want(names.FAILED, "True", reason, message)
        if phase == "Failed"
        else cond.Want(names.FAILED, "False", names.R_NO_FAILURE),
        invalid_condition(view.problems),
        refused_condition(view.refused, view.queue_refused),
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
