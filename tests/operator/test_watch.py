"""Children by watch, not by polling: between resyncs a running job's passes read its Job and StatefulSet from the
operator's watch of them (no API request), and a change of a child reaches the job as an event."""

from __future__ import annotations

import asyncio
import json

import kopf

from grpolora.api import constants as c
from grpolora.operator import names, rbac
from grpolora.operator.controller import Controller, ControllerConfig
from grpolora.operator.kube import GRPOLORAJOB, KubeClient
from grpolora.operator.metrics import Metrics
from grpolora.operator.trainer_client import TrainerStatusClient
from grpolora.testing.kube_emulator import NAMESPACE, POOL_RESOURCE
from tests.helpers import job_doc
from tests.operator.harness import FAST_INTERVAL, OperatorThread, operator_options, wait_for
from tests.operator.test_operator import created, pods_up, report


async def test_a_steady_job_costs_no_api_requests_between_resyncs(cluster, trainer):
    operator = await OperatorThread(cluster.url, operator_options(resync_interval=3600.0)).start()
    try:
        await cluster.apply(job_doc())
        await created(cluster)
        trainer.report = report(step=1, syncRound=1, epoch=1)
        await pods_up(cluster)
        await wait_for(lambda: cluster.status("demo").get("phase") == "Running", "phase Running")
        await wait_for(
            lambda: (cluster.status("demo").get("replicas") or {}).get("inference", {}).get("ready") == 1, "ready"
        )
        await asyncio.sleep(5 * FAST_INTERVAL)
        start = len(cluster.emulator.log)
        await asyncio.sleep(30 * FAST_INTERVAL)  # 30 monitor passes (trainer polls)
        requests = [entry for entry in cluster.emulator.log[start:] if entry[0] != "watch"]
        assert requests == [], f"a steady job's passes still call the API: {requests[:10]}"

        # A child's change is an event: it reaches the job without any read of the child.
        await cluster.set_status("apps/v1/statefulsets", "demo-inference", {"replicas": 1, "readyReplicas": 0})
        await wait_for(lambda: cluster.status("demo")["replicas"]["inference"]["ready"] == 0, "the change, by watch")
        reads = [e for e in cluster.emulator.log[start:] if e[0] == "get" and e[1] == "statefulsets"]
        assert reads == []
    finally:
        await operator.stop()
    assert ("watch", "batch", "jobs") in cluster.emulator.calls and rbac.allowed("watch", "apps", "statefulsets")


def test_the_watch_cache_never_goes_back_to_an_older_version():
    """A watch event that lags behind what a full pass read must not undo it (e.g. an eviction)."""
    from grpolora.operator.controller import Controller

    controller = Controller(client=None, trainer=None, metrics=None)  # type: ignore[arg-type]

    def seen(version: int, admitted: str) -> dict:
        meta = {"name": "demo", "namespace": "ns", "resourceVersion": str(version), "labels": {c.LABEL_JOB: "demo"}}
        return {
            "kind": "Workload",
            "metadata": meta,
            "status": {"conditions": [{"type": "Admitted", "status": admitted}]},
        }

    controller._track({"metadata": {"name": "demo", "namespace": "ns", "uid": "u1"}})  # followed: tombstones kept
    controller.workload_event("Workload", "MODIFIED", seen(7, "False"))  # what a full pass read, say
    controller.workload_event("Workload", "MODIFIED", seen(5, "True"))  # a lagging event
    assert controller.cache[("Workload", "ns", "demo")]["metadata"]["resourceVersion"] == "7"
    controller.workload_event("Workload", "DELETED", seen(8, "False"))
    assert controller.cache[("Workload", "ns", "demo")] is None


async def test_jobs_waiting_for_pods_share_one_pod_and_event_listing_per_namespace(cluster):
    """Why pods are not ready comes from the namespace's pods and Warning events: one listing per namespace and
    monitor interval serves every job there (a burst of new jobs would otherwise list twice per job and pass).
    Passes run by hand here (no monitor timer fires within the hour-long interval), so the count is exact."""
    client = KubeClient(lambda: None)
    client.use(kopf.ConnectionInfo(server=cluster.url))
    config = ControllerConfig(interval=3600.0, resync_interval=3600.0)
    controller = Controller(client, TrainerStatusClient(), Metrics(), config)
    names = [f"job-{i}" for i in range(4)]
    try:
        for name in names:
            doc = job_doc()
            doc["metadata"]["name"] = name
            await cluster.apply(doc)
            await controller.reconcile(cluster.job(name))  # creates its children
        start = len(cluster.emulator.log)
        for _ in range(3):  # three light passes of every job, none of its pods ready
            await asyncio.gather(*(controller._pass(controller.jobs[(NAMESPACE, n)], full=False) for n in names))
        listings = [entry[1] for entry in cluster.emulator.log[start:] if entry[0] == "list"]
        assert (listings.count("pods"), listings.count("events")) == (1, 1), listings
        assert cluster.status("job-3")["phase"] == "Pending"
    finally:
        await controller.stop()


async def test_waiting_jobs_read_their_absent_workloads_once_not_at_every_pass(cluster):
    """A job whose trainer Job and StatefulSet do not exist yet (queued for Kueue, waiting for a place on its pool)
    reads their absence from the API once; its light passes then take it from the cache, which the watch fills when
    they are made (12 GETs per job and minute otherwise, and 500 waiting jobs spend the client's whole rate limit).
    Passes run by hand, as above, so the count is exact."""
    client = KubeClient(lambda: None)
    client.use(kopf.ConnectionInfo(server=cluster.url))
    config = ControllerConfig(interval=3600.0, resync_interval=3600.0)
    controller = Controller(client, TrainerStatusClient(), Metrics(), config)
    pool = {
        "apiVersion": "grpolora.dev/v1alpha1",
        "kind": "RolloutPool",
        "metadata": {"name": "shared", "namespace": NAMESPACE},
        "spec": {"model": {"name": "Qwen/Qwen3-0.6B", "dtype": "bfloat16"}, "replicas": 1, "maxJobs": 1},
    }
    queued = job_doc()
    queued["metadata"]["name"] = "queued"
    queued["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "gpu-queue"}
    waiting = job_doc(model={"name": "Qwen/Qwen3-0.6B", "dtype": "bfloat16"}, inference={"poolRef": {"name": "shared"}})
    waiting["metadata"]["name"] = "waiting"
    try:
        await cluster.apply(pool)
        for doc in (queued, waiting):
            await cluster.apply(doc)
            await controller.reconcile(cluster.job(doc["metadata"]["name"]))
        assert cluster.get("batch/v1/jobs", "queued-trainer") is None
        assert cluster.get("batch/v1/jobs", "waiting-trainer") is None
        start = len(cluster.emulator.log)
        for _ in range(5):  # five light passes of each
            for name in ("queued", "waiting"):
                await controller._pass(controller.jobs[(NAMESPACE, name)], full=False)
        reads = [entry for entry in cluster.emulator.log[start:] if entry[0] == "get"]
        # Each read once at most (by the first light pass: a new job's first pass creates, it does not read).
        assert len(reads) == len(set(reads)), f"waiting jobs read their absent workloads at every pass: {reads}"
    finally:
        await controller.stop()


async def test_a_pools_pass_reads_its_jobs_from_the_watch_and_lists_them_a_page_at_a_time_once(cluster):
    """A pool's admission decides from the watch's cache of the jobs that name it: the namespace's jobs are listed
    (in pages) by its first pass only, not by every pass a job's change wakes, and what is kept of each job holds
    its spec once (not again in the applied-spec annotation). Passes run by hand, as above."""
    client = KubeClient(lambda: None)
    client.use(kopf.ConnectionInfo(server=cluster.url))
    controller = Controller(client, TrainerStatusClient(), Metrics(), ControllerConfig(3600.0, 3600.0))
    pool = {
        "apiVersion": "grpolora.dev/v1alpha1",
        "kind": "RolloutPool",
        "metadata": {"name": "shared", "namespace": NAMESPACE},
        "spec": {"model": {"name": "Qwen/Qwen3-0.6B", "dtype": "bfloat16"}, "replicas": 1, "maxJobs": 1},
    }
    jobs = [f"job-{i}" for i in range(3)]
    try:
        await cluster.apply(pool)
        for name in [*jobs, "alone"]:
            doc = job_doc(model={"name": "Qwen/Qwen3-0.6B", "dtype": "bfloat16"})
            if name != "alone":
                doc["spec"]["inference"] = {"poolRef": {"name": "shared"}}
            doc["metadata"].update(name=name, annotations={names.APPLIED_SPEC_ANNOTATION: json.dumps(doc["spec"])})
            await cluster.apply(doc)
        start = len(cluster.emulator.log)
        await controller.reconcile_pool(cluster.get(POOL_RESOURCE, "shared"))
        assert [e for e in cluster.emulator.log[start:] if e[:2] == ("list", "grpolorajobs")] == [
            ("list", "grpolorajobs", None)
        ]

        start = len(cluster.emulator.log)
        for name in jobs:  # each job's change reaches the pool by watch, and wakes a full pass
            await cluster.set_status(
                f"grpolora.dev/v1alpha1/{c.PLURAL}", name, {"phase": "Pending", "tokenDigest": name}
            )
            controller.job_event("MODIFIED", cluster.job(name))
            await controller._pool_pass(controller.pools[(NAMESPACE, "shared")], full=True)
        lists = [e for e in cluster.emulator.log[start:] if e[0] == "list"]
        assert lists == [], f"a pool's pass woken by a job's change listed the jobs again: {lists}"
        assert sorted(key[1] for key in controller.pool_members) == jobs, "only the jobs on a pool are kept"
        assert {body["status"].get("tokenDigest") for _, _, body in controller.pool_members.values()} == set(jobs)
        assert all("annotations" not in body["metadata"] for _, _, body in controller.pool_members.values())
    finally:
        await controller.stop()


async def test_lists_come_a_page_at_a_time(cluster):
    """`limit`/`continue` (the API server builds no response of the whole collection), every item once."""
    client = KubeClient(lambda: None)
    client.use(kopf.ConnectionInfo(server=cluster.url))
    try:
        for i in range(5):
            doc = job_doc()
            doc["metadata"]["name"] = f"job-{i}"
            await cluster.apply(doc)
        start = len(cluster.emulator.log)
        listed = await client.list(GRPOLORAJOB, NAMESPACE, {}, page=2)
        assert sorted(item["metadata"]["name"] for item in listed) == [f"job-{i}" for i in range(5)]
        assert len(cluster.emulator.log[start:]) == 3, cluster.emulator.log[start:]
    finally:
        await client.close()


def test_tombstones_of_workloads_go_with_their_job():
    """A deleted workload is remembered as absent only while its job is followed: the children of a deleted job,
    collected after it, leave nothing behind in the cache."""
    controller = Controller(client=None, trainer=None, metrics=Metrics())  # type: ignore[arg-type]
    labels = {c.LABEL_JOB: "demo"}
    trainer = {"kind": "Job", "metadata": {"name": "demo-trainer", "namespace": "ns", "labels": labels}}
    controller._track({"metadata": {"name": "demo", "namespace": "ns", "uid": "u1"}})
    controller.workload_event("Job", "DELETED", trainer)
    assert controller.cache[("Job", "ns", "demo-trainer")] is None, "a followed job's tombstone is kept"
    controller.forget("ns", "demo")
    assert ("Job", "ns", "demo-trainer") not in controller.cache
    controller.workload_event("Job", "MODIFIED", {**trainer, "metadata": {**trainer["metadata"], "uid": "x"}})
    controller.workload_event("Job", "DELETED", trainer)
    assert controller.cache == {}, "nothing is kept of a workload whose job is gone"
