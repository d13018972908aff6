"""The emulator's watch streams apply their label selector on the server, as kube-apiserver's watch cache does
(staging/src/k8s.io/apiserver/pkg/storage/cacher/cache_watcher.go, cacheWatcher.convertToWatchEvent), so that a test
can tell an operator that filters on the server from one that receives everything and drops it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from grpolora.testing.kube_emulator import NAMESPACE, Cluster, running_cluster
from tests.operator.harness import wait_for

JOBS = f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs"
MANAGED_BY = "app.kubernetes.io/managed-by"
OURS = f"{MANAGED_BY}=grpo-lora-operator"


def _job(name: str, labels: dict[str, str]) -> dict[str, Any]:
    template = {"spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": "busybox:1"}]}}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
        "spec": {"template": template},
    }


class _Watch:
    """A watch request as a client other than the test sends it (so the emulator counts what it delivers)."""

    def __init__(self, cluster: Cluster, selector: str):
        self.cluster, self.selector = cluster, selector
        self.events: list[dict[str, Any]] = []
        self.ended = asyncio.Event()

    async def run(self) -> None:
        params = {"watch": "true", "labelSelector": self.selector}
        async with (
            aiohttp.ClientSession(headers={"User-Agent": "grpo-lora-operator/x"}) as session,
            session.get(self.cluster.url + JOBS, params=params) as response,
        ):
            assert response.status == 200, await response.text()
            async for line in response.content:
                if line.strip():
                    self.events.append(json.loads(line))
        self.ended.set()

    def seen(self) -> list[tuple[str, str]]:
        return [(e["type"], (e["object"].get("metadata") or {}).get("name")) for e in self.events]


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with running_cluster() as running:
        yield running


async def test_a_watch_with_a_label_selector_gets_only_what_matches_and_what_stops_matching_goes_deleted(cluster):
    await cluster._call("POST", JOBS, _job("ours-1", {"app.kubernetes.io/managed-by": "grpo-lora-operator"}))
    await cluster._call("POST", JOBS, _job("theirs-1", {"app.kubernetes.io/managed-by": "helm"}))
    watch = _Watch(cluster, OURS)
    task = asyncio.create_task(watch.run())
    try:
        await wait_for(lambda: watch.events, "the stream's first event")
        await cluster._call("POST", JOBS, _job("theirs-2", {}))
        await cluster._call("PATCH", f"{JOBS}/theirs-1", {"metadata": {"annotations": {"x": "y"}}})
        # A label that comes makes the object ADDED; one that goes makes it DELETED, with the content last seen
        # (its labels still ours) at the event's resourceVersion.
        await cluster._call("PATCH", f"{JOBS}/theirs-2", {"metadata": {"labels": {MANAGED_BY: "grpo-lora-operator"}}})
        await cluster._call("PATCH", f"{JOBS}/ours-1", {"metadata": {"labels": {MANAGED_BY: None}}})
        await wait_for(lambda: len(watch.events) >= 3, "three events")
        assert watch.seen() == [("ADDED", "ours-1"), ("ADDED", "theirs-2"), ("DELETED", "ours-1")]
        gone = watch.events[2]["object"]["metadata"]
        assert gone["labels"] == {"app.kubernetes.io/managed-by": "grpo-lora-operator"}
        assert gone["resourceVersion"] == cluster.get("batch/v1/jobs", "ours-1")["metadata"]["resourceVersion"]
        await cluster._call("DELETE", f"{JOBS}/theirs-1")  # never shown: nothing to say
        await cluster._call("DELETE", f"{JOBS}/theirs-2")
        await wait_for(lambda: len(watch.events) >= 4, "the deletion")
        assert watch.seen()[3:] == [("DELETED", "theirs-2")]
        assert cluster.emulator.watch_objects == {("jobs", "ours-1"): 2, ("jobs", "theirs-2"): 2}
        assert ("watch", "jobs", OURS, "grpo-lora-operator") in cluster.emulator.selectors

        # The watch cache's window passed: an ERROR event of 410 Gone, reason Expired, and the stream ends.
        await cluster.emulator.end_watches("batch/v1/jobs", expired=True)
        await asyncio.wait_for(watch.ended.wait(), 5)
        assert watch.events[-1]["type"] == "ERROR"
        assert (watch.events[-1]["object"]["code"], watch.events[-1]["object"]["reason"]) == (410, "Expired")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_timed_out_watch_just_ends(cluster):
    watch = _Watch(cluster, OURS)
    task = asyncio.create_task(watch.run())
    await wait_for(lambda: cluster.emulator.selectors, "the watch open")
    await cluster.emulator.end_watches("batch/v1/jobs", expired=False)
    await asyncio.wait_for(task, 5)
    assert watch.events == []


async def test_lists_honour_the_selectors_the_api_reads_and_refuse_the_ones_not_played(cluster):
    await cluster._call("POST", JOBS, _job("ours-1", {"app.kubernetes.io/managed-by": "grpo-lora-operator", "a": "1"}))
    await cluster._call("POST", JOBS, _job("theirs-1", {"a": "2"}))

    async def names(selector: str) -> list[str]:
        listed = await cluster._call("GET", f"{JOBS}?labelSelector={selector}")
        return sorted(item["metadata"]["name"] for item in listed["items"])

    assert await names(OURS) == ["ours-1"]
    assert await names("a!=1") == ["theirs-1"]
    assert await names("app.kubernetes.io/managed-by") == ["ours-1"]
    assert await names("!app.kubernetes.io/managed-by") == ["theirs-1"]
    async with cluster.session.get(f"{cluster.url}{JOBS}?labelSelector=a in (1,2)") as response:
        assert response.status == 400 and "labelSelector" in (await response.json())["message"]
