"""The controller's scheduling of passes: the jobs and pools it follows (Tracked), their per-job locks, their
monitors (plain asyncio tasks; see grpolora.operator.controller's docstring), wakes, delays and backoff."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from grpolora.api import constants as c
from grpolora.api.plan import child_names
from grpolora.operator import kube, names
from grpolora.operator import pool_reconcile as pr
from grpolora.operator import reconcile as rec
from grpolora.operator.watch_cache import WATCHED

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControllerConfig:
    interval: float = 10.0
    """Seconds between monitor passes of one job (trainer /status polls; workloads from the watch)."""
    resync_interval: float = 600.0
    """Seconds between full passes of one job (kept children repaired, the token Secret read) and between re-lists
    of a namespace's watched children (what the watches missed corrected; see grpolora.operator.controller)."""
    jitter: float = 0.1
    """Fraction of the interval added at random, so that many jobs do not poll in lockstep."""
    max_backoff: float = 60.0
    """Longest wait after failed passes (doubling from the interval)."""
    operator_namespace: str = c.DEFAULT_OPERATOR_NAMESPACE
    """Where the operator runs: the jobs' NetworkPolicies admit its /status polls from there only."""


class Gone(Exception):
    """The GRPOLoraJob or RolloutPool no longer exists (deleted, or a job removed after its TTL)."""


@dataclass
class Tracked:
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
    """Loop time of the next full pass (see grpolora.operator.controller)."""
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


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class Scheduler:
    """When passes run: the Controller's part that follows jobs and pools and runs their monitors.
    Its state is set in Controller.__init__."""

    def _track(self, body: Mapping[str, Any], kind: str = c.KIND) -> Tracked:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", "default"), meta.get("name", ""))
        uid = meta.get("uid", "")
        table, forget = (self.pools, self.forget_pool) if kind == c.POOL_KIND else (self.jobs, self.forget)
        job = table.get(key)
        if job is None or job.uid != uid:  # new, or deleted and re-created under the same name
            if job is not None:
                forget(*key)
            job = Tracked(key[0], key[1], uid, dict(body), dict(body.get("status") or {}), kind=kind)
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

    def _wake(self, tracked: Tracked | None) -> None:
        """Run the job's (or pool's) next monitor pass now; start its monitor if it had settled (its last pass was
        idle: a suspended or finished job still keeps its kept children, and a pool its attachments)."""
        if tracked is None:
            return
        tracked.wakes += 1
        tracked.due = min(tracked.due, asyncio.get_running_loop().time())
        self._follow(tracked)

    def _follow(self, tracked: Tracked) -> None:
        """Make the job's (or pool's) monitor look at `due` again, starting it if it had ended."""
        if tracked.task is None or tracked.task.done():
            name = f"grpolora monitor {tracked.namespace}/{tracked.name}"
            tracked.task = asyncio.create_task(self._monitor(tracked), name=name)
        else:
            tracked.wake.set()

    def _schedule(self, job: Tracked, decision: rec.Decision | pr.PoolDecision, *, woken: bool = False) -> None:
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

    async def _monitor(self, job: Tracked) -> None:
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

    def deleting(self, body: Mapping[str, Any]) -> None:
        """The job got a deletionTimestamp (e.g. `kubectl delete --cascade=foreground`): its passes create nothing
        from now on (see job_view.JobView.deleting)."""
        meta = body.get("metadata") or {}
        self._mark_deleting(self.jobs.get((meta.get("namespace", ""), meta.get("name", ""))), body)

    def _mark_deleting(self, tracked: Tracked | None, body: Mapping[str, Any]) -> None:
        """Record a followed job's or pool's deletionTimestamp (handlers pass only spec changes) and run a pass."""
        meta = body.get("metadata") or {}
        if tracked is None or tracked.uid != meta.get("uid") or not meta.get("deletionTimestamp"):
            return
        tracked.body.setdefault("metadata", {})["deletionTimestamp"] = meta["deletionTimestamp"]
        self._wake(tracked)

    async def _owner_deleting(self, tracked: Tracked) -> bool:
        """Read the job (or pool) itself before creating a child for it: the collector may already be removing its
        children while our watch has not yet delivered its deletionTimestamp, and a child created now would only be
        collected again (and, in a foreground deletion, hold up the owner's removal). Gone if it is gone."""
        kind = kube.ROLLOUTPOOL if tracked.kind == c.POOL_KIND else kube.GRPOLORAJOB
        found = await self.client.get(kind, tracked.namespace, tracked.name)
        if found is None or (found.get("metadata") or {}).get("uid") != tracked.uid:
            raise Gone(f"{tracked.kind} {tracked.namespace}/{tracked.name}")
        self._mark_deleting(tracked, found)
        return is_deleting(tracked.body)

    def forget(self, namespace: str, name: str) -> None:
        """The job was deleted: stop its monitor and drop its metrics."""
        job = self.jobs.pop((namespace, name), None)
        if job is not None and job.task is not None and job.task is not asyncio.current_task():
            job.task.cancel()
        # Its children as last seen (tombstones included): a job of this name made later reads them from the API.
        # Every name child_names gives (its environment server's too); one that is not of a watched kind is in none.
        for kind in WATCHED:
            for child in child_names(name).values():
                self.cache.pop((kind.kind, namespace, child), None)
                self.tombstones.pop((kind.kind, namespace, child), None)
        self.metrics.forget_job(namespace, name)

    def forget_pool(self, namespace: str, name: str) -> None:
        self.metrics.forget_pool(namespace, name)
        pool = self.pools.pop((namespace, name), None)
        if pool is not None and pool.task is not None and pool.task is not asyncio.current_task():
            pool.task.cancel()

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


def is_deleting(body: Mapping[str, Any]) -> bool:
    return bool((body.get("metadata") or {}).get("deletionTimestamp"))
