"""`grpolora validate --cluster` against the API emulator (grpolora/testing/kube_emulator.py), reached as a user
reaches a cluster: through a kubeconfig file read by the official `kubernetes` client.

The emulator serves what the checks read once the test declares it (nodes, CRDs, Deployments, RuntimeClasses are
no part of the operator's own resources), and refuses a service account's reads its RBAC does not allow (403), as
the API server's RBAC authorizer does."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
import yaml

from grpolora import __version__
from grpolora.api import constants as c
from grpolora.api.crd import CRD_FILES
from grpolora.cli import main
from tests.helpers import ROOT

pytest.importorskip("kubernetes", reason="the cluster extra (pip install 'grpo-lora-operator[cluster]')")
kmock = pytest.importorskip("kmock")

from grpolora.testing.kube_emulator import Cluster, running_cluster  # noqa: E402

# The cluster-scoped and apps resources `validate --cluster` reads, as the API server serves them.
SERVED = {
    "v1/nodes": ("Node", False),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False),
    "apps/v1/deployments": ("Deployment", True),
    "node.k8s.io/v1/runtimeclasses": ("RuntimeClass", False),
}
PATHS = {
    "Node": "/api/v1/nodes",
    "CustomResourceDefinition": "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
    "RuntimeClass": "/apis/node.k8s.io/v1/runtimeclasses",
}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}

JOB = f"""\
apiVersion: {c.API_VERSION}
kind: GRPOLoraJob
metadata: {{name: first, namespace: team-a}}
spec:
  model: {{name: Qwen/Qwen3-0.6B}}
  task: {{name: arithmetic}}
  trainer:
    nodeSelector: {{grpolora.dev/pool: trainer}}
    tolerations: [{{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}}]
    resources: {{requests: {{cpu: "8", memory: 64Gi}}}}
    env: [{{name: WANDB_API_KEY, valueFrom: {{secretKeyRef: {{name: wandb, key: key}}}}}}]
  inference:
    nodeSelector: {{grpolora.dev/pool: inference}}
    tolerations: [{{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}}]
    resources: {{requests: {{cpu: "8", memory: 48Gi}}}}
    podTemplate: {{spec: {{runtimeClassName: nvidia}}}}
  checkpoint: {{pvc: {{claimName: first-checkpoints}}}}
"""


def node(name: str, pool: str, gpus: int, *, taints: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    allocatable = {"cpu": "96", "memory": "1Ti"} | ({"nvidia.com/gpu": str(gpus)} if gpus else {})
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"grpolora.dev/pool": pool}},
        "spec": {"taints": taints or []},
        "status": {"allocatable": allocatable, "capacity": allocatable},
    }


def operator_deployment(version: str) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": c.OPERATOR_NAME}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": c.OPERATOR_NAME, "namespace": "grpo-lora-system",
                     "labels": labels | {"app.kubernetes.io/version": version}},
        "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels},
                 "spec": {"containers": [{"name": "operator", "image": f"operator:{version}"}]}}},
    }  # fmt: skip


def shipped_crd(kind: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "crds" / CRD_FILES[kind]).read_text())


async def create(cluster: Cluster, obj: dict[str, Any]) -> None:
    if obj["kind"] == "Deployment":
        path = f"/apis/apps/v1/namespaces/{obj['metadata']['namespace']}/deployments"
    elif obj["kind"] in ("Secret", "PersistentVolumeClaim"):
        path = f"/api/v1/namespaces/{obj['metadata']['namespace']}/{obj['kind'].lower()}s"
    else:
        path = PATHS[obj["kind"]]
    async with cluster.session.post(cluster.url + path, json=obj) as response:
        assert response.status < 300, await response.text()


async def ready_cluster(cluster: Cluster, *, crds: list[dict[str, Any]] | None = None) -> None:
    """A GPU cluster as the docs' *Before the first job* describes it, less what each test takes away."""
    for resource, (kind, namespaced) in SERVED.items():
        cluster.emulator.resources[resource] = kmock.ResourceInfo(kind=kind, namespaced=namespaced)
    for crd in crds if crds is not None else [shipped_crd(kind) for kind in c.CRD_KINDS]:
        await create(cluster, crd)
    await create(cluster, operator_deployment(__version__))
    await create(cluster, node("gpu-a", "trainer", 8, taints=[GPU_TAINT]))
    await create(cluster, node("gpu-b", "inference", 8, taints=[GPU_TAINT]))
    await create(cluster, node("system", "system", 0))
    await create(cluster, {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"},
                           "handler": "nvidia"})  # fmt: skip
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "wandb", "namespace": "team-a"}}
    await create(cluster, secret | {"data": {"key": "eA=="}})
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": "first-checkpoints", "namespace": "team-a"},
             "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}}}  # fmt: skip
    await create(cluster, claim)


def kubeconfig(
    tmp_path, cluster: Cluster, headers: dict[str, str] | None = None, *, namespace: str | None = None
) -> str:
    token = (headers or {}).get("Authorization", "Bearer user-token").removeprefix("Bearer ")
    context = {"cluster": "emulator", "user": "alice"} | ({"namespace": namespace} if namespace else {})
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": cluster.url}}],
        "users": [{"name": "alice", "user": {"token": token}}],
        "contexts": [{"name": "gpu-cluster", "context": context}],
        "current-context": "gpu-cluster",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return str(path)


async def validate(capsys, tmp_path, cluster: Cluster, job: str = JOB, *extra: str) -> tuple[int, str, str]:
    path = tmp_path / "job.yaml"
    path.write_text(job)
    argv = ["validate", "--cluster", "--kubeconfig", kubeconfig(tmp_path, cluster), *extra, str(path)]
    code = await asyncio.to_thread(main, argv)  # the emulator answers on this loop meanwhile
    out = capsys.readouterr()
    return code, out.out, out.err


async def test_a_ready_cluster_passes(tmp_path, capsys):
    async with running_cluster(authorize=None) as cluster:
        await ready_cluster(cluster)
        code, out, err = await validate(capsys, tmp_path, cluster)
    assert code == 0, err
    assert "GRPOLoraJob team-a/first is valid" in out
    assert "cluster (context gpu-cluster): the CRDs are installed and current" in out
    assert "warning" not in err, err


async def test_what_the_job_names_and_the_cluster_lacks_is_an_error_at_its_field(tmp_path, capsys):
    async with running_cluster(authorize=None) as cluster:
        await ready_cluster(cluster)
        job = JOB.replace("first-checkpoints", "first-ckpt").replace("name: wandb", "name: wandb-key")
        job = job.replace("runtimeClassName: nvidia", "runtimeClassName: nvidia-cdi")
        code, out, err = await validate(capsys, tmp_path, cluster, job)
    assert code == 1 and "is valid" not in out
    named = f"{tmp_path / 'job.yaml'}: GRPOLoraJob team-a/first"
    assert (
        f"{named}: spec.checkpoint.pvc.claimName: PersistentVolumeClaim team-a/first-ckpt does not exist in the "
        "cluster (context gpu-cluster)"
    ) in err
    assert f"{named}: spec.trainer.env[0].valueFrom.secretKeyRef.name: Secret team-a/wandb-key does not exist" in err
    assert f"{named}: spec.inference.podTemplate.spec.runtimeClassName: RuntimeClass nvidia-cdi does not exist" in err


async def test_gpu_resources_node_selectors_and_taints_are_warned_about(tmp_path, capsys):
    async with running_cluster(authorize=None) as cluster:
        await ready_cluster(cluster)
        job = JOB.replace("grpolora.dev/pool: inference}", "grpolora.dev/pool: serving}")  # no such node
        job = job.replace("  trainer:\n", "  trainer:\n    gpuResource: nvidia.com/mig-1g.10gb\n")
        code, _, err = await validate(capsys, tmp_path, cluster, job)
        assert code == 0, err  # an autoscaler may add such nodes: warned, not refused
        assert "warning: spec.inference.nodeSelector: no node has the labels {'grpolora.dev/pool': 'serving'}" in err
        assert (
            "warning: spec.trainer.gpuResource: the nodes it may use offer no nvidia.com/mig-1g.10gb (allocatable): "
            "the device plugin for it is missing"
        ) in err
        untolerated = JOB.replace("    tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]\n",
                                  "", 1)  # fmt: skip
        code, _, err = await validate(capsys, tmp_path, cluster, untolerated, "--strict")
    assert code == 1
    assert (
        "warning: spec.trainer.tolerations: every node the role may use is tainted (nvidia.com/gpu=present:NoSchedule)"
    ) in err


async def test_a_missing_or_older_crd_and_a_missing_operator_are_named(tmp_path, capsys):
    older = copy.deepcopy(shipped_crd(c.KIND))
    spec = older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    del spec["trainer"]["properties"]["gpuResource"]
    async with running_cluster(authorize=None) as cluster:
        await ready_cluster(cluster, crds=[older, shipped_crd(c.POOL_KIND), shipped_crd(c.RUNTIME_KIND)])
        await cluster.session.delete(
            cluster.url + f"/apis/apps/v1/namespaces/grpo-lora-system/deployments/{c.OPERATOR_NAME}"
        )
        code, _, err = await validate(capsys, tmp_path, cluster)
    assert code == 1
    where = "cluster (context gpu-cluster)"
    assert (
        f"{where}: CustomResourceDefinition {c.CLUSTER_RUNTIME_CRD_NAME} is not installed: install the chart"
    ) in err
    assert (
        f"{where}: CustomResourceDefinition {c.CRD_NAME} is older than grpolora {__version__}: it lacks "
        "spec.trainer.gpuResource, which the API server would drop"
    ) in err
    assert f"{where}: warning: no operator Deployment (label app.kubernetes.io/name={c.OPERATOR_NAME})" in err


async def test_what_the_users_rbac_does_not_let_it_read_is_not_checked(tmp_path, capsys):
    async with running_cluster(authorize=None) as cluster:
        await ready_cluster(cluster)
        # A namespace's user: may read claims and Secrets of team-a, not nodes, CRDs or other namespaces' Deployments.
        headers = cluster.service_account("team-a", "alice", lambda verb, group, resource: resource in (
            "persistentvolumeclaims", "secrets", "runtimeclasses"))  # fmt: skip
        path = tmp_path / "job.yaml"
        path.write_text(JOB)
        argv = ["validate", "--cluster", "--kubeconfig", kubeconfig(tmp_path, cluster, headers), str(path)]
        code = await asyncio.to_thread(main, argv)
        err = capsys.readouterr().err
    assert code == 0, err
    assert "not checked here: spec: the nodes (listing nodes is not allowed)" in err
    assert "not checked here: the CRDs (listing customresourcedefinitions is not allowed)" in err


async def test_a_job_without_a_namespace_is_checked_where_kubectl_would_apply_it(tmp_path, capsys):
    """kubectl apply puts an object without metadata.namespace in --namespace, else in the kubeconfig context's
    namespace, else in `default`; and refuses an object whose metadata.namespace differs from --namespace ("the
    namespace from the provided object ... does not match the namespace ...", kubectl's apply/resource builder).
    The check reads the claim and Secret there, not in `default`."""
    unplaced = JOB.replace("metadata: {name: first, namespace: team-a}", "metadata: {name: first}")
    path = tmp_path / "job.yaml"
    path.write_text(unplaced)
    async with running_cluster(authorize=None) as cluster:
        await ready_cluster(cluster)
        in_context = kubeconfig(tmp_path, cluster, namespace="team-a")
        code = await asyncio.to_thread(main, ["validate", "--cluster", "--kubeconfig", in_context, str(path)])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert "GRPOLoraJob team-a/first is valid" in out
        argv = ["validate", "--cluster", "--kubeconfig", kubeconfig(tmp_path, cluster), str(path)]
        code = await asyncio.to_thread(main, [*argv, "-n", "team-a"])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert "GRPOLoraJob team-a/first is valid" in out
        code = await asyncio.to_thread(main, argv)
        out, err = capsys.readouterr()
        assert code == 1  # in `default`, where neither the claim nor the Secret is
        assert "PersistentVolumeClaim default/first-checkpoints does not exist" in err
        path.write_text(JOB)
        code = await asyncio.to_thread(main, [*argv, "-n", "team-b"])
        out, err = capsys.readouterr()
    assert code == 1 and "is valid" not in out
    assert (
        'metadata.namespace: the namespace from the provided object "team-a" does not match the namespace "team-b" '
        "given with --namespace (kubectl apply refuses it)"
    ) in err


def test_a_kubeconfig_that_cannot_be_read_is_named(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(JOB)
    with pytest.raises(SystemExit) as refused:
        main(["validate", "--cluster", "--kubeconfig", str(tmp_path / "missing"), str(path)])
    assert f"grpolora validate --cluster: kubeconfig {tmp_path / 'missing'}:" in str(refused.value)
