"""The controller's pass of a RolloutPool, and the watch of the jobs on pools that its admission reads."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from grpolora.api import constants as c
from grpolora.api.plan import PoolPlan, plan_pool
from grpolora.api.status import PoolStatus
from grpolora.operator import builders, kube, names, pools
from grpolora.operator import observe as obs
from grpolora.operator import pool_reconcile as pr
from grpolora.operator import reconcile as rec
from grpolora.operator.job_status import status_patch
from grpolora.operator.job_writes import ChildRefused
from grpolora.operator.scheduler import Gone, Tracked
from grpolora.operator.watch_cache import version_of

logger = logging.getLogger(__name__)


class PoolPass:
    """One pass of a RolloutPool and the cache of its jobs: the Controller's part for pools.
    Its state is set in Controller.__init__."""

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
            self.members_gone[key[0]][key] = version_of(body)
        if event_type != "DELETED" and before is not None and version_of(body) < version_of(before[2]):
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

    async def _pool_pass(self, pool: Tracked, *, full: bool) -> pr.PoolDecision:
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

    async def _pool_observe(self, pool: Tracked, view: pr.PoolPassView) -> pr.PoolObserved:
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
        statefulset = children.get(pr.statefulset_ref(pool_plan))
        reports, pods, *tokens = await asyncio.gather(
            self._adapter_reports(pool_plan, view, statefulset),
            self._pool_pods(view, statefulset),
            *(self.client.get(kube.SECRET, view.namespace, pr.token_secret_name(key)) for key in reads),
        )
        return pr.PoolObserved(
            jobs=tuple(listed),
            children=children,
            tokens=dict(zip(reads, tokens, strict=True)),
            reports=reports,
            pods=pods,
        )

    async def _pool_observe_light(self, view: pr.PoolPassView) -> pr.PoolObserved:
        """A light pass's reads: the servers' StatefulSet, and their adapter reports."""
        assert view.pool is not None  # valid: a full pass wrote a status for this generation
        pool_plan = plan_pool(view.pool)
        ref = pr.statefulset_ref(pool_plan)
        statefulset = await self.client.get(kube.STATEFULSET, view.namespace, ref[1])
        reports, pods = await asyncio.gather(
            self._adapter_reports(pool_plan, view, statefulset), self._pool_pods(view, statefulset)
        )
        return pr.PoolObserved(children={ref: statefulset}, reports=reports, pods=pods)

    async def _pool_pods(
        self, view: pr.PoolPassView, statefulset: Mapping[str, Any] | None
    ) -> tuple[dict[str, Any], ...]:
        """The pool's server pods while fewer are ready than it wants (they say why: a crash loop, no node), listed
        by its selector at most once per interval (_listing); none otherwise."""
        assert view.pool is not None
        if statefulset is None or obs.statefulset_ready(statefulset) >= view.pool.spec.replicas:
            return ()
        return tuple(await self._listing(kube.POD, view.namespace, builders.pool_selector(view.name)))

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

    async def _pool_jobs(self, pool: Tracked) -> list[dict[str, Any]]:
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
            newest = max(newest, version_of(item))
            return _member(item) if _pool_ref(item) else None

        self.members_gone[namespace] = gone = {}
        try:
            listed = await self.client.list(kube.GRPOLORAJOB, namespace, {}, keep=keep)
        finally:
            del self.members_gone[namespace]
        found = {(namespace, body["metadata"].get("name", "")): body for body in listed}
        for key, (_, _, body) in list(self.pool_members.items()):
            if key[0] == namespace and key not in found and version_of(body) <= newest:
                del self.pool_members[key]  # older than the list, yet not in it: gone (or off its pool)
        for key, body in found.items():
            cached = self.pool_members.get(key)
            if gone.get(key, -1) >= version_of(body):
                continue  # deleted since the list was taken
            if cached is None or version_of(cached[2]) <= version_of(body):  # never back to an older version
                self.pool_members[key] = (str(_pool_ref(body)), _admission_facts(body), body)

    async def _adapter_reports(
        self, pool_plan: PoolPlan, view: pr.PoolPassView, statefulset: Mapping[str, Any] | None
    ) -> tuple[dict[str, Any] | None, ...]:
        """Each replica's open GET /v1/adapter (None where it does not answer); none while no replica of the pool's
        own StatefulSet is ready."""
        if statefulset is None or obs.controller_uid(statefulset) != view.uid or not obs.statefulset_ready(statefulset):
            return ()
        return tuple(await asyncio.gather(*(self.trainer.json(f"{url}/v1/adapter") for url in pool_plan.endpoints)))

    async def _record_pool(self, pool: Tracked, status: PoolStatus, events: tuple[rec.Event, ...] = ()) -> None:
        """Write the pool's status (once per pass, skipped when unchanged), let its jobs see it at once, then post
        the pool's events (only after the write succeeded, as a job's)."""
        patch = status_patch(pool.status, status)
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


def _pool_facts(body: Mapping[str, Any] | None) -> Any:
    """What a job's pass reads of its pool: the spec, its attached and waiting jobs, its replicas (not the adapter
    versions and rates, which change every pass)."""
    if body is None:
        return None
    status = body.get("status") or {}
    attached = [(j.get("job"), j.get("uid")) for j in status.get("attachedJobs") or []]
    return (body.get("spec"), attached, status.get("waitingJobs"), status.get("replicas"))
