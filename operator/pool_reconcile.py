"""The decision of one RolloutPool pass, pure: which jobs the pool serves, which of its children to create or rewrite,
and its status (grpolora.operator.reconcile.decide is the job's counterpart). No I/O and no clock:
grpolora.operator.controller reads everything a decision needs first (the namespace's jobs, the pool's children,
the token Secrets of the jobs about to attach, the replicas' adapter reports), then carries the decision out.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from grpolora.api import constants as c
from grpolora.api.load import InvalidJob, parse_pool
from grpolora.api.plan import PoolPlan, child_names, plan_pool, pool_child_names
from grpolora.api.pool import Admission, Attachment, Attachments, Candidate, admit, attachment
from grpolora.api.spec import RolloutPool
from grpolora.api.status import PoolStatus
from grpolora.operator import builders, names, pools
from grpolora.operator import observe as obs
from grpolora.operator.reconcile import REPLACE_RECHECK_SECONDS, Event, K8sObject

# What a pool's pass rewrites in place when it changes, by the path of the part rewritten (the rest of its children
# is created once): the attachment list, the NetworkPolicy that admits exactly the attached jobs, and the servers'
# replicas (a scale; the StatefulSet's pod template does not depend on them, so no server is replaced).
REWRITTEN: Final = {"Secret": ("data",), "NetworkPolicy": ("spec",), "StatefulSet": ("spec", "replicas")}


@dataclass(frozen=True)
class PoolPassView:
    """A RolloutPool as its own pass sees it (pools.PoolView is a job's view of its pool)."""

    namespace: str
    name: str
    uid: str
    generation: int | None
    deleting: bool
    """It has a deletionTimestamp: the collector is removing its children."""
    pool: RolloutPool | None
    """None: its spec is invalid (problems)."""
    problems: tuple[str, ...] = ()


def pool_pass_view(body: Mapping[str, Any]) -> PoolPassView:
    meta = body.get("metadata") or {}
    try:
        pool, problems = parse_pool(body), ()
    except InvalidJob as exc:
        pool, problems = None, tuple(str(p) for p in exc.problems)
    return PoolPassView(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        generation=meta.get("generation"),
        deleting=bool(meta.get("deletionTimestamp")),
        pool=pool,
        problems=problems,
    )


@dataclass(frozen=True)
class PoolObserved:
    """What one pass of a RolloutPool read."""

    jobs: tuple[K8sObject, ...] | None = None
    """The namespace's GRPOLoraJobs (a full pass); None: a light pass, which keeps the attachments the last full pass
    decided (the status says which) and reads only the replicas' state."""
    children: Mapping[tuple[str, str], K8sObject | None] = field(default_factory=dict)
    """The pool's children by (kind, name) as read (None: absent); a light pass reads only its StatefulSet."""
    tokens: Mapping[str, K8sObject | None] = field(default_factory=dict)
    """The token Secrets of the jobs named by token_reads, by job key (None: not there yet)."""
    reports: tuple[Mapping[str, Any] | None, ...] = ()
    """Each replica's GET /v1/adapter (None where it does not answer); none while no replica is ready."""
    pods: tuple[K8sObject, ...] = ()
    """The pool's server pods, read only while fewer replicas are ready than it wants (they say why)."""


@dataclass(frozen=True)
class ChildWrite:
    obj: K8sObject
    patch: K8sObject | None = None
    """None: create the child (it is absent); else merge-patch it with this (REWRITTEN changed)."""


@dataclass(frozen=True)
class PoolDecision:
    """What a RolloutPool's pass carries out, and what it leaves to the pool's monitor."""

    status: PoolStatus | None = None
    """The status to write (once, after the children); None: nothing to write."""
    writes: tuple[ChildWrite, ...] = ()
    """In creation order: the Secret first, then the NetworkPolicy, so that the servers and the network know a job
    before its status says it is attached (which starts its trainer)."""
    requeue_after: float | None = None
    idle: bool = False
    events: tuple[Event, ...] = ()
    """Posted on the pool after its status write succeeded (pool_events)."""


def child_refs(view: PoolPassView, operator_namespace: str) -> tuple[tuple[str, str], ...]:
    """(kind, name) of each child a full pass reads before deciding."""
    assert view.pool is not None
    objects = builders.build_pool_children(
        plan_pool(view.pool),
        owner_uid=view.uid,
        attachments=Attachments(pool=view.pool.name),
        operator_namespace=operator_namespace,
    )
    return tuple((obj["kind"], obj["metadata"]["name"]) for obj in objects)


def statefulset_ref(pool_plan: PoolPlan) -> tuple[str, str]:
    return ("StatefulSet", pool_plan.inference.workload_name)


def previous_attachments(view: PoolPassView, children: Mapping[tuple[str, str], K8sObject | None]) -> list[Attachment]:
    """The attachment list the pool's Secret holds now (empty: no Secret, or not a readable list)."""
    secret = children.get(("Secret", pool_child_names(view.name)["jobs"]))
    previous = builders.attachments_of(secret)
    return list(previous.jobs) if previous else []


def token_reads(view: PoolPassView, jobs: Sequence[K8sObject], previous: Sequence[Attachment]) -> tuple[str, ...]:
    """Keys of the jobs whose token Secrets the pass reads: those the admission attaches if every Secret is there,
    less those attached before whose entries stay as they are (their Secrets are not read again). A job whose Secret
    is missing keeps the ones behind it waiting (grpolora.api.pool.admit), so nobody else can attach instead."""
    assert view.pool is not None
    candidates = _candidates(view.pool, jobs)
    admission = admit(view.pool.spec.max_jobs, list(candidates.values()), previous)
    return tuple(_renewed(admission, candidates, previous))


def decide_pool(
    view: PoolPassView, old: PoolStatus, observed: PoolObserved, now: datetime.datetime, *, operator_namespace: str
) -> PoolDecision:
    """A full pass (observed.jobs listed): the attachments, the children to create or rewrite, the status. A light
    pass: the status only, from the replicas' state. Nothing while a deleted pool's child of the same name remains
    (retried soon), or while the pool is being deleted; an invalid pool gets its status and nothing else."""
    if view.deleting:
        return PoolDecision(idle=True)  # the collector is removing its children: nothing to keep any more
    if view.pool is None:
        return PoolDecision(
            pools.invalid_pool_status(old, view.problems, generation=view.generation, now=now), idle=True
        )
    pool_plan = plan_pool(view.pool)
    if observed.jobs is None:
        light = _light_status(view, view.pool, pool_plan, old, observed, now)
        return PoolDecision(light, events=pool_events(old, light, view.pool.spec.max_jobs))
    if any(found is not None and obs.controller_uid(found) != view.uid for found in observed.children.values()):
        # Still a child of a deleted pool of the same name: the garbage collector removes it shortly.
        return PoolDecision(requeue_after=REPLACE_RECHECK_SECONDS)
    attachments, admission = _attachments(view, view.pool, observed)
    objects = builders.build_pool_children(
        pool_plan,
        owner_uid=view.uid,
        attachments=attachments,
        operator_namespace=operator_namespace,
        generation=view.generation or 1,
    )
    writes = []
    for obj in objects:
        current = observed.children.get((obj["kind"], obj["metadata"]["name"]))
        path = REWRITTEN.get(obj["kind"])
        if current is None:
            writes.append(ChildWrite(obj))
        elif path and _at(current, path) != (wanted := _at(obj, path)):
            writes.append(ChildWrite(obj, _nested(path, wanted)))
    status = pools.pool_status(
        view.pool,
        old,
        admission,
        {entry.job: entry.uid for entry in attachments.jobs},
        observed.children.get(statefulset_ref(pool_plan)),
        observed.reports,
        generation=view.generation,
        now=now,
        tokens={entry.job: entry.fingerprint for entry in attachments.jobs},
        pods=observed.pods,
    )
    return PoolDecision(status, tuple(writes), events=pool_events(old, status, view.pool.spec.max_jobs))


def _at(obj: Mapping[str, Any], path: Sequence[str]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, Mapping) else None
    return obj


def _nested(path: Sequence[str], value: Any) -> dict[str, Any]:
    """The merge patch that sets `path` to `value` alone."""
    patch: Any = value
    for key in reversed(path):
        patch = {key: patch}
    return patch


def pool_events(old: PoolStatus, new: PoolStatus, max_jobs: int) -> tuple[Event, ...]:
    """The pool's Events for what changed between two of its statuses: a job attached or detached (by uid: a job
    re-created under its name is another), the pool became full (jobs wait for a place), scaled (its desired
    replicas changed), a server replica lost (fewer ready for as many desired; not while it scales or first
    starts)."""
    before = {(entry.job, entry.uid) for entry in old.attached_jobs}
    after = {(entry.job, entry.uid) for entry in new.attached_jobs}
    events = [
        Event("Normal", names.E_POOL_JOB_ATTACHED, f"{job} attached ({len(after)} of maxJobs {max_jobs})")
        for job, _ in sorted(after - before)
    ]
    events += [
        Event("Normal", names.E_POOL_JOB_DETACHED, f"{job} detached ({len(after)} of maxJobs {max_jobs})")
        for job, _ in sorted(before - after)
    ]
    full = len(after) >= max_jobs and bool(new.waiting_jobs)
    if full and not (len(before) >= max_jobs and old.waiting_jobs):  # (jobs may also wait for their token Secret)
        waiting = ", ".join(new.waiting_jobs)
        events.append(Event("Normal", names.E_POOL_FULL, f"full ({len(after)} of maxJobs {max_jobs}): {waiting} wait"))
    was, now = old.replicas, new.replicas
    if was is not None and now is not None and was.desired != now.desired:
        how = (
            "each attached job's trainer sends the new replicas its current adapter before they report ready"
            if now.desired > was.desired
            else "the highest ordinals finish their requests in flight and leave the jobs' sync groups"
        )
        events.append(
            Event("Normal", names.E_POOL_SCALED, f"scaled from {was.desired} to {now.desired} server replicas: {how}")
        )
    if was is not None and now is not None and was.desired == now.desired and now.ready < was.ready:
        events.append(
            Event(
                "Warning",
                names.E_POOL_REPLICA_LOST,
                f"ready server replicas {was.ready} -> {now.ready} of {now.desired}: the jobs' rollouts on the lost "
                "replica fail over to the others while Kubernetes replaces it",
            )
        )
    return tuple(events)


def _light_status(
    view: PoolPassView,
    pool: RolloutPool,
    pool_plan: PoolPlan,
    old: PoolStatus,
    observed: PoolObserved,
    now: datetime.datetime,
) -> PoolStatus:
    """The replicas' state only; attachments as the last full pass decided them (the status says which)."""
    statefulset = observed.children.get(statefulset_ref(pool_plan))
    if statefulset is not None and obs.controller_uid(statefulset) != view.uid:
        statefulset = None
    attached = {entry.job: entry.uid for entry in old.attached_jobs}
    admission = Admission(tuple(attached), tuple(old.waiting_jobs))
    return pools.pool_status(
        pool, old, admission, attached, statefulset, observed.reports, generation=old.observed_generation, now=now,
        tokens={entry.job: entry.token_digest for entry in old.attached_jobs}, pods=observed.pods,
    )  # fmt: skip


def _attachments(view: PoolPassView, pool: RolloutPool, observed: PoolObserved) -> tuple[Attachments, Admission]:
    """The attachment list (and the admission it follows): `admit` over the jobs that name the pool, with the token
    digest of each newly attached job from its token Secret (one whose Secret is not there yet keeps waiting).
    Entries of jobs attached before are kept as they are."""
    assert observed.jobs is not None
    candidates = _candidates(pool, observed.jobs)
    previous = previous_attachments(view, observed.children)
    kept = {entry.job: entry for entry in previous}
    entries: dict[str, Attachment] = {}
    reads = token_reads(view, observed.jobs, previous)
    for key in reads:
        found, secret = candidates[key], observed.tokens.get(key)
        token = token_of(secret) if secret is not None and obs.controller_uid(secret) == found.uid else None
        if token is not None and found.job is not None:
            namespace, _, job_name = key.partition("/")
            entries[key] = attachment(namespace, job_name, found.uid, token, found.job.spec)
    # Those whose token is not there yet wait: the jobs attached are then those read above or kept (token_reads).
    line = [dataclasses.replace(found, ready=key in entries or key not in reads) for key, found in candidates.items()]
    admission = admit(pool.spec.max_jobs, line, previous)
    jobs = [entries.get(key) or kept[key] for key in admission.attached]
    return Attachments(pool=pool.name, jobs=jobs), admission


def _candidates(pool: RolloutPool, jobs: Sequence[K8sObject]) -> dict[str, Candidate]:
    return {found.key: found for body in jobs if (found := pools.candidate(body, pool)) is not None}


def _renewed(admission: Admission, candidates: Mapping[str, Candidate], previous: Sequence[Attachment]) -> list[str]:
    kept = {entry.job: entry for entry in previous}
    return [key for key in admission.attached if not (key in kept and _still_valid(kept[key], candidates[key]))]


def _still_valid(entry: Attachment, found: Candidate) -> bool:
    """An attachment entry the pool keeps as it is: the same job (uid), holding the token its pods were created with
    (a re-keyed job's entry is made again from its new token)."""
    return entry.uid == found.uid and (not found.token or entry.fingerprint == found.token)


def token_of(secret: Mapping[str, Any], key: str = c.TOKEN_SECRET_KEY) -> str | None:
    """A job's token (or another key) from its Secret (`data`, base64, as a real API server returns it; `stringData`
    as written)."""
    written = (secret.get("stringData") or {}).get(key)
    if written:
        return str(written)
    encoded = (secret.get("data") or {}).get(key)
    return base64.b64decode(encoded).decode() if encoded else None


def token_secret_name(key: str) -> str:
    """The token Secret of the job `key` (<namespace>/<name>)."""
    return child_names(key.partition("/")[2])["token"]
