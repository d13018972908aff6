"""Children by watch, not by polling: between resyncs a running job's passes read its Job and StatefulSet from the
operator's watch of them (no API request), and a change of a child reaches the job as an event."""

from __future__ import annotations

import asyncio
import json

import kopf

from grpolora.api import constants as c
from grpolora.operator import names, rbac
from grpolora.operator.controller import Controller
from grpolora.operator.kube import GRPOLORAJOB, ApiError, KubeClient
from grpolora.operator.metrics import Metrics
from grpolora.operator.scheduler import ControllerConfig
from grpolora.operator.trainer_client import TrainerStatusClient
from grpolora.operator.watch_cache import WATCHED
from grpolora.testing.kube_emulator import NAMESPACE, POOL_RESOURCE
from tests.helpers import job_doc
from tests.operator.harness import FAST_INTERVAL, OperatorThread, a_pass, operator_options, wait_for
from tests.operator.test_operator import created, pods_up, report, trainer_refuses_its_data

WORKLOADS = "kueue.x-k8s.io/v1beta1/workloads"


async def _running(cluster, trainer) -> None:
    """Apply the job and play its pods up: wait until its status shows it Running with its inference replica ready."""
    await cluster.apply(job_doc())
    await created(cluster)
    trainer.report = report(step=1, syncRound=1, epoch=1)
    await pods_up(cluster)
    await wait_for(lambda: cluster.status("demo").get("phase") == "Running", "phase Running")
    await wait_for(
        lambda: (cluster.status("demo").get("replicas") or {}).get("inference", {}).get("ready") == 1, "ready"
    )


async def test_a_steady_job_costs_no_api_requests_between_resyncs(cluster, trainer):
    operator = await OperatorThread(cluster.url, operator_options(resync_interval=3600.0)).start()
    try:
        await _running(cluster, trainer)
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


async def test_the_watch_cache_never_goes_back_to_an_older_version():
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
    _stop_monitors(controller)  # (the events started one: no pass of it ran, there was no await)


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
        # Its server pods are listed (once an interval) while none is ready, to say why: those are not the jobs.
        lists = [e for e in cluster.emulator.log[start:] if e[0] == "list" and e[1] != "pods"]
        assert lists == [], f"a pool's pass woken by a job's change listed the jobs again: {lists}"
        assert [e for e in cluster.emulator.log[start:] if e[:2] == ("list", "pods")] == [("list", "pods", None)]
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


async def test_tombstones_of_workloads_go_with_their_job():
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
    _stop_monitors(controller)


async def test_tombstones_of_an_environment_servers_children_go_with_their_job():
    """The same for the children of spec.environment.server (its StatefulSet, Service and PodDisruptionBudget
    `<job>-env`, its NetworkPolicy `<job>.env`): seen gone while the job was followed (a foreground deletion collects
    them before the job), they are dropped when the job goes, as its other children are."""
    controller = Controller(client=None, trainer=None, metrics=Metrics())  # type: ignore[arg-type]
    labels = {c.LABEL_JOB: "demo"}
    children = [
        ("StatefulSet", "demo-env"),
        ("Service", "demo-env"),
        ("PodDisruptionBudget", "demo-env"),
        ("NetworkPolicy", "demo.env"),
    ]
    controller._track({"metadata": {"name": "demo", "namespace": "ns", "uid": "u1"}})
    for kind, name in children:
        meta = {"name": name, "namespace": "ns", "labels": labels}
        controller.workload_event(kind, "DELETED", {"kind": kind, "metadata": meta})
        assert controller.cache[(kind, "ns", name)] is None, "a followed job's tombstone is kept"
    controller.forget("ns", "demo")
    left = [*controller.cache, *controller.tombstones]
    assert left == [], f"kept after their job went: {left}"
    _stop_monitors(controller)


def _stop_monitors(controller: Controller) -> None:
    """Cancel the monitors the events started (the tests above have no API to pass against)."""
    for job in controller.jobs.values():
        if job.task is not None:
            job.task.cancel()


# ---- the resync from the watch: kept children watched, a re-list per namespace --------------------------------------


async def test_a_resync_reads_a_jobs_children_from_the_watch_and_only_its_token_secret_from_the_api(cluster, trainer):
    """A full pass (every resync) reads the job's watched children from the operator's cache, as controller-runtime's
    reconcilers read their owned objects from the informer's cache; only the token Secret, which is not watched (that
    would take list/watch on every Secret of the namespace), is read by GET. A queued job reads its Kueue Workload
    once at most, not twice. Before: 7 GETs per running job and resync (Secret, two Services, NetworkPolicy,
    PodDisruptionBudget, Job, StatefulSet), 9 per queued job (its Workload twice as well)."""
    resync = 0.5
    operator = await OperatorThread(cluster.url, operator_options(resync_interval=resync)).start()
    queued = job_doc()
    queued["metadata"].update(name="queued", labels={c.KUEUE_QUEUE_LABEL: "gpu-queue"})
    try:
        await cluster.apply(job_doc())
        await cluster.apply(queued)
        await created(cluster)
        trainer.report = report(step=1, syncRound=1, epoch=1)
        await pods_up(cluster)
        await wait_for(lambda: cluster.status("demo").get("phase") == "Running", "phase Running")
        await wait_for(lambda: cluster.get(WORKLOADS, "queued"), "the queued Workload")
        await asyncio.sleep(2 * resync)
        start = len(cluster.emulator.log)
        await asyncio.sleep(6 * resync)  # at least five full passes of each job
        window = cluster.emulator.log[start:]
        gets = sorted({(resource, name) for verb, resource, name in window if verb == "get"})
        assert gets == [("secrets", "demo-grpolora-token"), ("secrets", "queued-grpolora-token")], gets
        # The re-lists: per namespace and resync, one list of each watched kind (not one per job).
        relists = [resource for verb, resource, _ in window if verb == "list" and resource not in ("pods", "events")]
        assert 0 < relists.count("services") <= 7, relists
    finally:
        await operator.stop()


async def test_a_deleted_kept_child_comes_back_at_once_not_at_the_next_resync(cluster, trainer):
    """Drift repair by event: the watch's DELETED of a kept child wakes its job for a full pass (before: the child
    came back only at the job's next resync, here an hour away)."""
    operator = await OperatorThread(cluster.url, operator_options(resync_interval=3600.0)).start()
    try:
        await cluster.apply(job_doc())
        await created(cluster)
        for path in (
            f"/api/v1/namespaces/{NAMESPACE}/services/demo-trainer",
            f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies/demo",
            f"/apis/policy/v1/namespaces/{NAMESPACE}/poddisruptionbudgets/demo-inference",
        ):
            await cluster._call("DELETE", path)
        await wait_for(lambda: cluster.get("v1/services", "demo-trainer"), "the Service back")
        await wait_for(lambda: cluster.get("networking.k8s.io/v1/networkpolicies", "demo"), "the NetworkPolicy back")
        await wait_for(lambda: cluster.get("policy/v1/poddisruptionbudgets", "demo-inference"), "the PDB back")
    finally:
        await operator.stop()


async def test_a_deletion_the_watch_missed_is_found_by_the_next_re_list_of_the_namespace(cluster):
    """Kopf re-lists after its watch's resourceVersion expired and reports no DELETED for what went meanwhile; an
    informer's re-list (Replace) would. Once per resync the namespace's watched kinds are listed, one list per kind
    for all its jobs (not a GET per job), and what the cache holds that the list lacks is gone: the job's next pass
    makes it again. Passes by hand; the cache is filled as the watch would, and the deletion is never reported."""
    client = KubeClient(lambda: None)
    client.use(kopf.ConnectionInfo(server=cluster.url))
    # A resync that never falls due by itself: the test makes one due (below) so that the window holds exactly one,
    # however slowly the three passes run on a loaded machine (a 0.3 s resync let a second one in under load).
    resync = 3600.0
    controller = Controller(client, TrainerStatusClient(), Metrics(), ControllerConfig(3600.0, resync))
    jobs = [f"job-{i}" for i in range(3)]
    try:
        for name in jobs:
            doc = job_doc()
            doc["metadata"]["name"] = name
            await cluster.apply(doc)
            await controller.reconcile(cluster.job(name))  # creates its children
        for kind in WATCHED:  # what the watch reports of them
            resource = f"{kind.group}/{kind.version}/{kind.plural}".lstrip("/")
            for obj in cluster.objects(resource).values():
                controller.workload_event(kind.kind, "ADDED", obj)
        await cluster._call("DELETE", f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs/job-1-trainer")
        await wait_for(lambda: cluster.get("batch/v1/jobs", "job-1-trainer") is None, "the trainer Job gone")
        listed_at, listing = controller.relists[NAMESPACE]
        controller.relists[NAMESPACE] = (listed_at - resync, listing)  # the namespace's last re-list a resync old
        start = len(cluster.emulator.log)
        for name in jobs:  # their resyncs
            await controller._pass(controller.jobs[(NAMESPACE, name)], full=True)
        window = cluster.emulator.log[start:]
        assert cluster.get("batch/v1/jobs", "job-1-trainer") is not None, "the lost trainer Job made again"
        # (Read by GET: the token Secrets, the job itself before a child is made for it again (is it being deleted?
        # Controller._owner_deleting), and the trainer Job made again, until the watch reports it: none here, and its
        # monitor, woken by the re-list, may pass meanwhile.)
        gets = [(resource, name) for verb, resource, name in window if verb == "get"]
        allowed = {"secrets", c.PLURAL}
        assert {g for g in gets if g[0] not in allowed and g != ("jobs", "job-1-trainer")} == set(), window
        lists = sorted(
            resource for verb, resource, _ in window if verb == "list" and resource not in ("pods", "events")
        )
        assert lists == sorted(kind.plural for kind in WATCHED), lists
    finally:
        await controller.stop()


def _controller(cluster, client_class: type[KubeClient] = KubeClient, interval: float = FAST_INTERVAL) -> Controller:
    """A controller without Kopf: the test hands it the events; its monitors pass every `interval`."""
    client = client_class(lambda: None)
    client.use(kopf.ConnectionInfo(server=cluster.url))
    return Controller(client, TrainerStatusClient(), Metrics(), ControllerConfig(interval, resync_interval=3600.0))


async def _settled(controller: Controller, name: str = "demo") -> None:
    """Wait until the job's monitor has ended: its last pass decided there is nothing to follow (idle)."""
    job = controller.jobs[(NAMESPACE, name)]
    await wait_for(lambda: job.task is None or job.task.done(), "the job settled (its monitor ended)")


async def test_a_child_whose_operator_label_was_removed_gets_it_back(cluster, trainer):
    """The watches list by the operator's label (watch_cache.CHILDREN_SELECTOR). A child that loses it (`kubectl
    label svc demo-trainer app.kubernetes.io/managed-by-`, a policy engine's mutation) leaves the watch as a DELETED
    (the API server's watch sends DELETED for an object that stops matching the selector: staging/src/k8s.io/
    apiserver/pkg/storage/cacher/cache_watcher.go, convertToWatchEvent). The pass then found the name taken (409) at
    every pass, and the child's later changes never reached the operator. It is ours (its controller owner is the
    job): the label is put back, and the watch sees the child again."""
    operator = await OperatorThread(cluster.url, operator_options(resync_interval=3600.0)).start()
    try:
        await cluster.apply(job_doc())
        await created(cluster)
        for path, plural in (
            (f"/api/v1/namespaces/{NAMESPACE}/services/demo-trainer", "v1/services"),
            (f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs/demo-trainer", "batch/v1/jobs"),
        ):
            await cluster._call("PATCH", path, {"metadata": {"labels": {c.LABEL_MANAGED_BY: None}}})
            await wait_for(
                lambda plural=plural: (
                    (cluster.get(plural, "demo-trainer")["metadata"].get("labels") or {}).get(c.LABEL_MANAGED_BY)
                    == c.OPERATOR_NAME
                ),
                f"the label back on {plural}",
            )
        assert len([k for k in cluster.emulator.created if k[0] == "jobs"]) == 1  # the same trainer Job, not another
    finally:
        await operator.stop()


async def test_a_trainer_job_that_lost_its_label_while_its_pods_run_gets_it_back(cluster, trainer):
    """As above, for the trainer Job with its pods running: the watch reports it DELETED, the pass wants a trainer
    Job, lists the trainer pods of the job's name (still labelled: the label went from the Job only) and found the
    running pods of that same Job, which it waited on as "a previous trainer Job"'s. Its status froze, and under
    Kueue the Workload's PodsReady went to WaitForRecovery. Their controller is a Job of the trainer's name whose own
    controller owner is the job: it is read from the API and relabelled, and never waited on."""
    operator = await OperatorThread(cluster.url, operator_options(resync_interval=3600.0)).start()
    try:
        await cluster.apply(job_doc())
        await created(cluster)
        await cluster.run_pod_of("batch/v1/jobs", "demo-trainer", node="gpu-node-1")
        await cluster.set_status("batch/v1/jobs", "demo-trainer", {"active": 1, "ready": 1})
        path = f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs/demo-trainer"
        await cluster._call("PATCH", path, {"metadata": {"labels": {c.LABEL_MANAGED_BY: None}}})
        await wait_for(
            lambda: (
                (cluster.get("batch/v1/jobs", "demo-trainer")["metadata"].get("labels") or {}).get(c.LABEL_MANAGED_BY)
                == c.OPERATOR_NAME
            ),
            "the label back on the trainer Job",
        )
        assert operator.controller is not None
        for _ in range(3):
            await a_pass(cluster, operator)
            assert "previous trainer Job" not in cluster.status("demo").get("message", "")
        assert len([k for k in cluster.emulator.created if k[0] == "jobs"]) == 1  # the same trainer Job
    finally:
        await operator.stop()


async def test_an_idle_job_makes_a_kept_child_again_when_the_watch_reports_it_deleted(cluster):
    """A suspended job settles (no monitor runs for it); its kept children are still its own to keep: a Workload
    deleted meanwhile (by an admin, or by Kueue's own cleanup) is made again at once, as a running job's would be.
    Before, the DELETED woke a monitor that did not exist, and the job stayed without a Workload until it was edited."""
    controller = _controller(cluster)
    queued = job_doc(suspend=True)
    queued["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "gpu-queue"}
    try:
        await cluster.apply(queued)
        await controller.reconcile(cluster.job("demo"))
        await _settled(controller)
        old = cluster.get(WORKLOADS, "demo")
        await cluster._call("DELETE", f"/apis/kueue.x-k8s.io/v1beta1/namespaces/{NAMESPACE}/workloads/demo")
        controller.workload_event("Workload", "DELETED", old)  # as the watch reports it
        new = await wait_for(lambda: cluster.get(WORKLOADS, "demo"), "the Workload made again")
        assert new["metadata"]["uid"] != old["metadata"]["uid"] and new["spec"]["active"] is False
    finally:
        await controller.stop()


async def test_an_event_that_comes_while_a_pass_is_out_gets_a_pass_of_its_own(cluster):
    """A pass reads, then decides: an event that arrives after its reads is not in its decision, and must not be lost
    when that pass ends idle (or sets the next one an interval away); the job passes again at once. Here a settled
    job's Service is deleted (its full pass makes it again), and that pass is held at its read of the token Secret
    while the job's Workload is deleted too."""
    held, release = asyncio.Event(), asyncio.Event()

    class Holding(KubeClient):
        async def get(self, kind, namespace, name):  # type: ignore[override]
            if kind.plural == "secrets" and not release.is_set():
                held.set()
                await release.wait()
            return await super().get(kind, namespace, name)

    controller = _controller(cluster, Holding)
    queued = job_doc(suspend=True)
    queued["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "gpu-queue"}
    try:
        await cluster.apply(queued)
        release.set()
        await controller.reconcile(cluster.job("demo"))
        await _settled(controller)
        old, service = cluster.get(WORKLOADS, "demo"), cluster.get("v1/services", "demo-trainer")
        release.clear()
        await cluster._call("DELETE", f"/api/v1/namespaces/{NAMESPACE}/services/demo-trainer")
        controller.workload_event("Service", "DELETED", service)
        await wait_for(held.is_set, "the job's full pass at its read of the token Secret")
        await cluster._call("DELETE", f"/apis/kueue.x-k8s.io/v1beta1/namespaces/{NAMESPACE}/workloads/demo")
        controller.workload_event("Workload", "DELETED", old)
        release.set()
        await wait_for(lambda: cluster.get("v1/services", "demo-trainer"), "the Service made again")
        new = await wait_for(lambda: cluster.get(WORKLOADS, "demo"), "the Workload made again")
        assert new["metadata"]["uid"] != old["metadata"]["uid"]
    finally:
        await controller.stop()


async def test_a_failed_trainer_is_explained_by_its_pods_as_they_are_when_it_failed(cluster):
    """Why a job with bad data failed is the trainer's termination message, on its pod. The namespace's pods are
    listed at most once per monitor interval for all its jobs that wait for pods (Controller._listing); the message
    is written when the trainer fails, after that listing, often: the pass that finds the trainer Job failed lists
    them again, or the job failed for good with the Job controller's words only. Passes by hand, an hour apart."""
    controller = _controller(cluster, interval=3600.0)
    try:
        await cluster.apply(job_doc(trainer={"maxRestarts": 3}))
        await controller.reconcile(cluster.job("demo"))  # creates its children
        job = controller.jobs[(NAMESPACE, "demo")]
        await controller._pass(job, full=False)  # not ready: lists the pods (none yet), kept for the interval
        await trainer_refuses_its_data(cluster)
        controller.workload_event("Job", "MODIFIED", cluster.get("batch/v1/jobs", "demo-trainer"))
        await controller._pass(job, full=False)
        failed = await wait_for(lambda: cluster.condition("demo", names.FAILED), "the job failed")
        assert "spec.task.dataset.path: file not found: x" in failed["message"], failed
    finally:
        await controller.stop()


async def test_overlapping_re_lists_never_mark_a_child_that_exists_gone(cluster):
    """A re-list of the namespace that failed in part (one list of six answered 429) while another of its lists was
    still out: the next full pass must not start a second re-list beside it, and the slow list, served before a
    child was made again, must not mark that child gone when it ends (the job's passes would no longer see its
    trainer). As an informer's Replace, an entry newer than the list (its resourceVersion above the list's) stays.
    Deterministic: the client holds the Jobs list (served, then kept) until the test lets it go, and the test moves
    on at states it observes (the lists answered, a second re-list's Jobs list asked for, or the first one still
    out)."""
    served, release, returned = asyncio.Event(), asyncio.Event(), asyncio.Event()
    answered: list[str] = []
    jobs_lists: list[str] = []

    class Holding(KubeClient):
        armed = False

        async def _call(self, method, path, *, params=None, body=None, content_type="application/json"):  # type: ignore[override]
            asked = params or {}
            relisting = self.armed and method == "GET" and "labelSelector" in asked and "limit" in asked
            if relisting and path.endswith("/services") and "services" not in answered:
                answered.append("services")
                raise ApiError(429, "TooManyRequests", "throttled", method=method, path=path)
            if relisting and path.endswith("/jobs"):
                jobs_lists.append(path)
            result = await super()._call(method, path, params=params, body=body, content_type=content_type)
            if relisting and path.endswith("/jobs") and len(jobs_lists) == 1:
                served.set()
                await release.wait()  # served (before the child came back), then held
                returned.set()  # (what the re-list does with it follows in this same step: no await left)
            elif relisting:
                answered.append(path.rsplit("/", 1)[-1])
            return result

    client = Holding(lambda: None)
    client.use(kopf.ConnectionInfo(server=cluster.url))
    resync = 0.2
    controller = Controller(client, TrainerStatusClient(), Metrics(), ControllerConfig(3600.0, resync))
    controller._follow = lambda tracked: None  # type: ignore[method-assign]  # passes by hand only: no monitor
    key = ("Job", NAMESPACE, "demo-trainer")
    try:
        await cluster.apply(job_doc())
        await controller.reconcile(cluster.job("demo"))  # creates its children
        for kind in WATCHED:  # what the watch reports of them
            resource = f"{kind.group}/{kind.version}/{kind.plural}".lstrip("/")
            for obj in cluster.objects(resource).values():
                controller.workload_event(kind.kind, "ADDED", obj)
        # The trainer Job goes, unreported (the watch was away): the re-list is what finds it gone.
        trainer_job = cluster.get("batch/v1/jobs", "demo-trainer")
        await cluster._call("DELETE", f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs/demo-trainer")
        await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer") is None, "the trainer Job gone")
        job = controller.jobs[(NAMESPACE, "demo")]
        await asyncio.sleep(resync)  # a resync due
        client.armed = True
        first = asyncio.create_task(controller._pass(job, full=True))
        await wait_for(served.is_set, "the Jobs list served and held")
        await wait_for(lambda: len(answered) == len(WATCHED) - 1, "every other list answered (Services with 429)")
        await cluster._call("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets")  # a round trip: the 429 has landed
        relist = controller.relists[NAMESPACE][1]
        second = asyncio.create_task(controller._pass(job, full=True))  # the next resync's full pass
        # Either the second pass ran a re-list of its own beside the first (and made the trainer Job again), or the
        # first is still the namespace's re-list, and still out.
        await wait_for(
            lambda: second.done() or (controller.relists[NAMESPACE][1] is relist and not relist.done()),
            "a second pass done, or the first re-list still out",
        )
        # The trainer Job made again (by that pass, or here as a pass would) and reported by the watch.
        made = cluster.get("batch/v1/jobs", "demo-trainer")
        if made is None:
            again = {k: v for k, v in trainer_job.items() if k != "status"}
            kept = ("name", "namespace", "labels", "annotations", "ownerReferences")
            again["metadata"] = {k: v for k, v in trainer_job["metadata"].items() if k in kept}
            made = await cluster._call("POST", f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs", again)
        controller.workload_event("Job", "ADDED", made)
        release.set()
        await wait_for(returned.is_set, "the held Jobs list returned to its re-list")
        # (Bounded: a pass that never ends fails the test instead of hanging it.)
        await asyncio.wait_for(asyncio.gather(first, second, return_exceptions=True), 30)
        assert controller.cache.get(key) is not None, "a trainer Job that exists was marked gone by an older list"
        assert controller.cache[key]["metadata"]["uid"] == made["metadata"]["uid"]
    finally:
        release.set()
        await controller.stop()


async def test_a_tombstone_keeps_its_version_so_an_older_read_cannot_bring_the_child_back():
    controller = Controller(client=None, trainer=None, metrics=Metrics())  # type: ignore[arg-type]
    labels = {c.LABEL_JOB: "demo"}

    def trainer(version: int) -> dict:
        meta = {"name": "demo-trainer", "namespace": "ns", "labels": labels, "resourceVersion": str(version)}
        return {"kind": "Job", "metadata": meta}

    controller._track({"metadata": {"name": "demo", "namespace": "ns", "uid": "u1"}})
    controller.workload_event("Job", "DELETED", trainer(9))
    controller._remember(("Job", "ns", "demo-trainer"), trainer(7), trainer(7))  # a GET answered before the delete
    assert controller.cache[("Job", "ns", "demo-trainer")] is None
    controller._remember(("Job", "ns", "demo-trainer"), trainer(12), trainer(12))  # made again since
    assert controller.cache[("Job", "ns", "demo-trainer")]["metadata"]["resourceVersion"] == "12"
    _stop_monitors(controller)


# ---- the watches ask the API server for the operator's children only ------------------------------------------------

OURS = f"{c.LABEL_MANAGED_BY}={c.OPERATOR_NAME}"
WATCHED_PLURALS = {kind.plural for kind in WATCHED}


def _tenants_objects(count: int) -> list[tuple[str, dict]]:
    """Another tenant's Jobs and Services in the operator's namespace: half labelled by another manager, half not."""
    found = []
    for i in range(count):
        labels = {c.LABEL_MANAGED_BY: "helm"} if i % 2 else {}
        meta = {"name": f"tenant-{i}", "namespace": NAMESPACE, "labels": labels}
        pod = {"spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": "busybox:1"}]}}
        found.append(("jobs", {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": {"template": pod}}))
        service = {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {"ports": [{"port": 80}]}}
        found.append(("services", service))
    return found


async def _add_tenants_objects(cluster, count: int) -> None:
    for plural, doc in _tenants_objects(count):
        root = "/api/v1" if plural == "services" else "/apis/batch/v1"
        await cluster._call("POST", f"{root}/namespaces/{NAMESPACE}/{plural}", doc)


async def test_the_watches_never_deliver_another_tenants_objects(cluster, trainer):
    """Kopf's `labels=` filter on a handler is applied in the operator, after the API server has streamed and the
    operator has decoded every object of the kind in the namespaces it serves: on a shared cluster, every tenant's
    churn. Its settings.watching.label_selectors (Kopf >= 1.45: kopf/_cogs/clients/watching.py, watch_objs, and
    fetching.py, fetch_objs, send it as the labelSelector of both the list and the watch) make the API server filter
    instead: another tenant's Jobs and Services (some labelled by another manager) are never delivered, while the
    job's own children still feed the cache."""
    await _add_tenants_objects(cluster, 20)
    operator = await OperatorThread(cluster.url, operator_options()).start()
    try:
        await _running(cluster, trainer)
        # The tenant's churn: every one of its Jobs changes.
        for i in range(20):
            await cluster.set_status("batch/v1/jobs", f"tenant-{i}", {"active": 1})
        await cluster.set_status("apps/v1/statefulsets", "demo-inference", {"replicas": 1, "readyReplicas": 0})
        await wait_for(lambda: cluster.status("demo")["replicas"]["inference"]["ready"] == 0, "the change, by watch")
    finally:
        await operator.stop()
    delivered = cluster.emulator.watch_objects
    assert {key for key in delivered if key[1].startswith("tenant-")} == set(), "another tenant's objects delivered"
    assert delivered["statefulsets", "demo-inference"] >= 2 and delivered["jobs", "demo-trainer"] >= 2
    asked = set(cluster.emulator.selectors)
    for plural in WATCHED_PLURALS:
        assert {selector for _, resource, selector, _ in asked if resource == plural} == {OURS}, (plural, asked)
        assert {("list", plural, OURS, "kopf"), ("watch", plural, OURS, "kopf")} <= asked, plural


async def test_a_watch_that_ends_or_expires_is_taken_up_again_with_its_selector(cluster, trainer):
    """A watch the API server ends (its timeout) is opened again; one that expired (410 Gone: its resourceVersion
    left the watch cache's window) is preceded by a new list (Kopf's continuous_watch returns on the 410 and its
    infinite_watch lists again): both with the selector, and the changes after either still reach the job (a child
    deleted while the watch was away: the next test)."""
    operator = await OperatorThread(cluster.url, operator_options()).start()  # resync every 10 intervals: 1 s
    try:
        await _running(cluster, trainer)

        def opened(verb: str) -> int:
            """Kopf's lists and watches of the StatefulSets (not the operator's own re-lists)."""
            return cluster.emulator.selectors.count((verb, "statefulsets", OURS, "kopf"))

        watches, lists = opened("watch"), opened("list")
        await cluster.emulator.end_watches("apps/v1/statefulsets", expired=False)
        await wait_for(lambda: opened("watch") > watches, "the watch opened again")
        assert opened("list") == lists, "an ended watch is opened again from its resourceVersion, without a list"
        await cluster.set_status("apps/v1/statefulsets", "demo-inference", {"replicas": 1, "readyReplicas": 0})
        await wait_for(lambda: cluster.status("demo")["replicas"]["inference"]["ready"] == 0, "a change after it")

        watches, lists = opened("watch"), opened("list")
        await cluster.emulator.end_watches("apps/v1/statefulsets", expired=True)
        await wait_for(lambda: opened("list") > lists and opened("watch") > watches, "a list, then a watch")
        await cluster.set_status("apps/v1/statefulsets", "demo-inference", {"replicas": 1, "readyReplicas": 1})
        await wait_for(lambda: cluster.status("demo")["replicas"]["inference"]["ready"] == 1, "a change after it")
    finally:
        await operator.stop()


async def test_a_deletion_missed_while_a_watch_expired_is_found_at_once_not_at_the_next_resync(cluster, trainer):
    """Kopf lists again after its watch expired (410 Gone) and reports no DELETED for what went meanwhile; an
    informer's re-list would (its Replace). The objects of Kopf's list come as events of type None: they bring the
    namespace's own re-list forward (Controller._relisted), so a child that went while the watch was away is marked
    gone and made again at once, not at the next resync (an hour away here)."""
    operator = await OperatorThread(cluster.url, operator_options(resync_interval=3600.0)).start()
    try:
        await _running(cluster, trainer)
        old = cluster.get("v1/services", "demo-trainer")
        await cluster.emulator.remove_unseen("v1/services", "demo-trainer", NAMESPACE)
        await cluster.emulator.end_watches("v1/services", expired=True)
        made = await wait_for(lambda: cluster.get("v1/services", "demo-trainer"), "the Service made again", timeout=15)
        assert made["metadata"]["uid"] != old["metadata"]["uid"]
    finally:
        await operator.stop()
