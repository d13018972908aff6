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
import datetime
from collections.abc import Callable, Mapping
from typing import Any

from grpolora.api import constants as c
from grpolora.operator import kube
from grpolora.operator import pool_reconcile as pr
from grpolora.operator import reconcile as rec
from grpolora.operator.job_pass import JobPass
from grpolora.operator.job_writes import JobWrites
from grpolora.operator.metrics import Metrics
from grpolora.operator.peering import Gate, Standalone
from grpolora.operator.pool_pass import PoolPass
from grpolora.operator.scheduler import ControllerConfig, Gone, Scheduler, Tracked, utcnow
from grpolora.operator.trainer_client import TrainerStatusClient
from grpolora.operator.watch_cache import WatchCache


class Controller(Scheduler, JobPass, JobWrites, PoolPass, WatchCache):
    """The operator's one controller of GRPOLoraJobs and RolloutPools, composed of its parts: the watch cache
    (watch_cache), the scheduler of passes (scheduler), the job pass (job_pass: reads and decides; job_writes: carries
    the decision out) and the pool pass (pool_pass)."""

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
        self.jobs: dict[tuple[str, str], Tracked] = {}
        self.pools: dict[tuple[str, str], Tracked] = {}
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
        self.relists_forward: dict[str, float] = {}
        """When each namespace's re-list was last brought forward by a listing of Kopf's (see _listed_by_watch)."""
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
