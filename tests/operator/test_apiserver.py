"""The emulator refuses what a real API server refuses (grpolora.testing.kube_apiserver), so the tests see it."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import aiohttp
import pytest

from grpolora.api.load import parse_job
from grpolora.api.plan import plan
from grpolora.operator.builders import build_children
from grpolora.testing.kube_emulator import CRD_RESOURCE, NAMESPACE, Cluster, running_cluster
from tests.helpers import job_doc
from tests.operator.harness import wait_for

OWNER_UID = "00000000-0000-0000-0000-000000000001"


def rendered(kind: str, **spec: Any) -> dict[str, Any]:
    objects = build_children(plan(parse_job(job_doc(**spec))), owner_uid=OWNER_UID, token="t")
    return next(o for o in objects if o["kind"] == kind)


async def send(cluster: Cluster, method: str, path: str, body: Any, *, agent: str = "grpo-lora-operator/x") -> Any:
    """A request as the operator would send it (not as the test), so that admission checks its RBAC."""
    async with (
        aiohttp.ClientSession(headers={"User-Agent": agent}) as session,
        session.request(method, cluster.url + path, json=body) as response,
    ):
        return response.status, await response.json(content_type=None)


JOBS = f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs"


async def test_a_toleration_the_api_server_refuses_in_code_is_422_with_its_message():
    job = rendered("Job", trainer={"tolerations": [{"key": "gpu", "operator": "Exists", "value": "yes"}]})
    async with running_cluster(authorize=None) as cluster:
        status, body = await send(cluster, "POST", JOBS + "?fieldValidation=Strict", job)
    assert status == 422 and body["reason"] == "Invalid"
    assert body["message"] == (
        'Job.batch "demo-trainer" is invalid: spec.template.spec.tolerations[0].operator: Invalid value: "yes": '
        "value must be empty when `operator` is 'Exists'"
    )


async def test_unknown_fields_are_refused_under_strict_field_validation_only():
    job = rendered("Job")
    job["spec"]["template"]["spec"]["tolerations"] = [{"key": "gpu", "operator": "Exists", "efect": "NoSchedule"}]
    async with running_cluster(authorize=None) as cluster:
        status, body = await send(cluster, "POST", JOBS + "?fieldValidation=Strict", copy.deepcopy(job))
        assert status == 400
        assert body["message"] == 'strict decoding error: unknown field "spec.template.spec.tolerations[0].efect"'
        status, _ = await send(cluster, "POST", JOBS, job)
        assert status < 300


async def test_a_wrongly_typed_field_of_a_built_in_kind_is_refused():
    job = rendered("Job")
    job["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"cpu": ["2"]}}
    async with running_cluster(authorize=None) as cluster:
        status, body = await send(cluster, "POST", JOBS, job)
    assert status == 400 and "spec.template.spec.containers[0].resources.limits.cpu" in body["message"]


async def test_grpolorajobs_are_validated_against_the_crd_schema():
    async with running_cluster() as cluster:
        with pytest.raises(AssertionError, match=r'unknown field \\"spec.lora.rnk\\"|unknown field "spec.lora.rnk"'):
            await cluster.apply(job_doc(lora={"rnk": 8}))
        with pytest.raises(AssertionError, match=r"422.*spec.grpo.generationsPerPrompt: Invalid value: 1"):
            await cluster.apply(job_doc(grpo={"generationsPerPrompt": 1}))
        # Without strict field validation, unknown fields are pruned (what a real server does).
        path = f"/apis/grpolora.dev/v1alpha1/namespaces/{NAMESPACE}/grpolorajobs"
        stored = await cluster._call("POST", path, job_doc(lora={"rnk": 8}))
        # Pruned, then defaulted as the API server does: the CRD's defaults are written, the unknown field is gone.
        assert "rnk" not in stored["spec"]["lora"] and stored["spec"]["lora"]["rank"] == 16


async def test_block_owner_deletion_needs_update_on_the_owners_finalizers():
    job = rendered("Job")
    async with running_cluster(authorize=lambda verb, group, resource: resource != "grpolorajobs/finalizers") as c:
        status, body = await send(c, "POST", JOBS, copy.deepcopy(job))
        assert status == 403 and body["reason"] == "Forbidden"
        assert "cannot set blockOwnerDeletion" in body["message"] and "grpolorajobs/finalizers" in body["message"]
        assert ("update", "grpolora.dev", "grpolorajobs/finalizers") in c.emulator.calls
        job["metadata"]["ownerReferences"][0]["blockOwnerDeletion"] = False
        status, _ = await send(c, "POST", JOBS, job)
        assert status < 300


async def test_garbage_collection_takes_a_moment_and_removes_orphans():
    async with running_cluster() as cluster:
        owner = await cluster.apply(job_doc())
        job = rendered("Job")
        job["metadata"]["ownerReferences"][0]["uid"] = owner["metadata"]["uid"]
        await cluster._call("POST", JOBS, job)
        await cluster.delete_job("demo")
        assert cluster.get("batch/v1/jobs", "demo-trainer") is not None, "collected at once"
        await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer") is None, "the collector")


async def test_the_crds_cel_rules_are_evaluated_at_admission():
    async with running_cluster() as cluster:
        with pytest.raises(AssertionError, match=r"422.*spec.inference.tensorParallelSize: .*must equal"):
            await cluster.apply(job_doc(inference={"gpusPerReplica": 4, "tensorParallelSize": 3}))
        long_name = job_doc()
        long_name["metadata"]["name"] = "a" * 60
        with pytest.raises(AssertionError, match=r"422.*metadata.name may have at most"):
            await cluster.apply(long_name)


async def test_spec_changes_are_refused_at_admission_once_the_children_exist():
    async with running_cluster() as cluster:
        await cluster.apply(job_doc())
        await cluster.patch_spec("demo", {"grpo": {"steps": 7}})  # no children yet: any valid change applies
        path = f"/apis/grpolora.dev/v1alpha1/namespaces/{NAMESPACE}/grpolorajobs/demo/status"
        created = {"type": "Created", "status": "True", "reason": "ChildrenCreated", "message": "",
                   "lastTransitionTime": "2026-01-01T00:00:00Z"}  # fmt: skip
        await cluster._call("PATCH", path, {"status": {"conditions": [created]}})
        with pytest.raises(AssertionError, match=r"422.*only spec.suspend and spec.ttlSecondsAfterFinished can change"):
            await cluster.patch_spec("demo", {"grpo": {"steps": 8}})
        await cluster.patch_spec("demo", {"suspend": True})
        assert cluster.job("demo")["spec"]["suspend"] is True and cluster.job("demo")["spec"]["grpo"]["steps"] == 7


async def test_foreground_deletion_keeps_the_owner_until_its_blocking_dependents_and_their_pods_are_gone():
    """kubectl delete --cascade=foreground, as the API server, the garbage collector and the kubelet play it:
    staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go (the foregroundDeletion finalizer and the
    deletionTimestamp), pkg/controller/garbagecollector/garbagecollector.go (attemptToDeleteItem: a dependent with
    dependents of its own, whose owner waits, is deleted in the foreground too; processDeletingDependentsItem: the
    finalizer goes once no blocking dependent is left), pkg/registry/core/pod/strategy.go (a bound pod is deleted
    gracefully and stays Terminating until the kubelet removes it), and the docs page "Use Cascading Deletion"."""
    async with running_cluster() as cluster:
        cluster.emulator.pod_exit_seconds = None  # the containers ignore SIGTERM: Terminating for the whole grace
        owner = await cluster.apply(job_doc())
        job = rendered("Job")
        job["metadata"]["ownerReferences"][0]["uid"] = owner["metadata"]["uid"]
        await cluster._call("POST", JOBS, job)
        bound = await cluster.run_pod_of("batch/v1/jobs", "demo-trainer")
        await cluster.delete_job("demo", cascade="Foreground")
        marked = cluster.job("demo")["metadata"]
        assert marked["deletionTimestamp"] and marked["finalizers"] == ["foregroundDeletion"]
        # The trainer Job has a dependent (its pod): the collector deletes it in the foreground as well.
        await wait_for(lambda: (cluster.get("batch/v1/jobs", "demo-trainer") or {}).get("metadata", {}).get(
            "deletionTimestamp"), "the trainer Job marked")  # fmt: skip
        trainer_job = cluster.get("batch/v1/jobs", "demo-trainer")
        assert trainer_job["metadata"]["finalizers"] == ["foregroundDeletion"]
        await wait_for(lambda: (cluster.get("v1/pods", bound) or {}).get("metadata", {}).get("deletionTimestamp"),
                       "the pod Terminating")  # fmt: skip
        pod = cluster.get("v1/pods", bound)
        assert pod["metadata"]["deletionGracePeriodSeconds"] == 30, "the default terminationGracePeriodSeconds"
        # Several sweeps later, the Terminating pod still holds its Job, and the Job the GRPOLoraJob.
        sweeps = 5
        await asyncio.sleep(sweeps * cluster.emulator.gc_delay)
        assert cluster.get("v1/pods", bound) is not None
        assert cluster.get("batch/v1/jobs", "demo-trainer") is not None and cluster.job("demo") is not None
        await cluster.emulator.end_grace_periods()
        assert cluster.get("v1/pods", bound) is None
        await wait_for(lambda: cluster.get(CRD_RESOURCE, "demo") is None, "the GRPOLoraJob removed")
        assert cluster.get("batch/v1/jobs", "demo-trainer") is None


async def test_a_pod_not_bound_to_a_node_is_removed_at_once_and_a_bound_one_after_its_containers_exit():
    async with running_cluster() as cluster:
        owner = await cluster.apply(job_doc())
        job = rendered("Job")
        job["metadata"]["ownerReferences"][0]["uid"] = owner["metadata"]["uid"]
        await cluster._call("POST", JOBS, job)
        bound = await cluster.run_pod_of("batch/v1/jobs", "demo-trainer")
        pods = f"/api/v1/namespaces/{NAMESPACE}/pods"
        await cluster._call("POST", pods, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "unbound"},
                                           "spec": {"containers": [{"name": "main", "image": "x"}]}})  # fmt: skip
        await cluster._call("DELETE", f"{pods}/unbound")
        assert cluster.get("v1/pods", "unbound") is None
        await cluster._call("DELETE", f"{pods}/{bound}")
        assert cluster.get("v1/pods", bound)["metadata"]["deletionTimestamp"]
        await wait_for(lambda: cluster.get("v1/pods", bound) is None, "the kubelet to remove the pod")


async def test_an_owner_in_another_namespace_counts_as_absent():
    """The docs page "Garbage Collection": a namespaced owner must be in the dependent's namespace, else the
    reference is treated as absent and the dependent collected."""
    async with running_cluster() as cluster:
        owner = await cluster.apply(job_doc())
        job = rendered("Job")
        job["metadata"].update(namespace="team-b")
        job["metadata"]["ownerReferences"][0]["uid"] = owner["metadata"]["uid"]
        await cluster._call("POST", "/apis/batch/v1/namespaces/team-b/jobs", job)
        await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer", "team-b") is None, "the collector")
        assert cluster.job("demo") is not None


async def test_a_pools_scale_subresource_reads_and_writes_its_replicas_as_kubectl_scale_does():
    """`kubectl scale rolloutpool/shared --replicas=3` GETs and PATCHes .../rolloutpools/shared/scale: an
    autoscaling/v1 Scale whose spec.replicas is the CRD's specReplicasPath and status.replicas its
    statusReplicasPath (apiextensions-apiserver's scale subresource). The write goes through the CRD's rules: a
    replica count below the schema's minimum is refused."""
    from grpolora.api import constants as c

    pool = {
        "apiVersion": f"{c.GROUP}/{c.VERSION}",
        "kind": c.POOL_KIND,
        "metadata": {"name": "shared", "namespace": NAMESPACE},
        "spec": {"model": {"name": "Qwen/Qwen3-0.6B"}, "replicas": 1},
    }
    path = f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{NAMESPACE}/{c.POOL_PLURAL}/shared"
    async with running_cluster() as cluster:
        await cluster.apply(pool)
        await cluster.set_status(f"{c.GROUP}/{c.VERSION}/{c.POOL_PLURAL}", "shared", {"replicas": {"ready": 1}})
        status, scale = await send(cluster, "GET", f"{path}/scale", None)
        assert status == 200 and (scale["apiVersion"], scale["kind"]) == ("autoscaling/v1", "Scale")
        assert (scale["metadata"]["name"], scale["spec"], scale["status"]["replicas"]) == ("shared", {"replicas": 1}, 1)
        before = cluster.get(f"{c.GROUP}/{c.VERSION}/{c.POOL_PLURAL}", "shared")
        generation = before["metadata"]["generation"]

        status, scale = await send(cluster, "PATCH", f"{path}/scale", {"spec": {"replicas": 3}})
        assert status == 200 and scale["spec"] == {"replicas": 3}
        stored = cluster.get(f"{c.GROUP}/{c.VERSION}/{c.POOL_PLURAL}", "shared")
        assert stored["spec"]["replicas"] == 3 and stored["metadata"]["generation"] == generation + 1
        assert stored["spec"]["model"] == before["spec"]["model"], "only the replicas written"

        status, refused = await send(cluster, "PATCH", f"{path}/scale", {"spec": {"replicas": 0}})
        assert status == 422 and "spec.replicas" in refused["message"]
        assert cluster.get(f"{c.GROUP}/{c.VERSION}/{c.POOL_PLURAL}", "shared")["spec"]["replicas"] == 3


async def test_a_secrets_string_data_is_stored_as_data_and_never_read_back():
    """stringData is write-only: the API server decodes a v1 Secret into its internal form by merging stringData
    into data, base64 on the wire, stringData's keys winning (Kubernetes pkg/apis/core/v1/conversion.go,
    Convert_v1_Secret_To_core_Secret; v1.33), on a create and on a patch alike. A client that read stringData back
    from the emulator read what a real API server never returns (the operator reads the job's token from data)."""
    secrets = f"/api/v1/namespaces/{NAMESPACE}/secrets"
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "type": "Opaque"}
    secret |= {"data": {"a": "b2xk", "b": "Yg=="}, "stringData": {"a": "new", "c": "c"}}
    async with running_cluster(authorize=None) as cluster:
        status, _ = await send(cluster, "POST", secrets, secret)
        assert status < 300
        stored = cluster.get("v1/secrets", "s")
        assert "stringData" not in stored and stored["data"] == {"a": "bmV3", "b": "Yg==", "c": "Yw=="}
        status, body = await send(cluster, "PATCH", f"{secrets}/s", {"stringData": {"d": "d"}})
        assert status < 300 and "stringData" not in body
        stored = cluster.get("v1/secrets", "s")
        assert "stringData" not in stored and stored["data"] == {"a": "bmV3", "b": "Yg==", "c": "Yw==", "d": "ZA=="}
