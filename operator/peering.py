"""Whether this operator replica may act, under Kopf peering.

Kopf pauses its own handlers when a peer with a higher (or the same) priority is alive, but the per-job monitors
are plain asyncio tasks (Kopf daemons would put a finalizer on every job, see docs/operator.md), so they ask this
gate before each pass. It reads the same peering object Kopf keeps alive and applies Kopf's rule.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from grpolora.operator import kube

CACHE_SECONDS = 5.0


class Gate(Protocol):
    async def active(self, namespace: str) -> bool: ...


class Standalone:
    """No peering (`--standalone`): always active."""

    async def active(self, namespace: str) -> bool:
        return True


def outranked(peers: Mapping[str, Any], *, identity: str, priority: int, now: datetime.datetime) -> bool:
    """Kopf's rule: pause while another live peer has a priority at least ours (same priority pauses all)."""
    for other, info in peers.items():
        if other == identity or not isinstance(info, Mapping):
            continue
        try:
            lastseen = datetime.datetime.fromisoformat(str(info.get("lastseen")).replace("Z", "+00:00"))
            alive = lastseen + datetime.timedelta(seconds=int(info.get("lifetime", 60))) > now
            if alive and int(info.get("priority", 0)) >= priority:
                return True
        except (TypeError, ValueError):
            continue  # a malformed entry is ignored, as by Kopf
    return False


async def ensure_peering_objects(
    client: kube.KubeClient, *, name: str, clusterwide: bool, namespaces: Sequence[str]
) -> None:
    """Create the peering object Kopf waits for (create-if-absent): a ClusterKopfPeering, or a KopfPeering in each
    served namespace. The chart cannot: Helm refuses an object whose CRD it installs in the same release."""
    if clusterwide:
        objects = [{"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}]
    else:
        objects = [
            {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": name, "namespace": namespace}}
            for namespace in namespaces
        ]
    await asyncio.gather(*(client.create(obj) for obj in objects))


class PeeringGate:
    def __init__(self, client: kube.KubeClient, *, name: str, identity: str, priority: int, clusterwide: bool):
        self._client, self._name, self._identity, self._priority = client, name, identity, priority
        self._clusterwide = clusterwide
        self._cache: dict[str | None, tuple[float, bool]] = {}

    async def active(self, namespace: str) -> bool:
        key = None if self._clusterwide else namespace
        loop = asyncio.get_running_loop()
        cached = self._cache.get(key)
        if cached is not None and loop.time() - cached[0] < CACHE_SECONDS:
            return cached[1]
        kind = kube.CLUSTER_KOPF_PEERING if self._clusterwide else kube.KOPF_PEERING
        peering = await self._client.get(kind, key, self._name)
        # Without the peering object Kopf itself does not run (peering is mandatory once named), so neither do we.
        result = peering is not None and not outranked(
            peering.get("status") or {},
            identity=self._identity,
            priority=self._priority,
            now=datetime.datetime.now(datetime.UTC),
        )
        self._cache[key] = (loop.time(), result)
        return result
