"""The controller's watch cache of a job's children (WATCHED) and its informer-like re-lists: what each pass reads
instead of the API (see grpolora.operator.controller's docstring for how the cache is fed and corrected)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from typing import Any, Final

from grpolora.api import constants as c
from grpolora.operator import kube

logger = logging.getLogger(__name__)

WATCHED: Final = (
    kube.JOB,
    kube.STATEFULSET,
    kube.KUEUE_WORKLOAD,
    kube.SERVICE,
    kube.NETWORK_POLICY,
    kube.POD_DISRUPTION_BUDGET,
)
"""The kinds of a job's children followed by watch (handlers.build_registry) and read from the cache by every pass."""


CHILDREN_SELECTOR: Final = {c.LABEL_MANAGED_BY: c.OPERATOR_NAME}
"""The label selector of every list and watch of the WATCHED kinds (the watches: main.build_settings; the re-lists:
_relist), so that the API server sends the operator its own children only (every child carries the label:
builders.labels)."""

LISTING_RELIST_SECONDS: Final = 5.0
"""The least time between a namespace's re-lists brought forward by Kopf's listings (_listed_by_watch)."""

KEPT_WATCHED: Final = frozenset(kind.kind for kind in (kube.SERVICE, kube.NETWORK_POLICY, kube.POD_DISRUPTION_BUDGET))
"""Watched kept children: a full pass makes them exist, so their DELETED asks for one; other events change nothing."""


UNSEEN: Final = object()
"""Not in the workloads' cache (distinct from None, which there means: seen absent)."""


def version_of(obj: Mapping[str, Any]) -> int:
    """metadata.resourceVersion as a number (etcd's revision; 0 when absent or not a number)."""
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


class WatchCache:
    """What the watches showed, kept for every pass: the Controller's part that caches and re-lists.
    Its state is set in Controller.__init__."""

    def workload_event(self, kind: str, event_type: str | None, body: Mapping[str, Any]) -> None:
        """A watch event of one of a job's watched children (WATCHED): cache it, and wake its job for a pass (for a
        kept child, only when it went: then a full pass, which makes it again)."""
        meta = body.get("metadata") or {}
        namespace, name = meta.get("namespace", ""), meta.get("name", "")
        if event_type is None:
            self._listed_by_watch(namespace)
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
        if cached is not None and version_of(seen) < version_of(cached):
            return
        if value is not None and key in self.tombstones and version_of(seen) <= self.tombstones[key]:
            return  # read before it was seen gone
        self.cache[key] = value
        if value is None:
            self.tombstones[key] = max(version_of(seen), self.tombstones.get(key, 0))
        else:
            self.tombstones.pop(key, None)

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
        before = self.cache.get(key, UNSEEN)
        found = await self.client.get(kind, namespace, name)
        if found is not None:
            self._remember(key, dict(found), found)
        elif self.cache.get(key, UNSEEN) is before:
            # Absent: remembered as such, or every light pass of a job whose workloads wait (for Kueue, for its pool)
            # would GET them again. The watch reports their ADDED when they come (a re-listing after a reconnect
            # too). Not if the watch spoke while the GET was out: what it said is at least as new as the 404.
            self.cache[key] = None
        return found

    def _listed_by_watch(self, namespace: str) -> None:
        """Kopf listed a watched kind of the namespace (its objects come as events of type None): at start, and again
        after its watch expired (410 Gone), when it reports no DELETED for what went meanwhile. Bring the namespace's
        re-list forward, to the next full pass of one of its jobs (woken now), so that such a child is marked gone
        at once rather than at the next resync. Once per LISTING_RELIST_SECONDS at most (a listing comes as many
        events, of each kind); nothing before the namespace's first pass (the listing is then the cache's start)."""
        last = self.relists.get(namespace)
        now = asyncio.get_running_loop().time()
        if (
            last is None
            or not last[1].done()
            or now - self.relists_forward.get(namespace, -math.inf) < LISTING_RELIST_SECONDS
        ):
            return
        job = next((job for key, job in self.jobs.items() if key[0] == namespace), None)
        if job is None:
            return
        self.relists_forward[namespace] = now
        self.relists[namespace] = (-math.inf, last[1])  # due: the next full pass re-lists
        job.next_full = 0.0
        self._wake(job)

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
                listed, served_at = await self.client.list_at(kind, namespace, CHILDREN_SELECTOR, keep=_name_if_a_jobs)
            except kube.ApiError as exc:
                if exc.status == 404:
                    return  # not served (Kueue not installed): nothing of it is cached either
                raise
            present = {item["metadata"]["name"] for item in listed}
            for key, cached in list(self.cache.items()):
                if key[:2] != (kind.kind, namespace) or key[2] in present or cached is None:
                    continue
                if served_at and version_of(cached) > served_at:
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


def _name_if_a_jobs(item: dict[str, Any]) -> dict[str, Any] | None:
    """What a re-list keeps of a listed child: its name, if it is a job's (not a pool's)."""
    meta = item.get("metadata") or {}
    return {"metadata": {"name": meta.get("name")}} if c.LABEL_JOB in (meta.get("labels") or {}) else None
