"""RolloutPools with the real operator (Kopf and all) against the API emulator: admission in order, PoolFull
waiting, detachment when a job finishes or is deleted, a job that does not fit, the pool's NetworkPolicy, its
status, and deleting the pool under its jobs."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

from grpolora.api import constants as c
from grpolora.api.pool import auth_digest, token_fingerprint
from grpolora.operator import names
from grpolora.testing.kube_emulator import NAMESPACE, POOL_RESOURCE, Cluster
from tests.helpers import job_doc
from tests.operator.harness import FAST_INTERVAL, OperatorThread, operator_options, wait_for
from tests.operator.kueue_double import FakeKueue, is_true

POOL = "shared"
SECRET = "shared-pool-jobs"
SERVERS = "shared-pool"


def pool_doc(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "grpolora.dev/v1alpha1",
        "kind": "RolloutPool",
        "metadata": {"name": POOL, "namespace": NAMESPACE},
        "spec": {"model": {"name": "Qwen/Qwen3-0.6B", "dtype": "bfloat16"}, "replicas": 1, "maxJobs": 1, **spec},
    }


def job_on_pool(name: str, **spec: Any) -> dict[str, Any]:
    model = {"name": "Qwen/Qwen3-0.6B", "dtype": "bfloat16", **spec.pop("model", {})}
    doc = job_doc(model=model, inference={"poolRef": {"name": POOL}}, **spec)
    doc["metadata"]["name"] = name
    return doc


def listed(cluster: Cluster) -> list[str] | None:
    """The jobs in the pool's attachment list (None: no Secret yet)."""
    secret = cluster.get("v1/secrets", SECRET)
    if secret is None:
        return None
    return [j["job"] for j in json.loads(base64.b64decode(secret["data"]["jobs.json"]))["jobs"]]


def trainer(cluster: Cluster, job: str) -> dict[str, Any] | None:
    return cluster.get("batch/v1/jobs", f"{job}-trainer")


def admitted_trainers(cluster: Cluster) -> list[dict[str, Any]] | None:
    policy = cluster.get("networking.k8s.io/v1/networkpolicies", SERVERS)
    if policy is None:
        return None
    rules = policy["spec"]["ingress"]
    return [peer for rule in rules if "ports" not in rule for peer in rule["from"]]


def peer(job: str) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": {c.LABEL_JOB: job, c.LABEL_ROLE: c.ROLE_TRAINER}}}


def attached_condition(cluster: Cluster, job: str) -> dict[str, Any]:
    return cluster.condition(job, names.POOL_ATTACHED)


async def succeed(cluster: Cluster, job: str) -> None:
    """Play the Job controller: the trainer Job completed."""
    await cluster.set_status(
        "batch/v1/jobs", f"{job}-trainer", {"conditions": [{"type": "Complete", "status": "True"}]}
    )


async def test_jobs_attach_in_turn_and_a_finished_job_detaches_for_the_next(cluster, operator):
    await cluster.apply(pool_doc())
    await cluster.apply(job_on_pool("job-a"))
    await cluster.apply(job_on_pool("job-b"))  # the same second: the name breaks the tie

    await wait_for(lambda: listed(cluster) == [f"{NAMESPACE}/job-a"], "job-a in the attachment list")
    await wait_for(lambda: trainer(cluster, "job-a"), "job-a's trainer Job")
    await wait_for(
        lambda: attached_condition(cluster, "job-b").get("reason") == names.R_POOL_FULL, "job-b waiting (PoolFull)"
    )
    assert cluster.status("job-b")["phase"] == "Pending"
    assert cluster.status("job-b")["message"] == "1st in line for RolloutPool shared (1/1 jobs attached)"
    assert trainer(cluster, "job-b") is None
    # The pool runs the servers; the jobs bring only their trainers.
    assert cluster.get("apps/v1/statefulsets", SERVERS) is not None
    assert cluster.get("apps/v1/statefulsets", "job-a-inference") is None
    assert cluster.get("v1/services", "job-a-inference") is None
    await wait_for(lambda: attached_condition(cluster, "job-a").get("status") == "True", "job-a PoolAttached")
    assert cluster.status("job-a")["pool"] == POOL
    await wait_for(lambda: admitted_trainers(cluster) == [peer("job-a")], "the pool admitting job-a's trainer")
    status = cluster.pool_status(POOL)
    assert [j["job"] for j in status["attachedJobs"]] == [f"{NAMESPACE}/job-a"]
    assert status["waitingJobs"] == [f"{NAMESPACE}/job-b"] and status["jobs"] == "1/1" and status["waiting"] == 1

    await succeed(cluster, "job-a")
    await wait_for(lambda: cluster.status("job-a").get("phase") == "Succeeded", "job-a Succeeded")
    await wait_for(lambda: listed(cluster) == [f"{NAMESPACE}/job-b"], "job-a detached, job-b attached")
    await wait_for(lambda: trainer(cluster, "job-b"), "job-b's trainer Job")
    await wait_for(lambda: admitted_trainers(cluster) == [peer("job-b")], "the pool admitting only job-b's trainer")
    await wait_for(lambda: cluster.pool_status(POOL).get("waitingJobs") == [], "nobody waiting")
    await wait_for(
        lambda: (names.E_ATTACHED, "attached to RolloutPool shared") in [e[1:] for e in cluster.events("job-b")],
        "job-b's AttachedToPool event",
    )
    created = "created the token Secret, the trainer's headless Service and the NetworkPolicy"
    assert (names.E_CREATED, created) in [e[1:] for e in cluster.events("job-b")]


async def test_deleting_an_attached_job_detaches_it_and_attaches_the_next(cluster, operator):
    await cluster.apply(pool_doc())
    await cluster.apply(job_on_pool("job-a"))
    await cluster.apply(job_on_pool("job-b"))
    await wait_for(lambda: trainer(cluster, "job-a"), "job-a's trainer Job")

    await cluster.delete_job("job-a")
    await wait_for(lambda: listed(cluster) == [f"{NAMESPACE}/job-b"], "job-a detached, job-b attached")
    await wait_for(lambda: trainer(cluster, "job-b"), "job-b's trainer Job")
    await wait_for(lambda: admitted_trainers(cluster) == [peer("job-b")], "the pool admitting only job-b's trainer")


async def test_a_job_that_does_not_fit_its_pool_fails_at_once_naming_the_field_and_both_values(cluster, operator):
    await cluster.apply(pool_doc(maxLoraRank=16))
    await cluster.apply(job_on_pool("too-big", lora={"rank": 64}, model={"dtype": "float32"}))
    await wait_for(lambda: cluster.status("too-big").get("phase") == "Failed", "the job Failed")
    failed = cluster.condition("too-big", names.FAILED)
    assert failed["reason"] == names.R_POOL_MISMATCH
    assert "spec.model.dtype: is 'float32' but RolloutPool shared serves 'bfloat16'" in failed["message"]
    assert "spec.lora.rank: 64 is above RolloutPool shared's maxLoraRank (16)" in failed["message"]
    assert trainer(cluster, "too-big") is None and cluster.get("v1/secrets", "too-big-grpolora-token") is None
    await wait_for(lambda: cluster.pool_status(POOL).get("jobs") == "0/1", "the pool's status")
    assert cluster.pool_status(POOL)["waitingJobs"] == [] and listed(cluster) == []


async def test_a_job_waits_for_its_pool_to_exist_then_attaches(cluster, operator):
    await cluster.apply(job_on_pool("early"))
    await wait_for(lambda: attached_condition(cluster, "early").get("reason") == names.R_POOL_NOT_FOUND, "PoolNotFound")
    assert (
        cluster.status("early")["phase"] == "Pending"
        and "RolloutPool team-a/shared" in cluster.status("early")["message"]
    )
    await cluster.apply(pool_doc())
    await wait_for(lambda: trainer(cluster, "early"), "the trainer Job once the pool exists")
    assert listed(cluster) == [f"{NAMESPACE}/early"]


async def test_deleting_a_pool_fails_its_attached_jobs_and_leaves_waiting_ones_pending(cluster, operator):
    await cluster.apply(pool_doc())
    await cluster.apply(job_on_pool("job-a"))
    await cluster.apply(job_on_pool("job-b"))
    await wait_for(lambda: trainer(cluster, "job-a"), "job-a's trainer Job")
    await wait_for(lambda: attached_condition(cluster, "job-b").get("reason") == names.R_POOL_FULL, "job-b waiting")

    await cluster.delete_pool(POOL)
    await wait_for(lambda: cluster.status("job-a").get("phase") == "Failed", "job-a Failed")
    assert cluster.condition("job-a", names.FAILED)["reason"] == names.R_POOL_DELETED
    await wait_for(lambda: trainer(cluster, "job-a") is None, "job-a's trainer Job deleted")
    await wait_for(
        lambda: attached_condition(cluster, "job-b").get("reason") == names.R_POOL_NOT_FOUND, "job-b PoolNotFound"
    )
    assert cluster.status("job-b")["phase"] == "Pending"


async def test_the_pool_status_carries_each_replicas_adapter_version_of_each_job(cluster, trainer, operator):
    await cluster.apply(pool_doc())
    await cluster.apply(job_on_pool("job-a"))
    await wait_for(lambda: listed(cluster) == [f"{NAMESPACE}/job-a"], "job-a attached")
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", SERVERS), "the pool's StatefulSet")
    await cluster.set_status("apps/v1/statefulsets", SERVERS, {"replicas": 1, "readyReplicas": 1})

    def versions() -> Any:
        attached = cluster.pool_status(POOL).get("attachedJobs") or [{}]
        return attached[0].get("adapterVersions")

    # A replica that does not answer (503 while loading) is left out, not an error.
    await wait_for(lambda: (cluster.pool_status(POOL).get("replicas") or {}).get("ready") == 1, "the ready replica")
    assert versions() == [] and "tokensPerSecond" not in cluster.pool_status(POOL)
    trainer.adapters = {"jobs": {f"{NAMESPACE}/job-a": {"live_version": 7}}, "tokens_per_second": 123.4}

    await wait_for(lambda: versions() == [{"replica": 0, "liveVersion": 7}], "job-a's adapter version on replica 0")
    status = cluster.pool_status(POOL)
    assert status["replicas"] == {"desired": 1, "ready": 1} and status["tokensPerSecond"] == 123.4
    assert status["slotsInUse"] == 2 and status["slots"] == 2
    await wait_for(lambda: (cluster.status("job-a").get("replicas") or {}).get("inference", {}).get("ready") == 1,
                   "job-a's inference replicas (the pool's) in kubectl get glj")  # fmt: skip
    assert cluster.get(POOL_RESOURCE, POOL)["status"]["conditions"][0]["type"] == names.READY


async def test_a_suspended_job_detaches_and_queues_again_when_resumed(cluster, operator):
    await cluster.apply(pool_doc())
    await cluster.apply(job_on_pool("job-a"))
    await cluster.apply(job_on_pool("job-b"))
    await wait_for(lambda: trainer(cluster, "job-a"), "job-a's trainer Job")

    await cluster.patch_spec("job-a", {"suspend": True})
    await wait_for(lambda: listed(cluster) == [f"{NAMESPACE}/job-b"], "job-a detached, job-b attached")
    await wait_for(lambda: trainer(cluster, "job-b"), "job-b's trainer Job")
    await wait_for(lambda: trainer(cluster, "job-a") is None, "job-a's trainer removed")

    await cluster.patch_spec("job-a", {"suspend": False})
    await wait_for(
        lambda: cluster.status("job-a").get("message") == "1st in line for RolloutPool shared (1/1 jobs attached)",
        "job-a back in line",
    )
    assert attached_condition(cluster, "job-a")["reason"] == names.R_POOL_FULL and trainer(cluster, "job-a") is None


async def test_kueue_queues_only_the_trainer_of_a_job_on_a_pool_and_only_an_admitted_job_takes_a_place(
    cluster, operator, kueue
):
    """A place in the pool goes to admitted jobs only. Were a queued job to take one while Kueue holds it back, a
    later job admitted first (BestEffortFIFO) would hold its GPU quota and wait for that place: a deadlock."""
    from tests.operator.test_runtime import cluster_runtime

    workloads = "kueue.x-k8s.io/v1beta1/workloads"
    first, later = job_on_pool("first"), job_on_pool("later")  # first in the pool's line (creation, then name)
    # The first is queued by its runtime (spec.scheduling.queueName there, no label): the pool reads that queue from
    # what the job recorded as it started, the later one's from its label.
    await cluster.apply(cluster_runtime(scheduling={"queueName": "gpu-queue"}))
    first["spec"]["runtimeRef"] = {"kind": c.CLUSTER_RUNTIME_KIND, "name": "cpu-small"}
    later["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "gpu-queue"}
    await cluster.apply(pool_doc())  # one place
    await cluster.apply(first)
    await cluster.apply(later)
    # Each job's pass runs on its own: the later job's Workload may well be written first.
    await wait_for(lambda: cluster.get(workloads, "first") and cluster.get(workloads, "later"), "the Kueue Workloads")
    assert [(p["name"], p["count"]) for p in cluster.get(workloads, "first")["spec"]["podSets"]] == [("trainer", 1)]
    assert cluster.get(workloads, "first")["spec"]["queueName"] == "gpu-queue"
    await wait_for(lambda: cluster.condition("first", names.ADMITTED).get("reason") == names.R_QUEUED, "Queued")

    await kueue.admit("later")  # Kueue admits the later job first
    await wait_for(lambda: listed(cluster) == [f"{NAMESPACE}/later"], "the admitted job attached")
    await wait_for(lambda: trainer(cluster, "later"), "its trainer Job")
    assert trainer(cluster, "first") is None
    # A job Kueue holds back does not wait in the pool's line either.
    await wait_for(lambda: cluster.pool_status(POOL).get("waitingJobs") == [], "nobody in the pool's line")
    assert [j["job"] for j in cluster.pool_status(POOL)["attachedJobs"]] == [f"{NAMESPACE}/later"]


async def test_a_pool_child_the_api_server_refuses_is_reported_in_the_pool_status():
    """E.g. no `update` on rolloutpools/finalizers where the OwnerReferencesPermissionEnforcement plugin is on
    (OpenShift): the children's blockOwnerDeletion is refused with 403."""
    from grpolora.operator import rbac
    from grpolora.testing.kube_emulator import running_cluster
    from tests.operator.harness import OperatorThread, fake_trainer, operator_options

    def authorize(verb: str, group: str, resource: str) -> bool:
        return resource != f"{c.POOL_PLURAL}/finalizers" and rbac.allowed(verb, group, resource)

    async with running_cluster(authorize=authorize) as cluster, fake_trainer():
        operator = await OperatorThread(cluster.url, operator_options()).start()
        try:
            await cluster.apply(pool_doc())
            await wait_for(
                lambda: cluster.get(POOL_RESOURCE, POOL).get("status", {}).get("conditions"), "the pool's status"
            )
            ready = cluster.pool_status(POOL)["conditions"][0]
            assert (ready["type"], ready["status"], ready["reason"]) == (names.READY, "False", names.R_CREATE_REFUSED)
            assert "the API server refused the Secret shared-pool-jobs: " in ready["message"]
            assert "rolloutpools/finalizers" in cluster.pool_status(POOL)["message"]
        finally:
            await operator.stop()


async def test_a_pool_deleted_in_the_foreground_gets_no_child_back_while_it_waits(cluster, operator):
    """As for jobs (test_operator.py): the collector removes the pool's children while its servers' pod terminates;
    the pool's passes (a full one every resync_interval) must not create them again."""
    cluster.emulator.pod_exit_seconds = None  # the server ignores SIGTERM: its StatefulSet stays a while
    await cluster.apply(pool_doc())
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", SERVERS), "the pool's StatefulSet")
    await wait_for(lambda: cluster.pool_status(POOL).get("replicas") is not None, "the pool's first status")
    await cluster.run_pod_of("apps/v1/statefulsets", SERVERS)
    creates = len(cluster.emulator.created)
    await cluster.delete_pool(POOL, cascade="Foreground")
    await wait_for(lambda: cluster.get("v1/secrets", SECRET) is None, "the attachment Secret collected")
    await asyncio.sleep(10 * FAST_INTERVAL)  # several passes, a full one among them (resync_interval)
    assert cluster.get(POOL_RESOURCE, POOL) is not None, "the pool still waits for its servers' pod"
    again = [key for key in cluster.emulator.created[creates:] if key[0] != "events"]
    assert again == [], f"created while the pool was being deleted: {again}"
    await cluster.emulator.end_grace_periods()
    await wait_for(lambda: cluster.get(POOL_RESOURCE, POOL) is None, "the pool removed")


def auth_of(cluster: Cluster, job: str) -> str | None:
    """The token digest the pool's attachment list holds for the job."""
    secret = cluster.get("v1/secrets", SECRET)
    jobs = json.loads(base64.b64decode(secret["data"]["jobs.json"]))["jobs"] if secret else []
    return next((j["auth"] for j in jobs if j["job"] == f"{NAMESPACE}/{job}"), None)


async def test_a_re_keyed_job_gets_its_attachment_renewed_before_its_trainer_comes_back(cluster, operator):
    """A job's token Secret deleted and re-made with a new token: the pool must serve the job under the new token
    (else its new trainer gets 401s for ever) before the new trainer starts."""
    await cluster.apply(pool_doc())
    await cluster.apply(job_on_pool("job-a"))
    await wait_for(lambda: trainer(cluster, "job-a"), "job-a's trainer Job")
    before = trainer(cluster, "job-a")["metadata"]["uid"]
    await cluster._call("DELETE", f"/api/v1/namespaces/{NAMESPACE}/secrets/job-a-grpolora-token")
    await wait_for(lambda: cluster.get("v1/secrets", "job-a-grpolora-token"), "the token Secret re-made")
    token = cluster.secret_data("job-a-grpolora-token")["token"]
    await wait_for(lambda: (trainer(cluster, "job-a") or {}).get("metadata", {}).get("uid") not in (None, before),
                   "a new trainer Job", timeout=15)  # fmt: skip
    assert auth_of(cluster, "job-a") == auth_digest(token), "the trainer came back before the pool knew its token"
    entry = next(j for j in cluster.pool_status(POOL)["attachedJobs"] if j["job"] == f"{NAMESPACE}/job-a")
    assert entry["tokenDigest"] == cluster.status("job-a")["tokenDigest"] == token_fingerprint(token)
    assert names.E_REKEYED in [reason for _, reason, _ in cluster.events("job-a")]


async def test_a_pool_posts_events_for_attach_detach_full_and_a_lost_replica(cluster, operator):
    """`kubectl describe rpool` tells the pool's story as `kubectl describe glj` tells a job's: each transition once,
    posted on the RolloutPool itself."""
    await cluster.apply(pool_doc())
    await cluster.apply(job_on_pool("job-a"))
    await cluster.apply(job_on_pool("job-b"))
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", SERVERS), "the pool's servers")
    await cluster.set_status("apps/v1/statefulsets", SERVERS, {"replicas": 1, "readyReplicas": 1})
    attached = (names.E_POOL_JOB_ATTACHED, f"{NAMESPACE}/job-a attached (1 of maxJobs 1)")
    full = (names.E_POOL_FULL, f"full (1 of maxJobs 1): {NAMESPACE}/job-b wait")
    await wait_for(lambda: {attached, full} <= {e[1:] for e in cluster.events(POOL)}, "attached and full")

    await wait_for(lambda: trainer(cluster, "job-a"), "job-a's trainer Job")
    await succeed(cluster, "job-a")
    detached = (names.E_POOL_JOB_DETACHED, f"{NAMESPACE}/job-a detached (1 of maxJobs 1)")
    next_one = (names.E_POOL_JOB_ATTACHED, f"{NAMESPACE}/job-b attached (1 of maxJobs 1)")
    await wait_for(lambda: {detached, next_one} <= {e[1:] for e in cluster.events(POOL)}, "detached, the next one")

    await wait_for(lambda: (cluster.pool_status(POOL).get("replicas") or {}).get("ready") == 1, "a ready replica")
    await cluster.set_status("apps/v1/statefulsets", SERVERS, {"replicas": 1, "readyReplicas": 0})
    await wait_for(lambda: names.E_POOL_REPLICA_LOST in [e[1] for e in cluster.events(POOL)], "ReplicaLost")
    lost = [e for e in cluster.events(POOL) if e[1] == names.E_POOL_REPLICA_LOST]
    assert lost[0][0] == "Warning" and "1 -> 0 of 1" in lost[0][2]
    kinds = {
        obj.raw["involvedObject"]["kind"]
        for (res, _, _), obj in cluster.emulator.objects.items()
        if res == "v1/events" and obj.raw["involvedObject"]["name"] == POOL
    }
    assert kinds == {c.POOL_KIND}
    assert [e[1] for e in cluster.events(POOL)].count(names.E_POOL_FULL) == 1, "each transition once"


async def test_a_pool_whose_servers_crash_says_why_in_its_status(cluster, operator):
    """A pool's servers that exit at start (a model they cannot load exits 78, then CrashLoopBackOff): its status
    said only '0/1 replicas ready'. It now reads its pods while replicas are missing and says what the kubelet and
    the container's last exit say, as a job's status does for its own pods."""
    await cluster.apply(pool_doc())
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", SERVERS), "the pool's servers")
    await cluster.set_status("apps/v1/statefulsets", SERVERS, {"replicas": 1, "readyReplicas": 0})
    pod = await cluster.run_pod_of("apps/v1/statefulsets", SERVERS)
    server = {
        "name": "server",
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s restarting failed container"}},
        "lastState": {"terminated": {"exitCode": 78, "message": "error: spec.model.name: no such model\n"}},
    }
    await cluster.set_status("v1/pods", pod, {"phase": "Running", "containerStatuses": [server]})
    said = f"0/1 replicas ready (CrashLoopBackOff: {pod}: back-off 20s restarting failed container (last exit 78: "
    await wait_for(lambda: said in (cluster.pool_status(POOL).get("message") or ""), "the pool says why")
    ready = next(x for x in cluster.pool_status(POOL)["conditions"] if x["type"] == names.READY)
    assert ready["status"] == "False" and ready["reason"] == "CrashLoopBackOff"


async def test_a_scaled_pool_patches_its_servers_replicas_alone_and_lists_them_for_the_jobs(
    cluster, trainer, unused_tcp_port
):
    """`kubectl scale rolloutpool/shared --replicas=3` (a PATCH of its /scale subresource): the StatefulSet's
    replicas follow, its pod template stays (no server is
    replaced), the attachment list names the new replicas for the jobs' trainers, the pool says so once, and the
    operator's metrics count the pool's replicas."""
    operator = await OperatorThread(cluster.url, operator_options(metrics_port=unused_tcp_port)).start()
    try:
        await scale_and_scrape(cluster, f"http://127.0.0.1:{unused_tcp_port}/metrics")
    finally:
        await operator.stop()


async def scrape(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(url) as got:
        return await got.text()


async def scrape_until(url: str, line: str, *, present: bool = True, seconds: float = 10.0) -> str:
    """The operator's metrics once `line` is in them (or, present=False, no longer is); wait_for takes no coroutine."""
    deadline = asyncio.get_running_loop().time() + seconds
    while (line in (scraped := await scrape(url))) != present:
        assert asyncio.get_running_loop().time() < deadline, f"metrics {'without' if present else 'with'} {line}"
        await asyncio.sleep(FAST_INTERVAL)
    return scraped


async def scale_and_scrape(cluster: Cluster, metrics: str) -> None:
    await cluster.apply(pool_doc())
    await cluster.apply(job_on_pool("job-a"))
    await wait_for(lambda: listed(cluster) == [f"{NAMESPACE}/job-a"], "job-a attached")
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", SERVERS), "the pool's servers")
    await cluster.set_status("apps/v1/statefulsets", SERVERS, {"replicas": 1, "readyReplicas": 1})
    await wait_for(lambda: (cluster.pool_status(POOL).get("replicas") or {}).get("ready") == 1, "a ready replica")
    template = cluster.get("apps/v1/statefulsets", SERVERS)["spec"]["template"]

    def secret(key: str) -> dict[str, Any]:
        return json.loads(base64.b64decode(cluster.get("v1/secrets", SECRET)["data"][key]))

    assert len(secret("replicas.json")["endpoints"]) == 1
    path = f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{NAMESPACE}/{c.POOL_PLURAL}/{POOL}"
    await cluster._call("PATCH", f"{path}/scale", {"spec": {"replicas": 3}})  # what kubectl scale sends
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", SERVERS)["spec"]["replicas"] == 3, "3 servers")
    assert cluster.get("apps/v1/statefulsets", SERVERS)["spec"]["template"] == template, "no server replaced"
    await wait_for(lambda: len(secret("replicas.json")["endpoints"]) == 3, "the new replicas in the pool's Secret")
    pool = f'namespace="{NAMESPACE}",pool="{POOL}"'
    scraped = await scrape_until(metrics, f"grpolora_pool_replicas_desired{{{pool}}} 3.0")  # after the status write
    assert f"grpolora_pool_replicas_ready{{{pool}}} 1.0" in scraped
    assert f"grpolora_pool_jobs_attached{{{pool}}} 1.0" in scraped
    assert f"grpolora_pool_lora_slots_free{{{pool}}} 0.0" in scraped
    assert secret("replicas.json")["generation"] == cluster.get(POOL_RESOURCE, POOL)["metadata"]["generation"]
    assert [j["job"] for j in secret("jobs.json")["jobs"]] == [f"{NAMESPACE}/job-a"], "the jobs stay attached"
    await wait_for(lambda: any(reason == names.E_POOL_SCALED and message.startswith("scaled from 1 to 3 server")
                               for _, reason, message in cluster.events(POOL)), "Scaled")  # fmt: skip
    assert names.E_POOL_REPLICA_LOST not in [e[1] for e in cluster.events(POOL)]
    assert cluster.pool_status(POOL)["replicas"]["desired"] == 3
    # What a HorizontalPodAutoscaler reads to find the pods whose metrics it averages: the Scale's status.selector
    # (the CRD's labelSelectorPath), the StatefulSet's own selector as a string.
    scale = await cluster._call("GET", f"{path}/scale")
    matched = cluster.get("apps/v1/statefulsets", SERVERS)["spec"]["selector"]["matchLabels"]
    assert scale["status"]["selector"] == ",".join(f"{k}={v}" for k, v in sorted(matched.items()))

    await cluster._call("PATCH", f"{path}/scale", {"spec": {"replicas": 2}})
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", SERVERS)["spec"]["replicas"] == 2, "2 servers")
    await wait_for(lambda: len(secret("replicas.json")["endpoints"]) == 2, "the removed replica out of the list")
    assert cluster.status("job-a")["phase"] != "Failed"
    await cluster.delete_pool(POOL)
    await wait_for(lambda: cluster.get(POOL_RESOURCE, POOL) is None, "the pool deleted")
    await scrape_until(metrics, f'pool="{POOL}"', present=False)  # the deleted pool's series go with it


async def test_a_job_waiting_for_room_on_its_pool_holds_no_quota_and_is_not_evicted_over_and_over(cluster, operator):
    """Kueue counts a job's trainer quota from its admission; the pool's places are the operator's. A job admitted
    while its pool is full held that quota and waited; under waitForPodsReady Kueue evicted it after the timeout,
    requeued it with backoff and admitted it again, over and over (and with backoffLimitCount deactivated it for good:
    RequeuingLimitExceeded). While its pool has no place for it, the job keeps its Workload inactive (spec.active:
    false, as for a suspended job: Kueue evicts an inactive Workload's admission, never admits it and holds no quota
    for it, pkg/controller/core/workload_controller.go), and makes it active again once a place is free."""
    async with FakeKueue(cluster, capacity=2, pods_ready_timeout=3600.0, backoff=0.1) as kueue:
        await cluster.apply(pool_doc())  # one place
        first, later = job_on_pool("first"), job_on_pool("later")
        for doc in (first, later):
            doc["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "gpu-queue"}
            await cluster.apply(doc)
            await wait_for(lambda doc=doc: trainer(cluster, doc["metadata"]["name"]) or doc is later, "first runs")
        await wait_for(lambda: listed(cluster) == [f"{NAMESPACE}/first"], "the first job attached")
        # The first job's pods are ready: its Workload is not the one waitForPodsReady is after.
        await cluster.set_status("batch/v1/jobs", "first-trainer", {"active": 1, "ready": 1})
        await cluster.set_status("apps/v1/statefulsets", SERVERS, {"readyReplicas": 1})
        await wait_for(lambda: is_true(kueue.workload("first"), "PodsReady"), "first's PodsReady")
        kueue.pods_ready_timeout = 0.5  # the test plays the clock (see test_kueue's PodsReady tests)

        await wait_for(lambda: kueue.workload("later") is not None, "later's Workload")
        for _ in range(4):  # passes over many PodsReady timeouts
            before = operator.passes()
            await wait_for(lambda b=before: operator.passes() > b + 2, "passes of the operator")
            await asyncio.sleep(0.3)
            workload = kueue.workload("later")
            assert not kueue.holds_quota(workload), workload["status"]
            assert "later" not in kueue.timed_out, kueue.timed_out
            assert cluster.status("later")["phase"] == "Pending"
            assert trainer(cluster, "later") is None
        assert "room" in cluster.condition("later", names.ADMITTED)["message"], cluster.condition(
            "later", names.ADMITTED
        )

        await succeed(cluster, "first")  # a place is free: later is queued, admitted and attached
        await wait_for(lambda: listed(cluster) == [f"{NAMESPACE}/later"], "later attached")
        await wait_for(lambda: trainer(cluster, "later"), "later's trainer Job")
        assert kueue.holds_quota(kueue.workload("later"))
