"""Carries out reconcile passes: read the job's children and trainer rank 0, let the pure `decide` choose, then
delete/create children, write the status once, and post events only after that write succeeded.

Two kinds of pass share one function and one per-job lock:
- full passes: the Kopf handlers (create/resume/update) run one at once, and a job's monitor every
  `resync_interval` seconds. They make sure the Secret, Services, NetworkPolicy and PodDisruptionBudget exist
  (drift repair: one deleted by hand comes back; create-if-absent, so the token is made only with its Secret, and a
  re-made Secret re-keys the job as a whole: reconcile.decide, status.tokenDigest).
- light passes: the monitor every `interval` seconds (the trainer's /status poll; sooner when a decision asks) and
  whenever the watch of one of the job's children reports a change.
Both read the children from the operator's watches (WATCHED: a cache fed by Kopf event handlers on the owned kinds,
filtered by the operator's label), as controller-runtime's reconcilers read owned objects from their informers'
cache: in steady state a job costs the API server its status writes and, per resync, one GET of its token Secret
(not watched: that would need list/watch on every Secret of the namespace, see rbac.py). A kept child's DELETED
wakes its job for a full pass at once (drift repair by event). What a watch cannot tell, an informer's re-list can:
Kopf re-lists after its watch's resourceVersion expired but reports no DELETED for what went meanwhile, so once per
resync every namespace's watched kinds are listed (by label, a page at a time, shared by all its jobs: _relisted)
and whatever the cache holds that the list lacks is marked gone, as an informer's Replace() does.
Either pass checks each workload's controlling owner: a child of the same name that still belongs to a deleted job
of the same name (garbage collection takes a moment) is never taken for this job's; the pass waits for it to go.
A child the API server refuses to create fails the job with the API's message
(grpolora.operator.reconcile.decide_refused) instead of leaving Kopf to retry it silently.

The monitors are plain asyncio tasks rather than Kopf daemons or timers: those make Kopf put a finalizer on every
job, so `kubectl delete` would hang whenever the operator is down or uninstalled, while nothing outside the
cluster needs cleaning up (children go by ownerReferences).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import random
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from grpolora.api import constants as c
from grpolora.api.plan import JobPlan, PoolPlan, child_names, plan, plan_pool
from grpolora.api.pool import token_fingerprint
from grpolora.api.status import JobStatus, PoolStatus
from grpolora.operator import attempts, builders, kube, names, pools
from grpolora.operator import observe as obs
from grpolora.operator import pool_reconcile as pr
from grpolora.operator import reconcile as rec
from grpolora.operator.metrics import Metrics
from grpolora.operator.peering import Gate, Standalone
from grpolora.operator.trainer_client import TrainerStatusClient, TrainerUnavailable, status_url

logger = logging.getLogger(__name__)
TOKEN_BYTES: Final = 32
WATCHED: Final = (
    kube.JOB,
    kube.STATEFULSET,
    kube.KUEUE_WORKLOAD,
    kube.SERVICE,
    kube.NETWORK_POLICY,
    kube.POD_DISRUPTION_BUDGET,
)
"""The kinds of a job's children followed by watch (handlers.build_registry) and read from the cache by every pass."""
KEPT_WATCHED: Final = frozenset(kind.kind for kind in (kube.SERVICE, kube.NETWORK_POLICY, kube.POD_DISRUPTION_BUDGET))
"""Watched kept children: a full pass makes them exist, so their DELETED asks for one; other events change nothing."""


@dataclass(frozen=True)
class ControllerConfig:
    interval: float = 10.0
    """Seconds between monitor passes of one job (trainer /status polls; workloads from the watch)."""
    resync_interval: float = 600.0
    """Seconds between full passes of one job (kept children repaired, the token Secret read) and between re-lists
    of a namespace's watched children (what the watches missed corrected; see the module docstring)."""
    jitter: float = 0.1
    """Fraction of the interval added at random, so that many jobs do not poll in lockstep."""
    max_backoff: float = 60.0
    """Longest wait after failed passes (doubling from the interval)."""
    operator_namespace: str = c.DEFAULT_OPERATOR_NAMESPACE
    """Where the operator runs: the jobs' NetworkPolicies admit its /status polls from there only."""


class Gone(Exception):
    """The GRPOLoraJob or RolloutPool no longer exists (deleted, or a job removed after its TTL)."""


class ChildRefused(Exception):
    """The API server refused to create one of the job's children."""

    def __init__(self, error: kube.ApiError, obj: Mapping[str, Any]):
        super().__init__(str(error))
        self.error = error
        self.refusal = rec.Refusal(obj["kind"], obj["metadata"]["name"], error.status, error.message or error.reason)


@dataclass
class _Tracked:
    """A GRPOLoraJob or RolloutPool (`kind`) the operator follows: its last body and status, its pass lock, its
    monitor."""

    namespace: str
    name: str
    uid: str
    body: dict[str, Any]
    status: dict[str, Any]
    """The status as last written by us (or as read, before our first write): newer than any watch event."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    due: float = 0.0
    task: asyncio.Task[None] | None = None
    next_full: float = 0.0
    """Loop time of the next full pass (see the module docstring)."""
    claims: dict[str, tuple[str, ...] | None] = field(default_factory=dict)
    """Access modes of the shared claims, as read by the last full pass."""
    queue_api_missing: bool = False
    """The last full pass could not create the job's Kueue Workload: Kueue's API is not served (not installed)."""
    token: str | None = None
    """Fingerprint of the token in the job's token Secret, as the last full pass read or made it."""
    kind: str = c.KIND
    wakes: int = 0
    """Events that asked for a pass (_wake). One that came while a pass was out is not in that pass's decision: the
    job passes again at once, whatever that decision said (idle, or the next pass an interval away)."""


def _version(obj: Mapping[str, Any]) -> int:
    """metadata.resourceVersion as a number (etcd's revision; 0 when absent or not a number)."""
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class Controller:
    def __init__(
        self,
        client: kube.KubeClient,
        trainer: TrainerStatusClient,
        metrics: Metrics,
        config: ControllerConfig | None = None,
        *,
        gate: Gate | None = None,
        clock: Callable[[], datetime.datetime] = utcnow,
    ):
        self.client, self.trainer, self.metrics = client, trainer, metrics
        self.config = config or ControllerConfig()
        self.gate: Gate = gate or Standalone()
        self.clock = clock
        self.jobs: dict[tuple[str, str], _Tracked] = {}
        self.pools: dict[tuple[str, str], _Tracked] = {}
        """The RolloutPools, by (namespace, name)."""
        self.pool_members: dict[tuple[str, str], tuple[str, tuple[Any, ...], dict[str, Any]]] = {}
        """Each job on a pool as the watch last showed it: (its pool, what its pool's admission reads of it, its body
        without the copies of its spec in annotations and managedFields). The pools' passes decide from these."""
        self.member_listings: dict[str, tuple[float, asyncio.Future[None]]] = {}
        """Each namespace's last list of its jobs into pool_members: (loop time, the listing; see _pool_jobs)."""
        self.members_gone: dict[str, dict[tuple[str, str], int]] = {}
        """Jobs on a pool the watch reported DELETED while their namespace's listing is out (with their last version):
        that listing, taken before, must not bring them back."""
        self.cache: dict[tuple[str, str, str], dict[str, Any] | None] = {}
        """What the watches (or a full pass's reads) last showed, by (kind, namespace, name): the jobs' workloads
        (trainer Jobs, inference StatefulSets), their Kueue Workloads, and the RolloutPools their jobs read. None:
        seen deleted (or read absent: the watch reports it when it comes). Absent: not seen (read from the API)."""
        self.queue_watched = True
        """Kueue's Workloads come from a watch. False when Kueue was not installed when the operator started: Kopf
        discovers the resources it watches once, so queued jobs then read their Workload on every pass."""
        self.relists: dict[str, tuple[float, asyncio.Future[None]]] = {}
        """Each namespace's last re-list of its watched children: (loop time, the re-list; see _relisted)."""
        self.tombstones: dict[tuple[str, str, str], int] = {}
        """The resourceVersion at which each child the cache holds as gone (None) was seen gone: an older read (a GET
        answered before the deletion) must not bring it back."""
        self.listings: dict[tuple[Any, ...], tuple[float, asyncio.Future[list[dict[str, Any]]]]] = {}
        """Shared pod and Warning-event listings by (plural, namespace, labels, fields): (loop time, the listing)."""

    # ---- entry points ------------------------------------------------------------------------------------

    async def reconcile(self, body: Mapping[str, Any]) -> rec.Decision:
        """A pass for a created, resumed or changed job; then make sure its monitor runs."""
        job = self._track(body)
        try:
            with self.metrics.timed("reconcile"):
                async with job.lock:
                    wakes = job.wakes
                    decision = await self._pass(job, full=True)
        except Gone:
            self.forget(job.namespace, job.name)
            raise
        self._schedule(job, decision, woken=job.wakes != wakes)
        return decision

    async def reconcile_pool(self, body: Mapping[str, Any]) -> pr.PoolDecision:
        """A pass for a created, resumed or changed RolloutPool; then make sure its monitor runs."""
        pool = self._track(body, kind=c.POOL_KIND)
        try:
            with self.metrics.timed("pool"):
                async with pool.lock:
                    wakes = pool.wakes
                    decision = await self._pool_pass(pool, full=True)
        except Gone:
            self.forget_pool(pool.namespace, pool.name)
            raise
        self._schedule(pool, decision, woken=pool.wakes != wakes)
        return decision

    def pool_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """A watch event of a RolloutPool: cache it for its jobs' passes and wake them when what they read of it
        changed (their attachment, their place in line, the pool's replicas), or when it is gone."""
        meta = body.get("metadata") or {}
        namespace, name = meta.get("namespace", ""), meta.get("name", "")
        self._pool_seen(namespace, name, None if event_type == "DELETED" else dict(body), body)
        if event_type == "DELETED":
            self.forget_pool(namespace, name)
        elif meta.get("deletionTimestamp"):
            self._mark_deleting(self.pools.get((namespace, name)), body)

    def job_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """A watch event of a job on a RolloutPool: wake the pool's pass when what its admission reads of the job
        changed (created, its children made, admitted by Kueue, finished, suspended, deleted). The pool's pass then
        reads the jobs from this cache (see _pool_jobs)."""
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        ref, seen = _pool_ref(body), _admission_facts(body)
        before = self.pool_members.get(key)
        if event_type == "DELETED" and key[0] in self.members_gone:
            self.members_gone[key[0]][key] = _version(body)
        if event_type != "DELETED" and before is not None and _version(body) < _version(before[2]):
            return  # behind what a list of the jobs read (see _pool_jobs)
        self.pool_members.pop(key, None)
        if event_type != "DELETED" and ref:
            self.pool_members[key] = (ref, seen, _member(body))
        for pool in {before[0] if before else None, ref} - {None}:
            if before is None or before[:2] != (ref, seen) or event_type == "DELETED":
                tracked = self.pools.get((key[0], pool))
                if tracked is not None:
                    tracked.next_full = 0.0  # admission must look again: a full pass
                self._wake(tracked)

    def forget_pool(self, namespace: str, name: str) -> None:
        self.metrics.forget_pool(namespace, name)
        pool = self.pools.pop((namespace, name), None)
        if pool is not None and pool.task is not None and pool.task is not asyncio.current_task():
            pool.task.cancel()

    def _pool_seen(
        self, namespace: str, name: str, value: dict[str, Any] | None, seen: Mapping[str, Any], *, read: bool = False
    ) -> None:
        """Cache a pool as the watch (or, `read`, the API) shows it; wake its jobs if what they read changed."""
        key = (c.POOL_KIND, namespace, name)
        before = self.cache.get(key)
        if read and value is None:
            self.cache[key] = None  # a 404 from the API: gone now, whatever the watch last said
        else:
            self._remember(key, value, seen)
        if _pool_facts(self.cache.get(key)) != _pool_facts(before):
            for job in list(self.jobs.values()):
                spec = (job.body.get("spec") or {}).get("inference") or {}
                if job.namespace == namespace and (spec.get("poolRef") or {}).get("name") == name:
                    self._wake(job)

    def _wake(self, tracked: _Tracked | None) -> None:
        """Run the job's (or pool's) next monitor pass now; start its monitor if it had settled (its last pass was
        idle: a suspended or finished job still keeps its kept children, and a pool its attachments)."""
        if tracked is None:
            return
        tracked.wakes += 1
        tracked.due = min(tracked.due, asyncio.get_running_loop().time())
        self._follow(tracked)

    def _follow(self, tracked: _Tracked) -> None:
        """Make the job's (or pool's) monitor look at `due` again, starting it if it had ended."""
        if tracked.task is None or tracked.task.done():
            name = f"grpolora monitor {tracked.namespace}/{tracked.name}"
            tracked.task = asyncio.create_task(self._monitor(tracked), name=name)
        else:
            tracked.wake.set()

    def workload_event(self, kind: str, event_type: str | None, body: Mapping[str, Any]) -> None:
        """A watch event of one of a job's watched children (WATCHED): cache it, and wake its job for a pass (for a
        kept child, only when it went: then a full pass, which makes it again)."""
        meta = body.get("metadata") or {}
        namespace, name = meta.get("namespace", ""), meta.get("name", "")
        job = self.jobs.get((namespace, ((meta.get("labels") or {}).get(c.LABEL_JOB, ""))))
        if event_type == "DELETED" and job is None:
            # The child of a job no longer followed (collected after it): no pass reads its tombstone, so none is
            # kept (a job of that name made later reads its workloads from the API first).
            self.cache.pop((kind, namespace, name), None)
            self.tombstones.pop((kind, namespace, name), None)
            return
        key = (kind, namespace, name)
        self._remember(key, None if event_type == "DELETED" else dict(body), body)
        if event_type == "DELETED" and kind in KEPT_WATCHED | {kube.KUEUE_WORKLOAD.kind} and job is not None:
            job.next_full = 0.0  # drift repair by event: a full pass makes it (a kept child, or a Workload) again
        elif kind in KEPT_WATCHED:
            return
        self._wake(job)

    def _remember(self, key: tuple[str, str, str], value: dict[str, Any] | None, seen: Mapping[str, Any]) -> None:
        """Cache what the watch or a full pass saw, never going back to an older version: a watch event that lags
        behind a full pass's read must not undo it (e.g. bring back a Workload's admission after its eviction)."""
        cached = self.cache.get(key)
        if cached is not None and _version(seen) < _version(cached):
            return
        if value is not None and key in self.tombstones and _version(seen) <= self.tombstones[key]:
            return  # read before it was seen gone
        self.cache[key] = value
        if value is None:
            self.tombstones[key] = max(_version(seen), self.tombstones.get(key, 0))
        else:
            self.tombstones.pop(key, None)

    def deleting(self, body: Mapping[str, Any]) -> None:
        """The job got a deletionTimestamp (e.g. `kubectl delete --cascade=foreground`): its passes create nothing
        from now on (see reconcile.JobView.deleting)."""
        meta = body.get("metadata") or {}
        self._mark_deleting(self.jobs.get((meta.get("namespace", ""), meta.get("name", ""))), body)

    def _mark_deleting(self, tracked: _Tracked | None, body: Mapping[str, Any]) -> None:
        """Record a followed job's or pool's deletionTimestamp (handlers pass only spec changes) and run a pass."""
        meta = body.get("metadata") or {}
        if tracked is None or tracked.uid != meta.get("uid") or not meta.get("deletionTimestamp"):
            return
        tracked.body.setdefault("metadata", {})["deletionTimestamp"] = meta["deletionTimestamp"]
        self._wake(tracked)

    async def _owner_deleting(self, tracked: _Tracked) -> bool:
        """Read the job (or pool) itself before creating a child for it: the collector may already be removing its
        children while our watch has not yet delivered its deletionTimestamp, and a child created now would only be
        collected again (and, in a foreground deletion, hold up the owner's removal). Gone if it is gone."""
        kind = kube.ROLLOUTPOOL if tracked.kind == c.POOL_KIND else kube.GRPOLORAJOB
        found = await self.client.get(kind, tracked.namespace, tracked.name)
        if found is None or (found.get("metadata") or {}).get("uid") != tracked.uid:
            raise Gone(f"{tracked.kind} {tracked.namespace}/{tracked.name}")
        self._mark_deleting(tracked, found)
        return _deleting(tracked.body)

    def forget(self, namespace: str, name: str) -> None:
        """The job was deleted: stop its monitor and drop its metrics."""
        job = self.jobs.pop((namespace, name), None)
        if job is not None and job.task is not None and job.task is not asyncio.current_task():
            job.task.cancel()
        # Its children as last seen (tombstones included): a job of this name made later reads them from the API.
        workloads = child_names(name)
        for kind in WATCHED:
            for child in (workloads["trainer"], workloads["inference"], name):
                self.cache.pop((kind.kind, namespace, child), None)
                self.tombstones.pop((kind.kind, namespace, child), None)
        self.metrics.forget_job(namespace, name)

    async def stop(self) -> None:
        tasks = [job.task for job in [*self.jobs.values(), *self.pools.values()] if job.task is not None]
        for task in tasks:
            task.cancel()
        listings = [
            listing for _, listing in [*self.listings.values(), *self.member_listings.values(), *self.relists.values()]
        ]
        for listing in listings:
            listing.cancel()  # shielded from the passes: cancelled here (a no-op once done)
        await asyncio.gather(*tasks, *listings, return_exceptions=True)
        self.jobs.clear()
        self.pools.clear()
        await self.trainer.close()
        await self.client.close()

    # ---- the pass ----------------------------------------------------------------------------------------

    async def _pass(self, job: _Tracked, *, full: bool) -> rec.Decision:
        """One reconcile pass (full: children read from the API; see the module docstring)."""
        # The status as last written by us (job.status) is newer than the one in the last watch event (job.body).
        body = {**job.body, "status": job.status}
        view = rec.job_view(body, await self._runtime(body))
        old = rec.stored_status(job.status)
        view = await self._queue_in_effect(view, old)
        # Nothing to read: a job being deleted gets nothing, and one waiting for its runtime has nothing yet.
        if view.deleting or view.runtime_wait is not None:
            decision = rec.decide(view, old, rec.Observed(), self.clock())
            await self._record(job, decision)
            return decision
        # Children never created (e.g. the job waited for its pool): create them now, not at the next resync.
        full = full or view.record_applied is not None
        if full:
            job.next_full = asyncio.get_running_loop().time() + self.config.resync_interval
            await self._relisted(job.namespace)
        pool: pools.PoolView | None = None
        if view.job is not None and view.job.spec.inference.pool_ref is not None:
            pool = await self._pool_view(view, full=full)
        # A job on a pool is planned with it; one whose pool is missing or does not fit gets no children.
        job_plan = None
        if view.job is not None and (pool is None or pool.usable_by(view.job)):
            job_plan = plan(view.job, pool=pool.pool if pool else None)
        try:
            blocked: list[rec.ChildRef] = []
            if full and job_plan is not None and not rec.is_finished(old):
                blocked += await self._ensure_kept_children(job, view, job_plan)
            if (
                view.record_applied is not None
                and not blocked
                and job_plan is not None
                and not job_plan.job.spec.suspend
            ):
                # First pass of a new job whose kept children were all just created: its workloads cannot exist
                # yet (were they there after all, creating them answers 409 and the next pass reads their owner).
                assert view.job is not None
                queued = view.job.queue_name is not None and not job.queue_api_missing
                claims, queue_workload = await asyncio.gather(
                    self._claims(job, view),
                    # Just ensured: an ending before the job ever starts finishes it too (reconcile._ended), or Kueue
                    # would admit a failed job's Workload and hold its quota.
                    self._workload(kube.KUEUE_WORKLOAD, view.namespace, view.name) if queued else _none(),
                )
                observed = rec.Observed(
                    claims=claims,
                    pool=pool,
                    queue_workload=queue_workload,
                    queue_api_missing=job.queue_api_missing,
                    token=job.token,
                )
            else:
                observed = await self._observe(job, view, old, blocked, full=full, job_plan=job_plan, pool=pool)
            if job.queue_api_missing and observed.queue_workload is None:
                job.next_full = 0.0  # its Workload could not be created (no Kueue yet): the next pass retries
            if _deleting(job.body):  # found out while ensuring the kept children
                view = dataclasses.replace(view, deleting=True)
            decision = rec.decide(view, old, observed, self.clock())
            if decision.create and view.record_applied is None and await self._owner_deleting(job):
                # (A new job's first pass runs on the body its create handler was given: fresh enough.)
                decision = rec.decide(dataclasses.replace(view, deleting=True), old, observed, self.clock())
            if decision.read_flavors:
                # Admitted by Kueue, and workloads to create: read the flavors that shape their pods, decide again.
                flavors = await self._flavors(decision.read_flavors)
                decision = rec.decide(view, old, dataclasses.replace(observed, flavors=flavors), self.clock())
            if any(obj["kind"] == "Job" for obj in decision.create):
                left = await self._trainer_pods_left(view)
                if left:
                    observed = dataclasses.replace(observed, trainer_pods_left=left)
                    decision = rec.decide(view, old, observed, self.clock())
            if any(obj["kind"] in rec.WORKLOAD_KINDS for obj in decision.create):
                managed = await self._managed_secret(view)
                if managed is not None:
                    decision = rec.decide_managed_secret(
                        view, old, *managed, self.clock(), queue_workload=observed.queue_workload
                    )
            # Before a restart (or the end) deletes the failed trainer's pods: keep its log tail (status, event).
            decision = await attempts.kept_in(decision, old, observed, view.namespace, self.client)
            if not await self._change_workloads(job, decision):
                # Taken meanwhile (e.g. by an older job of this name): look again soon, owner and all.
                decision = dataclasses.replace(decision, requeue_after=rec.REPLACE_RECHECK_SECONDS, idle=False)
        except ChildRefused as refused:
            queue_workload = None
            if view.job is not None and view.job.queue_name is not None and not refused.refusal.transient:
                # The job ends: its Workload is marked Finished (reconcile._ended), so that its quota goes back.
                queue_workload = await self._workload(kube.KUEUE_WORKLOAD, view.namespace, view.name)
            decision = rec.decide_refused(view, old, refused.refusal, self.clock(), queue_workload=queue_workload)
            logger.warning("%s/%s: %s", job.namespace, job.name, decision.status.message)
            await self._record(job, decision)
            if refused.refusal.transient:
                raise refused.error from None
            return decision
        if not await self._record(job, decision):
            decision = dataclasses.replace(decision, requeue_after=rec.REPLACE_RECHECK_SECONDS, idle=False)
        return decision

    # ---- the pool's pass -----------------------------------------------------------------------------------

    async def _pool_pass(self, pool: _Tracked, *, full: bool) -> pr.PoolDecision:
        """One pass of a RolloutPool: read, let the pure `decide_pool` choose, create or rewrite its children, write
        its status once (which its jobs read). Full (its handlers, a job of it that came, finished or went, and every
        resync): it decides its attachments (it alone does) from a list of its namespace's jobs and writes them to the
        Secret its servers read, and keeps its children. Light (the monitor's interval otherwise): it reads only its
        replicas (the StatefulSet, each one's GET /v1/adapter)."""
        view = pr.pool_pass_view(pool.body)
        old = pools.stored_pool_status(pool.status)
        observed = pr.PoolObserved()
        if not view.deleting:
            light = not full and old.observed_generation == view.generation and old.replicas is not None
            if light and view.pool is not None:
                observed = await self._pool_observe_light(view)
            else:
                pool.next_full = asyncio.get_running_loop().time() + self.config.resync_interval
                if view.pool is not None:
                    observed = await self._pool_observe(pool, view)
        decision = pr.decide_pool(view, old, observed, self.clock(), operator_namespace=self.config.operator_namespace)
        if decision.writes:
            if any(write.patch is None for write in decision.writes) and await self._owner_deleting(pool):
                return pr.PoolDecision(idle=True)
            try:
                await self._write_pool_children(view, decision)
            except ChildRefused as refused:
                kind, name, message = refused.refusal.kind, refused.refusal.name, refused.refusal.message
                status = pools.refused_pool_status(
                    old, kind, name, message, generation=view.generation, now=self.clock()
                )
                await self._record_pool(pool, status)
                pool.next_full = 0.0  # try again at the next interval, not at the next resync
                return pr.PoolDecision()
        if decision.status is not None:
            await self._record_pool(pool, decision.status, decision.events)
        return decision

    async def _pool_observe(self, pool: _Tracked, view: pr.PoolPassView) -> pr.PoolObserved:
        """A full pass's reads: the jobs that name the pool (from the watch's cache, _pool_jobs) and the pool's
        children, then the token Secrets of the jobs about to attach and the replicas' adapter reports."""
        assert view.pool is not None
        refs = pr.child_refs(view, self.config.operator_namespace)
        listed, *found = await asyncio.gather(
            self._pool_jobs(pool),
            *(self.client.get(kube.KINDS[kind], view.namespace, name) for kind, name in refs),
        )
        children = dict(zip(refs, found, strict=True))
        reads = pr.token_reads(view, listed, pr.previous_attachments(view, children))
        pool_plan = plan_pool(view.pool)
        reports, *tokens = await asyncio.gather(
            self._adapter_reports(pool_plan, view, children.get(pr.statefulset_ref(pool_plan))),
            *(self.client.get(kube.SECRET, view.namespace, pr.token_secret_name(key)) for key in reads),
        )
        return pr.PoolObserved(
            jobs=tuple(listed), children=children, tokens=dict(zip(reads, tokens, strict=True)), reports=reports
        )

    async def _pool_observe_light(self, view: pr.PoolPassView) -> pr.PoolObserved:
        """A light pass's reads: the servers' StatefulSet, and their adapter reports."""
        assert view.pool is not None  # valid: a full pass wrote a status for this generation
        pool_plan = plan_pool(view.pool)
        ref = pr.statefulset_ref(pool_plan)
        statefulset = await self.client.get(kube.STATEFULSET, view.namespace, ref[1])
        reports = await self._adapter_reports(pool_plan, view, statefulset)
        return pr.PoolObserved(children={ref: statefulset}, reports=reports)

    async def _write_pool_children(self, view: pr.PoolPassView, decision: pr.PoolDecision) -> None:
        """Create or rewrite the pool's children in the decision's order; an API refusal names the child refused."""
        for write in decision.writes:
            obj = write.obj
            try:
                if write.patch is None:
                    await self.client.create(obj)
                else:
                    await self.client.patch(kube.kind_of(obj), view.namespace, obj["metadata"]["name"], write.patch)
                    logger.info(
                        "%s/%s: RolloutPool: updated %s %s",
                        view.namespace, view.name, obj["kind"], obj["metadata"]["name"],
                    )  # fmt: skip
            except kube.ApiError as exc:
                if exc.transient:
                    raise
                logger.warning(
                    "%s/%s: RolloutPool: %s %s refused: %s",
                    view.namespace, view.name, obj["kind"], obj["metadata"]["name"], exc,
                )  # fmt: skip
                raise ChildRefused(exc, obj) from exc

    async def _pool_jobs(self, pool: _Tracked) -> list[dict[str, Any]]:
        """The jobs that name this pool, from the watch's cache of them (pool_members), as a controller decides from
        its informer's cache: every change a pool reads of a job wakes the pool's pass (job_event), so the cache is
        as new as what woke it. The namespace's jobs are listed (a page at a time, only the members kept) when the
        cache may lack some: before the first list since the operator started (the watch's own initial listing
        may not have come yet) and once per resync (a watch that reconnected reports no DELETED for what went
        meanwhile)."""
        now = asyncio.get_running_loop().time()
        listing = self.member_listings.get(pool.namespace)
        if (
            listing is None
            or now - listing[0] >= self.config.resync_interval
            or (listing[1].done() and listing[1].exception() is not None)
        ):
            listing = (now, asyncio.ensure_future(self._list_members(pool.namespace)))
            self.member_listings[pool.namespace] = listing
        # Every pool of the namespace waits for the one listing (none decides from a cache it is still filling);
        # shielded: a pass cancelled while it waits must not cancel the listing that other pools wait for.
        await asyncio.shield(listing[1])
        return [
            body for (namespace, _), (ref, _, body) in self.pool_members.items()
            if namespace == pool.namespace and ref == pool.name
        ]  # fmt: skip

    async def _list_members(self, namespace: str) -> None:
        """List the namespace's jobs (a page at a time, keeping only those on a pool, less their spec's copies) into
        pool_members, never going back to an older version than the watch brought meanwhile."""
        newest = 0

        def keep(item: dict[str, Any]) -> dict[str, Any] | None:
            nonlocal newest
            newest = max(newest, _version(item))
            return _member(item) if _pool_ref(item) else None

        self.members_gone[namespace] = gone = {}
        try:
            listed = await self.client.list(kube.GRPOLORAJOB, namespace, {}, keep=keep)
        finally:
            del self.members_gone[namespace]
        found = {(namespace, body["metadata"].get("name", "")): body for body in listed}
        for key, (_, _, body) in list(self.pool_members.items()):
            if key[0] == namespace and key not in found and _version(body) <= newest:
                del self.pool_members[key]  # older than the list, yet not in it: gone (or off its pool)
        for key, body in found.items():
            cached = self.pool_members.get(key)
            if gone.get(key, -1) >= _version(body):
                continue  # deleted since the list was taken
            if cached is None or _version(cached[2]) <= _version(body):  # never back to an older version
                self.pool_members[key] = (str(_pool_ref(body)), _admission_facts(body), body)

    async def _adapter_reports(
        self, pool_plan: PoolPlan, view: pr.PoolPassView, statefulset: Mapping[str, Any] | None
    ) -> tuple[dict[str, Any] | None, ...]:
        """Each replica's open GET /v1/adapter (None where it does not answer); none while no replica of the pool's
        own StatefulSet is ready."""
        if statefulset is None or obs.controller_uid(statefulset) != view.uid or not obs.statefulset_ready(statefulset):
            return ()
        return tuple(await asyncio.gather(*(self.trainer.json(f"{url}/v1/adapter") for url in pool_plan.endpoints)))

    async def _record_pool(self, pool: _Tracked, status: PoolStatus, events: tuple[rec.Event, ...] = ()) -> None:
        """Write the pool's status (once per pass, skipped when unchanged), let its jobs see it at once, then post
        the pool's events (only after the write succeeded, as a job's)."""
        patch = rec.status_patch(pool.status, status)
        if patch is None:
            self.metrics.set_pool(pool.namespace, pool.name, status)  # unchanged (an operator restarted: report it)
            return
        written = await self.client.patch(
            kube.ROLLOUTPOOL, pool.namespace, pool.name, {"status": patch}, subresource="status"
        )
        if written is None:
            raise Gone(f"RolloutPool {pool.namespace}/{pool.name}")
        pool.status = dict(written.get("status") or status.to_wire())
        self.metrics.set_pool(pool.namespace, pool.name, status)
        self._pool_seen(pool.namespace, pool.name, dict(written), written)
        involved = {"namespace": pool.namespace, "name": pool.name, "uid": pool.uid, "kind": c.POOL_KIND}
        for event in events:
            try:
                await self.client.post_event(involved, event.type, event.reason, event.message, now=self.clock())
            except kube.ApiError as exc:
                logger.warning("%s/%s: could not post event %s: %s", pool.namespace, pool.name, event.reason, exc)

    async def _create(self, job: _Tracked, obj: Mapping[str, Any]) -> bool:
        """Create if absent (False on 409); an API refusal becomes ChildRefused."""
        try:
            new = await self.client.create(obj)
        except kube.ApiError as exc:
            raise ChildRefused(exc, obj) from exc
        if new:
            logger.info("%s/%s: created %s %s", job.namespace, job.name, obj["kind"], obj["metadata"]["name"])
        return new

    async def _ensure_kept_children(self, job: _Tracked, view: rec.JobView, job_plan: JobPlan) -> list[rec.ChildRef]:
        """Make sure the Secret, Services and NetworkPolicy exist; return those that belong to an older job."""
        assert view.job is not None
        if view.record_applied is not None:
            # Recorded before anything is created, so a restarted operator always knows what the children run.
            annotations = {names.APPLIED_SPEC_ANNOTATION: view.record_applied}
            if view.record_runtime is not None:  # in the same write: a started job always knows both
                annotations[names.RUNTIME_ANNOTATION] = view.record_runtime
            patched = await self.client.patch(
                kube.GRPOLORAJOB, job.namespace, job.name, {"metadata": {"annotations": annotations}}
            )
            if patched is None:
                raise Gone(f"{job.namespace}/{job.name}")
            job.body.setdefault("metadata", {}).setdefault("annotations", {}).update(annotations)
        # A fresh token each time, used only if the Secret does not exist yet (create-if-absent). One made again for
        # a running job (its Secret was deleted) re-keys the job as a whole (reconcile.decide, status.tokenDigest).
        fresh = secrets.token_urlsafe(TOKEN_BYTES)
        priority = None
        queue_key = (kube.KUEUE_WORKLOAD.kind, job.namespace, job.name)
        if job_plan.job.queue_name is not None and not self.cache.get(queue_key):
            priority = await self._priority(job_plan)  # its Workload may be about to be created
        kept, _ = rec.children(
            job_plan,
            uid=view.uid,
            token=fresh,
            operator_namespace=self.config.operator_namespace,
            priority=priority,
        )

        new_job = view.record_applied is not None
        owner_check: asyncio.Future[bool] | None = None

        async def owner_deleting() -> bool:
            """Read once per pass, and only when a child is missing (see _owner_deleting)."""
            nonlocal owner_check
            if owner_check is None:
                owner_check = asyncio.ensure_future(self._owner_deleting(job))
            return await owner_check

        async def ensure(obj: dict[str, Any]) -> rec.ChildRef | None:
            kind, name = kube.kind_of(obj), obj["metadata"]["name"]
            # A new job's children are normally absent: create first, and read only on a conflict. Later passes
            # read first (drift repair without a failed create per child and pass).
            existing = None if new_job else await self._kept(kind, job.namespace, name)
            if existing is None:
                if not new_job and await owner_deleting():
                    return None
                try:
                    if await self._create(job, obj):
                        if self.cache.get((kind.kind, job.namespace, name), _UNSEEN) is None:
                            del self.cache[(kind.kind, job.namespace, name)]  # read from the API until the watch says
                        if obj["kind"] == "Secret":
                            job.token = token_fingerprint(fresh)
                        return None
                except ChildRefused as refused:
                    if kind != kube.KUEUE_WORKLOAD or refused.error.status != 404:
                        raise
                    # Kueue is not installed (yet): the job waits for it (rec.decide says so) instead of failing.
                    job.queue_api_missing = True
                    return None
                existing = await self._kept(kind, job.namespace, name, fresh=True)  # there already: whose is it?
            if existing is not None and obs.controller_uid(existing) != view.uid:
                return rec.ChildRef(kind.kind, name)
            if existing is not None and obj["kind"] == "Secret":
                token = pr.token_of(existing)
                job.token = token_fingerprint(token) if token else None
            return None

        job.queue_api_missing = False
        found = await asyncio.gather(*(ensure(obj) for obj in kept))
        return [ref for ref in found if ref is not None]

    async def _priority(self, job_plan: JobPlan) -> tuple[str, int] | None:
        """(PriorityClass, value) for the job's Kueue Workload, as Kueue's integrations find it
        (pkg/util/priority GetPriorityFromPriorityClass): the class the pods name, else the cluster's globalDefault
        one; None: neither (Kueue ranks the Workload at 0). Listed, not watched: read only when a Workload is made,
        and a cluster has few PriorityClasses. A class the pods name that does not exist is the Priority admission
        plugin's to refuse, naming it, when the pods are created."""
        name = builders.pods_priority_class(job_plan)
        classes = await self.client.list(kube.PRIORITY_CLASS, None, {})  # type: ignore[arg-type]
        for found in classes:
            meta, value = found.get("metadata") or {}, found.get("value")
            if isinstance(value, int) and (meta.get("name") == name if name else found.get("globalDefault") is True):
                return str(meta.get("name")), value
        if name:
            logger.warning("%s: PriorityClass %s does not exist; its Workload gets no priority", job_plan.name, name)
        return None

    async def _kept(self, kind: kube.Kind, namespace: str, name: str, *, fresh: bool = False) -> dict[str, Any] | None:
        """A kept child, as a full pass reads it: a watched kind from the cache (_workload), the token Secret (not
        watched) from the API; `fresh`: from the API whatever the kind (a create found it there: whose is it?)."""
        if kind.kind in KEPT_WATCHED | {kube.KUEUE_WORKLOAD.kind} and not fresh:
            return await self._workload(kind, namespace, name)
        found = await self.client.get(kind, namespace, name)
        if found is not None and kind in WATCHED:
            self._remember((kind.kind, namespace, name), dict(found), found)
        return found

    async def _workload(self, kind: kube.Kind, namespace: str, name: str) -> dict[str, Any] | None:
        """A watched child from the watch's cache, or from the API when the watch has not shown it (nor a read its
        absence). What the watch missed is corrected by the namespace's re-list (_relisted), not by a read per pass."""
        key = (kind.kind, namespace, name)
        full = kind == kube.KUEUE_WORKLOAD and not self.queue_watched  # no watch keeps the cache fresh
        if not full and key in self.cache:
            cached = self.cache[key]
            return None if cached is None else dict(cached)
        before = self.cache.get(key, _UNSEEN)
        found = await self.client.get(kind, namespace, name)
        if found is not None:
            self._remember(key, dict(found), found)
        elif self.cache.get(key, _UNSEEN) is before:
            # Absent: remembered as such, or every light pass of a job whose workloads wait (for Kueue, for its pool)
            # would GET them again. The watch reports their ADDED when they come (a re-listing after a reconnect
            # too). Not if the watch spoke while the GET was out: what it said is at least as new as the 404.
            self.cache[key] = None
        return found

    async def _observe(
        self,
        job: _Tracked,
        view: rec.JobView,
        old: JobStatus,
        blocked: list[rec.ChildRef],
        *,
        full: bool,
        job_plan: JobPlan | None,
        pool: pools.PoolView | None,
    ) -> rec.Observed:
        if view.job is None:
            return rec.Observed()
        workloads = child_names(view.name)
        on_pool = view.job.spec.inference.pool_ref is not None
        trainer_job, inference = await asyncio.gather(
            self._workload(kube.JOB, view.namespace, workloads["trainer"]),
            # A job on a pool has no StatefulSet of its own.
            _none() if on_pool else self._workload(kube.STATEFULSET, view.namespace, workloads["inference"]),
        )
        # A workload of a deleted job of the same name is not this job's: its state (e.g. Complete) says nothing.
        if trainer_job is not None and obs.controller_uid(trainer_job) != view.uid:
            blocked.append(rec.ChildRef("Job", workloads["trainer"]))
            trainer_job = None
        if inference is not None and obs.controller_uid(inference) != view.uid:
            blocked.append(rec.ChildRef("StatefulSet", workloads["inference"]))
            inference = None
        spec = view.job.spec
        pods: list[dict[str, Any]] = []
        warnings: tuple[obs.NotReady, ...] = ()
        not_ready = obs.job_ready(trainer_job) < spec.trainer.replicas or (
            not on_pool and obs.statefulset_ready(inference) < spec.inference.replicas
        )
        running = not spec.suspend and not rec.is_finished(old)
        # A workload being deleted: which of its pods are still active says when the quota can go back
        # (reconcile._nothing_active), as they are now (a listing taken before they ran would show none).
        leaving = any(w is not None and obs.deleting(w) for w in (trainer_job, inference))
        if (running and (trainer_job or inference) and not_ready) or leaving:
            # The trainer Job failed: its pods say why (a termination message written as it failed, likely after the
            # shared listing was taken), and the job's failure is final, so they are listed as they are now.
            failed = obs.job_condition(trainer_job, "Failed") is not None or leaving
            ours, events = await asyncio.gather(
                self._listing(kube.POD, view.namespace, {c.LABEL_MANAGED_BY: c.OPERATOR_NAME}, fresh=failed),
                self._listing(kube.EVENT, view.namespace, {}, fields={"type": "Warning"}),
            )
            pods = [p for p in ours if ((p.get("metadata") or {}).get("labels") or {}).get(c.LABEL_JOB) == view.name]
            desired = {"Job": spec.trainer.replicas, "StatefulSet": spec.inference.replicas}
            present = [w for w in (trainer_job, inference) if w is not None]
            warnings = obs.pod_warnings(events, present, pods, desired)
        claims = (await self._claims(job, view) if full else job.claims) if running else {}
        queue_workload = None
        if view.job.queue_name is not None:
            # Read once per pass: a full pass's _ensure_kept_children read it into the cache just before.
            queue_workload = await self._workload(kube.KUEUE_WORKLOAD, view.namespace, view.name)
        report, error = None, None
        if job_plan is not None and rec.should_poll_trainer(view, old, trainer_job):
            try:
                report = await self.trainer.fetch(status_url(job_plan))
            except TrainerUnavailable as exc:
                error = str(exc)
        return rec.Observed(
            trainer_job,
            inference,
            tuple(pods),
            report,
            error,
            blocked=tuple(blocked),
            warnings=warnings,
            claims=claims,
            queue_workload=queue_workload,
            queue_api_missing=job.queue_api_missing,
            pool=pool,
            token=job.token,
        )

    async def _relisted(self, namespace: str) -> None:
        """Re-list the namespace's watched children if its last re-list is a resync old, shared by every job there
        (the first full pass after the interval starts it, the others wait for it). None at first: the watches have
        just listed everything (Kopf lists before it watches). A re-list that failed is not reused."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        last = self.relists.get(namespace)
        if last is None:
            done: asyncio.Future[None] = loop.create_future()
            done.set_result(None)
            self.relists[namespace] = (now, done)
            return
        # One re-list per namespace at a time: a new one starts only once the last has ended, all its lists (one
        # slower than the resync interval, or beside one that failed, would otherwise race a newer one).
        failed = last[1].done() and not last[1].cancelled() and last[1].exception() is not None
        if last[1].done() and (now - last[0] >= self.config.resync_interval or failed):
            last = (now, asyncio.ensure_future(self._relist(namespace)))
            self.relists[namespace] = last
        # Shielded: a pass cancelled while it waits must not cancel the re-list that other jobs wait for.
        await asyncio.shield(last[1])

    async def _relist(self, namespace: str) -> None:
        """An informer's re-list for each watched kind: list the operator's children of the namespace (by label, a
        page at a time, keeping only names) and mark gone whatever the cache holds of that kind that the list lacks,
        unless the cache's entry is newer than the list (its resourceVersion above the list's: the watch or a read
        brought it after the list was served, as an informer's Replace keeps what came after its list); its job gets a
        full pass at once. Ends only once every list has (one that failed fails the re-list after the others)."""

        async def relist(kind: kube.Kind) -> None:
            try:
                listed, served_at = await self.client.list_at(
                    kind, namespace, {c.LABEL_MANAGED_BY: c.OPERATOR_NAME}, keep=_name_if_a_jobs
                )
            except kube.ApiError as exc:
                if exc.status == 404:
                    return  # not served (Kueue not installed): nothing of it is cached either
                raise
            present = {item["metadata"]["name"] for item in listed}
            for key, cached in list(self.cache.items()):
                if key[:2] != (kind.kind, namespace) or key[2] in present or cached is None:
                    continue
                if served_at and _version(cached) > served_at:
                    continue  # newer than the list
                owner = ((cached.get("metadata") or {}).get("labels") or {}).get(c.LABEL_JOB)
                if owner is None:
                    continue  # not a job's (e.g. a pool's StatefulSet, read by its pass): not in this list
                logger.info("%s/%s: %s %s went while the watch was away", namespace, owner, kind.kind, key[2])
                self.cache[key] = None
                self.tombstones[key] = served_at
                job = self.jobs.get((namespace, owner))
                if job is not None:
                    job.next_full = 0.0
                    self._wake(job)

        kinds = [kind for kind in WATCHED if kind != kube.KUEUE_WORKLOAD or self.queue_watched]
        started = asyncio.get_running_loop().time()
        ended = await asyncio.gather(*(relist(kind) for kind in kinds), return_exceptions=True)
        failed = next((result for result in ended if isinstance(result, BaseException)), None)
        if failed is not None:
            raise failed
        took = asyncio.get_running_loop().time() - started
        logger.info("%s: re-listed the jobs' watched children (%d kinds) in %.1f s", namespace, len(kinds), took)

    async def _pool_view(self, view: rec.JobView, *, full: bool) -> pools.PoolView:
        """The job's RolloutPool: from the pools' watch (a cache, like the workloads'), or from the API on full passes
        and when the watch has not shown it."""
        assert view.job is not None and view.job.spec.inference.pool_ref is not None
        name = view.job.spec.inference.pool_ref.name
        key = (c.POOL_KIND, view.namespace, name)
        if full or key not in self.cache:
            found = await self.client.get(kube.ROLLOUTPOOL, view.namespace, name)
            self._pool_seen(view.namespace, name, None if found is None else dict(found), found or {}, read=True)
        body = self.cache.get(key)
        return pools.pool_view(name, body)

    async def _queue_in_effect(self, view: rec.JobView, old: JobStatus) -> rec.JobView:
        """The view with the Kueue queue the job runs under (reconcile.with_queue_in_effect), from its Workload: read
        (from the watch's cache, or the API) when the job names a queue, else only as the watch last showed it (a job
        without a queue, and without a Workload, costs no read)."""
        if view.job is None or view.deleting:
            return view
        key = (kube.KUEUE_WORKLOAD.kind, view.namespace, view.name)
        if view.job.queue_name is not None or self.cache.get(key) is not None:
            workload = await self._workload(kube.KUEUE_WORKLOAD, view.namespace, view.name)
        else:
            workload = None
        return rec.with_queue_in_effect(view, old, workload)

    async def _runtime(self, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """The runtime a job names, read from the API while the job has not started (its passes then use the one it
        recorded, and read none): one read a pass of a waiting job, at the monitor's interval."""
        ref = rec.runtime_to_read(body)
        if ref is None:
            return None
        kind = kube.CLUSTER_GRPOLORA_RUNTIME if ref.kind == c.CLUSTER_RUNTIME_KIND else kube.GRPOLORA_RUNTIME
        namespace = (body.get("metadata") or {}).get("namespace", "default")
        return await self.client.get(kind, namespace if kind.namespaced else None, ref.name)

    async def _trainer_pods_left(self, view: rec.JobView) -> int:
        """Trainer pods of this job's name that are still there (Terminating, most likely) while no trainer Job is.
        Listed by their labels when a trainer Job is about to be created (rare: a job's start, a restart, a resume),
        not from the shared listing, whose snapshot may be up to an interval old (and would then be stale for the
        failure messages that later passes read from it)."""
        labels = {c.LABEL_MANAGED_BY: c.OPERATOR_NAME, c.LABEL_JOB: view.name, c.LABEL_ROLE: c.ROLE_TRAINER}
        return len(await self.client.list(kube.POD, view.namespace, labels))

    async def _managed_secret(self, view: rec.JobView) -> tuple[str, str] | None:
        """(field path, name) of the first Secret the job names that carries the operator's managed-by label; read
        only when its pods are about to be created (a missing Secret is the kubelet's to report)."""
        assert view.job is not None
        named = view.job.spec.secret_references()
        found = await asyncio.gather(*(self.client.get(kube.SECRET, view.namespace, name) for _, name in named))
        for (path, name), secret in zip(named, found, strict=True):
            labels = ((secret or {}).get("metadata") or {}).get("labels") or {}
            if labels.get(c.LABEL_MANAGED_BY) == c.OPERATOR_NAME:
                return path, name
        return None

    async def _listing(
        self,
        kind: kube.Kind,
        namespace: str,
        labels: Mapping[str, str],
        *,
        fields: Mapping[str, str] | None = None,
        fresh: bool = False,
    ) -> list[dict[str, Any]]:
        """A namespace's pods or Warning events, listed at most once per monitor interval and shared by every job
        there that waits for its pods (each picks its own): a burst of new jobs would otherwise list twice per job and
        pass, and spend the client's rate limit on it. A listing that failed is not reused; `fresh`: one begun now
        (shared from then on)."""
        key = (kind.plural, namespace, tuple(sorted(labels.items())), tuple(sorted((fields or {}).items())))
        now = asyncio.get_running_loop().time()
        cached = self.listings.get(key)
        stale = fresh or cached is None or now - cached[0] >= self.config.interval
        if stale or (cached is not None and cached[1].done() and cached[1].exception() is not None):
            cached = (now, asyncio.ensure_future(self.client.list(kind, namespace, labels, fields=fields)))
            self.listings[key] = cached
        # Shielded: a pass cancelled while it waits must not cancel the listing that other jobs wait for.
        return await asyncio.shield(cached[1])

    async def _flavors(self, names_: tuple[str, ...]) -> dict[str, dict[str, Any] | None]:
        """Kueue ResourceFlavors by name (cluster-scoped; None: not found or not readable, e.g. without the chart's
        kueue.resourceFlavors grant). Read only when workloads are about to be created, so no watch is kept (Kueue's
        own integrations read them at the same moment). A transient API failure fails the pass (retried)."""

        async def read(name: str) -> dict[str, Any] | None:
            try:
                return await self.client.get(kube.KUEUE_RESOURCE_FLAVOR, None, name)
            except kube.ApiError as exc:
                if exc.transient:
                    raise
                logger.warning("cannot read Kueue ResourceFlavor %s: %s", name, exc)
                return None

        found = await asyncio.gather(*(read(name) for name in names_))
        return dict(zip(names_, found, strict=True))

    async def _claims(self, job: _Tracked, view: rec.JobView) -> dict[str, tuple[str, ...] | None]:
        """Access modes of the claims the job's pods share (None: no such claim); kept for the light passes."""
        assert view.job is not None
        uses = rec.volume_uses(view.job.spec)
        found = await asyncio.gather(*(self.client.get(kube.PVC, view.namespace, use.claim) for use in uses))
        job.claims = {
            use.claim: tuple((claim.get("spec") or {}).get("accessModes") or ()) if claim else None
            for use, claim in zip(uses, found, strict=True)
        }
        return job.claims

    async def _change_workloads(self, job: _Tracked, decision: rec.Decision) -> bool:
        """Delete, then create (never the same name in one pass); False if a create found the name taken (409)."""
        # What we change, the watch reports later: read it from the API until then.
        for kind, name in [(r.kind, r.name) for r in decision.delete] + [
            (obj["kind"], obj["metadata"]["name"]) for obj in decision.create
        ]:
            self.cache.pop((kind, job.namespace, name), None)
        # In the foreground: a workload stays (with a deletionTimestamp) until its pods are gone, so a decision that
        # sees it absent knows its pods are gone too (a restart, a resume or a re-admission never overlaps them).
        await asyncio.gather(
            *(
                self.client.delete(kube.KINDS[r.kind], job.namespace, r.name, propagation="Foreground")
                for r in decision.delete
            )
        )
        for ref in decision.delete:
            logger.info("%s/%s: deleted %s %s", job.namespace, job.name, ref.kind, ref.name)
        created = await asyncio.gather(*(self._create(job, obj) for obj in decision.create))
        return all(created)

    async def _write_queue_workload(self, job: _Tracked, decision: rec.Decision) -> bool:
        """Carry out what the decision writes on the job's Kueue Workload (grpolora.operator.kueue). A status patch
        holds the resourceVersion it was decided from: if Kueue wrote meanwhile (409), the cached Workload is dropped
        so that the next pass reads it from the API and decides again; False then (the pass comes again soon)."""
        write = decision.queue_workload_write
        if write is None:
            return True
        key = (kube.KUEUE_WORKLOAD.kind, job.namespace, job.name)
        if write.spec is not None:
            written = await self.client.patch(kube.KUEUE_WORKLOAD, job.namespace, job.name, write.spec)
            if written is not None:
                self._remember(key, dict(written), written)
                logger.info("%s/%s: patched the Kueue Workload: %s", job.namespace, job.name, write.spec.get("spec"))
            if write.status is not None:
                return False  # the status patch was decided from the older version: decide again
        if write.status is None:
            return True
        try:
            written = await self.client.patch(
                kube.KUEUE_WORKLOAD, job.namespace, job.name, write.status, subresource="status"
            )
        except kube.ApiError as exc:
            if exc.status != 409:
                raise
            logger.info("%s/%s: the Kueue Workload changed meanwhile; deciding again", job.namespace, job.name)
            self.cache.pop(key, None)
            return False
        if written is not None:
            self._remember(key, dict(written), written)
            if write.released:
                logger.info("%s/%s: gave the Kueue Workload's quota back after its eviction", job.namespace, job.name)
        return True

    async def _record(self, job: _Tracked, decision: rec.Decision) -> bool:
        """Write the status, then the Kueue Workload, then post the events (only after the status write succeeded);
        delete the job after its TTL. False when the Workload's write met a newer Workload (decide again soon)."""
        patch = rec.status_patch(job.status, decision.status)
        if patch is not None:
            written = await self.client.patch(
                kube.GRPOLORAJOB, job.namespace, job.name, {"status": patch}, subresource="status"
            )
            if written is None:
                raise Gone(f"{job.namespace}/{job.name}")
            job.status = dict(written.get("status") or decision.status.to_wire())
        self.metrics.set_job(job.namespace, job.name, decision.status)
        queue_written = await self._write_queue_workload(job, decision)
        involved = {"namespace": job.namespace, "name": job.name, "uid": job.uid}
        for event in decision.events:
            try:
                await self.client.post_event(involved, event.type, event.reason, event.message, now=self.clock())
            except kube.ApiError as exc:
                logger.warning("%s/%s: could not post event %s: %s", job.namespace, job.name, event.reason, exc)
        if decision.delete_job:
            await self.client.delete(kube.GRPOLORAJOB, job.namespace, job.name)
            logger.info("%s/%s: deleted after ttlSecondsAfterFinished", job.namespace, job.name)
            raise Gone(f"{job.namespace}/{job.name}")
        return queue_written

    # ---- monitors ----------------------------------------------------------------------------------------

    def _track(self, body: Mapping[str, Any], kind: str = c.KIND) -> _Tracked:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", "default"), meta.get("name", ""))
        uid = meta.get("uid", "")
        table, forget = (self.pools, self.forget_pool) if kind == c.POOL_KIND else (self.jobs, self.forget)
        job = table.get(key)
        if job is None or job.uid != uid:  # new, or deleted and re-created under the same name
            if job is not None:
                forget(*key)
            job = _Tracked(key[0], key[1], uid, dict(body), dict(body.get("status") or {}), kind=kind)
            table[key] = job
        else:
            known = (job.body.get("metadata") or {}).get("annotations") or {}
            job.body = dict(body)
            annotations = job.body.setdefault("metadata", {}).setdefault("annotations", {})
            for ours in (names.APPLIED_SPEC_ANNOTATION, names.RUNTIME_ANNOTATION):
                written = known.get(ours)
                if written is not None and ours not in annotations:
                    annotations[ours] = written  # the event predates our own write
        return job

    def _schedule(self, job: _Tracked, decision: rec.Decision | pr.PoolDecision, *, woken: bool = False) -> None:
        """After a handler's pass: the job's monitor passes next after the decision's delay (at once if an event
        came during the pass), or not at all if it settled."""
        if woken:
            self._wake(job)
        elif not decision.idle:
            job.due = asyncio.get_running_loop().time() + self._delay(decision)
            self._follow(job)

    def _delay(self, decision: rec.Decision | pr.PoolDecision) -> float:
        if decision.requeue_after is not None:
            return decision.requeue_after
        return self.config.interval * (1 + random.uniform(0, self.config.jitter))

    async def _monitor(self, job: _Tracked) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            job.wake.clear()
            wait = job.due - loop.time()
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(job.wake.wait(), timeout=wait)
                continue  # re-read `due`: a handler pass may have moved it
            try:
                if not await self.gate.active(job.namespace):
                    job.due = loop.time() + self.config.interval
                    continue
                with self.metrics.timed("monitor"):
                    async with job.lock:
                        wakes = job.wakes
                        decision: rec.Decision | pr.PoolDecision = (
                            await self._pool_pass(job, full=loop.time() >= job.next_full)
                            if job.kind == c.POOL_KIND
                            else await self._pass(job, full=loop.time() >= job.next_full)
                        )
            except Gone:
                (self.forget_pool if job.kind == c.POOL_KIND else self.forget)(job.namespace, job.name)
                return
            except Exception as exc:
                failures += 1
                backoff = min(self.config.interval * 2**failures, self.config.max_backoff)
                logger.warning(
                    "%s/%s: monitor pass failed (%s); retrying in %.0fs", job.namespace, job.name, exc, backoff
                )
                job.due = loop.time() + backoff
                continue
            failures = 0
            if job.wakes != wakes:
                job.due = loop.time()  # an event during the pass: not in its decision
            elif decision.idle:
                return
            else:
                job.due = loop.time() + self._delay(decision)


def _pool_ref(body: Mapping[str, Any]) -> str | None:
    """The name of the RolloutPool a job names (None: it has its own servers)."""
    return (((body.get("spec") or {}).get("inference") or {}).get("poolRef") or {}).get("name")


def _admission_facts(body: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a pool's admission reads of a job: when it changes, the pool decides again (Controller.job_event)."""
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    created = next((x.get("status") for x in status.get("conditions") or [] if x.get("type") == names.CREATED), None)
    return (
        meta.get("uid"),
        status.get("tokenDigest"),  # re-keyed: the pool renews its attachment
        status.get("phase"),
        (body.get("spec") or {}).get("suspend"),
        bool(meta.get("deletionTimestamp")),
        created,
        # Its Kueue queue (label, or the runtime it recorded) and Kueue's verdict: only an admitted job takes a place.
        (meta.get("labels") or {}).get(c.KUEUE_QUEUE_LABEL),
        (meta.get("annotations") or {}).get(names.RUNTIME_ANNOTATION),
        pools.admitted_by_kueue(body),
    )


def _member(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a pool's pass keeps of a job: its body less the applied-spec annotation (a second copy of its spec)
    and managedFields (each writer's field set, bigger still). The runtime it recorded as it started stays: the
    pool's admission reads the job's Kueue queue from it (pools.candidate)."""
    meta = {k: v for k, v in (body.get("metadata") or {}).items() if k not in ("annotations", "managedFields")}
    recorded = ((body.get("metadata") or {}).get("annotations") or {}).get(names.RUNTIME_ANNOTATION)
    if recorded is not None:
        meta["annotations"] = {names.RUNTIME_ANNOTATION: recorded}
    return {**body, "metadata": meta}


def _name_if_a_jobs(item: dict[str, Any]) -> dict[str, Any] | None:
    """What a re-list keeps of a listed child: its name, if it is a job's (not a pool's)."""
    meta = item.get("metadata") or {}
    return {"metadata": {"name": meta.get("name")}} if c.LABEL_JOB in (meta.get("labels") or {}) else None


_UNSEEN: Final = object()
"""Not in the workloads' cache (distinct from None, which there means: seen absent)."""


async def _none() -> None:
    return None


def _deleting(body: Mapping[str, Any]) -> bool:
    return bool((body.get("metadata") or {}).get("deletionTimestamp"))


def _pool_facts(body: Mapping[str, Any] | None) -> Any:
    """What a job's pass reads of its pool: the spec, its attached and waiting jobs, its replicas (not the adapter
    versions and rates, which change every pass)."""
    if body is None:
        return None
    status = body.get("status") or {}
    attached = [(j.get("job"), j.get("uid")) for j in status.get("attachedJobs") or []]
    return (body.get("spec"), attached, status.get("waitingJobs"), status.get("replicas"))
