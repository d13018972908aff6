"""Runtimes with the real operator (Kopf and all) against the API emulator, which applies the CRDs' defaults as the
API server does: a job waits, Pending, for the runtime it names; it is built from the job merged with the runtime;
the runtime it started on is recorded, so an edit (or the deletion) of the runtime changes no running job."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from grpolora.api import constants as c
from grpolora.operator import names
from grpolora.testing.kube_emulator import CRD_RESOURCE, NAMESPACE, Cluster
from tests.helpers import job_doc
from tests.operator.harness import FAST_INTERVAL, wait_for

RUNTIME = "cpu-small"


def cluster_runtime(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.CLUSTER_RUNTIME_KIND,
        "metadata": {"name": RUNTIME},
        "spec": spec,
    }


def job_on_runtime(name: str = "demo", kind: str = c.CLUSTER_RUNTIME_KIND, **spec: Any) -> dict[str, Any]:
    doc = job_doc(**spec)
    doc["metadata"]["name"] = name
    doc["spec"]["runtimeRef"] = {"kind": kind, "name": RUNTIME}
    # The runtime says where the job runs: the job_doc builder's own choices of it are left out.
    for field in ("trainer", "inference", "sync"):
        if field not in spec:
            doc["spec"].pop(field, None)
    return doc


def trainer_pod(cluster: Cluster, job: str = "demo") -> dict[str, Any] | None:
    found = cluster.get("batch/v1/jobs", f"{job}-trainer")
    return found["spec"]["template"]["spec"] if found else None


def worker(pod: dict[str, Any]) -> dict[str, Any]:
    return next(x for x in pod["containers"] if x["name"] == c.ROLE_TRAINER)


PLACEMENT = {
    "gpusPerReplica": 0,
    "image": "registry.example/worker-cpu:1",
    "nodeSelector": {"pool": "cpu", "zone": "a"},
    "resources": {"requests": {"cpu": "2", "memory": "4Gi"}},
}


async def test_a_job_waits_for_its_runtime_then_runs_merged_with_it(cluster, operator):
    await cluster.apply(job_on_runtime(trainer={"replicas": 1, "nodeSelector": {"zone": "b"}}))
    await wait_for(
        lambda: cluster.condition("demo", names.RUNTIME_RESOLVED).get("reason") == names.R_RUNTIME_NOT_FOUND,
        "RuntimeNotFound",
    )
    status = cluster.status("demo")
    assert status["phase"] == "Pending"
    assert f"ClusterGRPOLoraRuntime {RUNTIME}, which does not exist" in status["message"]
    assert cluster.condition("demo", names.CREATED)["status"] == "False"
    assert trainer_pod(cluster) is None and cluster.get("v1/secrets", "demo-grpolora-token") is None
    # Said once in `kubectl describe glj` too, however many passes it waits.
    await wait_for(lambda: [e for e in cluster.events("demo") if e[1] == names.R_RUNTIME_NOT_FOUND], "the event")
    await asyncio.sleep(3 * FAST_INTERVAL)  # more passes, still waiting
    waiting = [e for e in cluster.events("demo") if e[1] == names.R_RUNTIME_NOT_FOUND]
    assert waiting == [("Warning", names.R_RUNTIME_NOT_FOUND, status["message"])]

    await cluster.apply(
        cluster_runtime(trainer=PLACEMENT, inference={"gpusPerReplica": 0, "kvCacheGiB": 1}, sync={"backend": "gloo"})
    )
    await wait_for(lambda: trainer_pod(cluster), "the trainer Job once the runtime exists")
    pod = trainer_pod(cluster)
    assert pod is not None
    # The job's own fields win (zone), the runtime gives the rest; the CRD wrote no default that hides it (GPUs).
    assert pod["nodeSelector"] == {"pool": "cpu", "zone": "b"}
    assert worker(pod)["image"] == "registry.example/worker-cpu:1"
    assert "nvidia.com/gpu" not in json.dumps(worker(pod)["resources"])
    await wait_for(lambda: cluster.condition("demo", names.RUNTIME_RESOLVED).get("status") == "True", "resolved")
    resolved = cluster.condition("demo", names.RUNTIME_RESOLVED)
    assert f"ClusterGRPOLoraRuntime {RUNTIME} (generation 1)" in resolved["message"]
    recorded = json.loads(cluster.job("demo")["metadata"]["annotations"][names.RUNTIME_ANNOTATION])
    assert (recorded["kind"], recorded["name"], recorded["generation"]) == (c.CLUSTER_RUNTIME_KIND, RUNTIME, 1)
    assert recorded["resourceVersion"] and recorded["spec"]["trainer"]["image"] == "registry.example/worker-cpu:1"


async def test_an_edited_runtime_changes_no_running_job(cluster, operator):
    runtime = cluster_runtime(trainer=PLACEMENT, inference={"gpusPerReplica": 0}, sync={"backend": "gloo"})
    await cluster.apply(runtime)
    await cluster.apply(job_on_runtime(trainer={"maxRestarts": 2}))
    await wait_for(lambda: trainer_pod(cluster), "the trainer Job")
    await wait_for(lambda: cluster.condition("demo", names.CREATED).get("status") == "True", "Created")

    await cluster.patch_object(runtime, {"spec": {"trainer": {"image": "registry.example/worker-cpu:2"}}})
    # A restart builds the trainer Job again, from the spec the job started with.
    failed = {"conditions": [{"type": "Failed", "status": "True", "reason": "PodFailure"}]}
    await cluster.set_status("batch/v1/jobs", "demo-trainer", failed)
    await wait_for(lambda: cluster.status("demo").get("trainerRestarts") == 1, "a restart")
    await wait_for(lambda: trainer_pod(cluster) and not _failed(cluster), "the new trainer Job")
    pod = trainer_pod(cluster)
    assert pod is not None and worker(pod)["image"] == "registry.example/worker-cpu:1"
    assert cluster.condition("demo", names.SPEC_CHANGE_REFUSED).get("status") == "False"
    assert cluster.condition("demo", names.RUNTIME_RESOLVED)["message"].endswith("(generation 1)")


def _failed(cluster: Cluster) -> bool:
    found = cluster.get("batch/v1/jobs", "demo-trainer")
    return any(x.get("type") == "Failed" for x in ((found or {}).get("status") or {}).get("conditions") or [])


async def test_a_namespaced_runtime_is_read_in_the_jobs_namespace(cluster, operator):
    runtime = cluster_runtime(trainer=PLACEMENT, inference={"gpusPerReplica": 0}, sync={"backend": "gloo"})
    runtime["kind"] = c.RUNTIME_KIND
    runtime["metadata"]["namespace"] = NAMESPACE
    await cluster.apply(runtime)
    await cluster.apply(job_on_runtime(kind=c.RUNTIME_KIND))
    await wait_for(lambda: cluster.condition("demo", names.RUNTIME_RESOLVED).get("status") == "True", "resolved")
    assert cluster.condition("demo", names.RUNTIME_RESOLVED)["message"] == (
        f"runs on GRPOLoraRuntime {NAMESPACE}/{RUNTIME} (generation 1)"
    )


async def test_a_merge_that_is_invalid_fails_the_job_naming_the_runtime(cluster, operator):
    await cluster.apply(cluster_runtime(sync={"backend": "nccl"}))
    await cluster.apply(job_on_runtime(trainer={"gpusPerReplica": 0}))
    await wait_for(lambda: cluster.status("demo").get("phase") == "Failed", "Failed")
    invalid = cluster.condition("demo", names.INVALID_SPEC)
    assert "spec.sync.backend" in invalid["message"]
    assert f"(the job merged with ClusterGRPOLoraRuntime {RUNTIME})" in invalid["message"]
    assert cluster.get(CRD_RESOURCE, "demo") is not None and trainer_pod(cluster) is None


GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
SPOT_TOLERATION = {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}


async def test_a_jobs_env_and_tolerations_add_to_the_runtimes_through_the_api(cluster, operator):
    """The API server keeps `$patch` items (env and tolerations are schemaless Kubernetes objects in the CRD), and the
    operator merges as `grpolora render` does: the platform's settings stay beside the job's one added line."""
    trainer = {**PLACEMENT, "env": [{"name": "NCCL_DEBUG", "value": "WARN"}, {"name": "DROP_ME", "value": "1"}],
               "tolerations": [GPU_TOLERATION]}  # fmt: skip
    await cluster.apply(cluster_runtime(trainer=trainer, inference={**PLACEMENT, "gpusPerReplica": 0}))
    job_trainer = {
        "env": [{"name": "WANDB_MODE", "value": "offline"}, {"name": "DROP_ME", "$patch": "delete"}],
        "tolerations": [SPOT_TOLERATION],
    }
    await cluster.apply(job_on_runtime(trainer=job_trainer))
    await wait_for(lambda: trainer_pod(cluster) is not None, "the trainer Job")
    pod = trainer_pod(cluster)
    assert pod is not None
    env = {e["name"]: e.get("value") for e in worker(pod)["env"]}
    assert env["NCCL_DEBUG"] == "WARN" and env["WANDB_MODE"] == "offline" and "DROP_ME" not in env
    assert GPU_TOLERATION in pod["tolerations"] and SPOT_TOLERATION in pod["tolerations"]


async def test_a_job_that_changes_the_service_account_its_runtime_pins_fails_naming_both(cluster, operator):
    pinned = {**PLACEMENT, "podTemplate": {"spec": {"serviceAccountName": "trainer-bucket"}}}
    await cluster.apply(cluster_runtime(trainer=pinned, inference={**PLACEMENT, "gpusPerReplica": 0}))
    await cluster.apply(job_on_runtime(trainer={"podTemplate": {"spec": {"serviceAccountName": "admin"}}}))
    await wait_for(lambda: cluster.status("demo").get("phase") == "Failed", "Failed")
    message = cluster.condition("demo", names.INVALID_SPEC)["message"]
    assert "spec.trainer.podTemplate.spec.serviceAccountName" in message
    assert f"ClusterGRPOLoraRuntime {RUNTIME} pins the trainer pods' service account to trainer-bucket" in message
    assert trainer_pod(cluster) is None
