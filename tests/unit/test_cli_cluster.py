"""`grpolora validate --cluster` against the API emulator (grpolora/testing/kube_emulator.py), reached as a user
reaches a cluster: through a kubeconfig file read by the official `kubernetes` client.

The emulator serves what the checks read once the test declares it (nodes, CRDs, Deployments, RuntimeClasses are
no part of the operator's own resources), and refuses a service account's reads its RBAC does not allow (403), as
the API server's RBAC authorizer does."""

from __future__ import annotations

import asyncio
import copy
import http.server
import importlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from grpolora import __version__
from grpolora.api import constants as c
from grpolora.api.crd import CRD_FILES
from grpolora.cli import main
from grpolora.testing.servers import free_port
from tests.helpers import ROOT

pytest.importorskip("kubernetes", reason="the cluster extra (pip install 'grpo-lora-operator[cluster]')")
kmock = pytest.importorskip("kmock")

from grpolora.testing.kube_emulator import Cluster, running_cluster  # noqa: E402


@pytest.fixture(autouse=True)
def namespaces_routed(monkeypatch):
    """Namespaces at the API server's paths: /api/v1/namespaces and /api/v1/namespaces/{name} are the cluster-scoped
    `namespaces` resource (k8s.io/apiserver's installer routes a cluster-scoped resource so). kmock 0.8's
    parse_path takes the segment after `namespaces` for a namespace in every path, and cannot serve them."""
    parsing = importlib.import_module("kmock._internal.parsing")
    original = parsing.parse_path

    def parse_path(path: str) -> Any:
        parts = path.split("?", 1)[0].strip("/").split("/")
        if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
            return parsing.ParsedPath("", "v1", "namespaces", None, parts[3] if len(parts) == 4 else None, None)
        return original(path)

    monkeypatch.setattr(parsing, "parse_path", parse_path)


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


def operator_deployment(version: str, args: tuple[str, ...] = ("--all-namespaces",)) -> dict[str, Any]:
    """The chart's Deployment (templates/deployment.yaml): `operator`, then `--all-namespaces` or a `--namespace NS`
    pair per watch.namespaces entry."""
    labels = {"app.kubernetes.io/name": c.OPERATOR_NAME}
    container = {"name": "operator", "image": f"operator:{version}", "args": ["operator", *args, "--metrics-port",
                                                                              "9090"]}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": c.OPERATOR_NAME, "namespace": "grpo-lora-system",
                     "labels": labels | {"app.kubernetes.io/version": version}},
        "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels},
                 "spec": {"containers": [container]}}},
    }  # fmt: skip


def shipped_crd(kind: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "crds" / CRD_FILES[kind]).read_text())


async def create(cluster: Cluster, obj: dict[str, Any]) -> None:
    if obj["kind"] == "Deployment":
        path = f"/apis/apps/v1/namespaces/{obj['metadata']['namespace']}/deployments"
    elif obj["kind"] == "Namespace":
        path = "/api/v1/namespaces"
    elif obj["kind"] in c.CRD_KINDS:
        await cluster.apply(obj)
        return
    elif obj["kind"] in ("Secret", "PersistentVolumeClaim"):
        path = f"/api/v1/namespaces/{obj['metadata']['namespace']}/{obj['kind'].lower()}s"
    else:
        path = PATHS[obj["kind"]]
    async with cluster.session.post(cluster.url + path, json=obj) as response:
        assert response.status < 300, await response.text()


async def ready_cluster(
    cluster: Cluster, *, crds: list[dict[str, Any]] | None = None, watched: tuple[str, ...] = ("--all-namespaces",)
) -> None:
    """A GPU cluster as the docs' *Before the first job* describes it, less what each test takes away."""
    for resource, (kind, namespaced) in SERVED.items():
        cluster.emulator.resources[resource] = kmock.ResourceInfo(kind=kind, namespaced=namespaced)
    # The official client's VersionApi asks for /version/, which the API server serves as /version; kmock only the
    # latter.
    cluster.emulator.fallback["get /version/"] << cluster.emulator._serve_server_version
    for crd in crds if crds is not None else [shipped_crd(kind) for kind in c.CRD_KINDS]:
        await create(cluster, crd)
    await create(cluster, operator_deployment(__version__, watched))
    await create(cluster, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}})
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
        f"{named}: line 17: spec.checkpoint.pvc.claimName: PersistentVolumeClaim team-a/first-ckpt does not exist in "
        "the cluster (context gpu-cluster)"
    ) in err
    assert (
        f"{named}: line 11: spec.trainer.env[0].valueFrom.secretKeyRef.name: Secret team-a/wandb-key does not exist"
    ) in err
    assert (
        f"{named}: line 16: spec.inference.podTemplate.spec.runtimeClassName: RuntimeClass nvidia-cdi does not exist"
    ) in err
    lines = [int(line.split(": line ")[1].split(":")[0]) for line in err.splitlines() if ": line " in line]
    assert lines == sorted(lines), err  # in line order


async def test_gpu_resources_node_selectors_and_taints_are_warned_about(tmp_path, capsys):
    async with running_cluster(authorize=None) as cluster:
        await ready_cluster(cluster)
        job = JOB.replace("grpolora.dev/pool: inference}", "grpolora.dev/pool: serving}")  # no such node
        job = job.replace("  trainer:\n", "  trainer:\n    gpuResource: nvidia.com/mig-1g.10gb\n")
        code, _, err = await validate(capsys, tmp_path, cluster, job)
        assert code == 0, err  # an autoscaler may add such nodes: warned, not refused
        assert (
            "warning: line 14: spec.inference.nodeSelector: no node has the labels {'grpolora.dev/pool': 'serving'}"
        ) in err
        assert (
            "warning: line 8: spec.trainer.gpuResource: the nodes it may use offer no nvidia.com/mig-1g.10gb "
            "(allocatable): the device plugin for it is missing"
        ) in err
        untolerated = JOB.replace("    tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]\n",
                                  "", 1)  # fmt: skip
        code, _, err = await validate(capsys, tmp_path, cluster, untolerated, "--strict")
    assert code == 1
    assert (
        "warning: line 8: spec.trainer.tolerations: every node the role may use is tainted "
        "(nvidia.com/gpu=present:NoSchedule)"
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
    assert "not checked here: line 5: spec: the nodes (listing nodes is not allowed)" in err
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


# ---- an API server that cannot be used: one line naming the server and what to fix, the file's own result kept --


def plain_kubeconfig(tmp_path, server: str) -> str:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "far", "cluster": {"server": server}}],
        "users": [{"name": "alice", "user": {"token": "expired-token"}}],
        "contexts": [{"name": "far-cluster", "context": {"cluster": "far", "user": "alice"}}],
        "current-context": "far-cluster",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def run_against(tmp_path, capsys, server: str, *extra: str) -> tuple[int, str, str]:
    path = tmp_path / "job.yaml"
    path.write_text(JOB)
    code = main(["validate", "--cluster", "--kubeconfig", plain_kubeconfig(tmp_path, server), *extra, str(path)])
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_offline_result_kept(out: str, err: str) -> None:
    assert "Traceback" not in err and "urllib3" not in err, err
    assert "GRPOLoraJob team-a/first is valid" not in out  # the cluster part was not checked
    assert "GRPOLoraJob team-a/first: valid as a file; not checked against the cluster" in out
    assert len(err.strip().splitlines()) <= 3, err


def test_an_api_server_that_refuses_connections_is_one_line(tmp_path, capsys):
    server = f"https://127.0.0.1:{free_port()}"  # nothing listens there
    code, out, err = run_against(tmp_path, capsys, server)
    assert code == 1
    assert f"cannot reach the API server at {server} (context far-cluster): connection refused" in err
    assert "kubectl cluster-info" in err
    assert_offline_result_kept(out, err)
    code, out, _ = run_against(tmp_path, capsys, server, "-o", "json")
    report = json.loads(out)
    assert code == 1 and report["valid"] is False
    assert report["cluster"]["error"].startswith(f"cannot reach the API server at {server}")
    assert report["items"][0]["valid"] is True and report["items"][0]["clusterChecked"] is False


def test_an_api_server_that_never_answers_times_out(tmp_path, capsys):
    # A listening socket nobody accepts from: the kernel completes the connection, no answer ever comes (what a
    # black-holed endpoint does once connected); --request-timeout bounds each request, as kubectl's does.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        server = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        code, out, err = run_against(tmp_path, capsys, server, "--request-timeout", "1")
        took = time.monotonic() - started
    assert code == 1
    assert f"the API server at {server} (context far-cluster) did not answer within 1 s" in err
    assert took < 8, took  # one request and no retries: not urllib3's three
    assert_offline_result_kept(out, err)


class _Refusing(http.server.BaseHTTPRequestHandler):
    """Answers every request with one status, as the API server (a Status object) or a stray web server does."""

    status = 401
    body: bytes = b""

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json" if self.body.startswith(b"{") else "text/plain")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *_: object) -> None:
        pass


def _status(code: int, reason: str, message: str) -> bytes:
    return json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
                       "reason": reason, "code": code}).encode()  # fmt: skip


@pytest.fixture
def refusing() -> Iterator[Any]:
    servers = []

    def start(status: int, body: bytes) -> str:
        handler = type("Handler", (_Refusing,), {"status": status, "body": body})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()


@pytest.mark.parametrize(
    ("status", "body", "words"),
    [
        # kube-apiserver's authentication filter: an expired or unknown token is 401 on every path.
        (401, _status(401, "Unauthorized", "Unauthorized"), "refused the credentials of context far-cluster (401 "
         "Unauthorized): the token or client certificate is expired or wrong; log in again"),
        # a user with no rights at all, not even system:public-info-viewer's GET /version.
        (403, _status(403, "Forbidden", 'forbidden: User "alice" cannot get path "/version"'),
         "refused every request of context far-cluster (403 Forbidden: forbidden: User \"alice\" cannot get path"),
        # a server URL that is not an API server (a proxy, a dashboard, a wrong path): Go's mux answers so.
        (404, b"404 page not found\n", "answered 404 Not Found to /version: not a Kubernetes API server; check the "
         "server URL of context far-cluster"),
    ],
)  # fmt: skip
def test_401_403_and_404_are_each_one_line_saying_what_to_fix(tmp_path, capsys, refusing, status, body, words):
    server = refusing(status, body)
    code, out, err = run_against(tmp_path, capsys, server)
    assert code == 1
    assert f"grpolora validate --cluster: the API server at {server} {words}" in err
    assert_offline_result_kept(out, err)


def test_a_kubeconfig_that_cannot_be_read_keeps_the_files_own_result(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(JOB)
    code = main(["validate", "--cluster", "--kubeconfig", str(tmp_path / "missing"), str(path)])
    out, err = capsys.readouterr()
    assert code == 1
    assert f"grpolora validate --cluster: kubeconfig {tmp_path / 'missing'}: no such file (give --kubeconfig" in err
    assert_offline_result_kept(out, err)


# ---- what the job needs, read as the cluster holds it ---------------------------------------------------------

RUNTIME = f"""\
apiVersion: {c.API_VERSION}
kind: ClusterGRPOLoraRuntime
metadata: {{name: a100}}
spec:
  trainer:
    nodeSelector: {{grpolora.dev/pool: trainer}}
    tolerations: [{{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}}]
    resources: {{requests: {{cpu: "8", memory: 64Gi}}}}
  inference:
    nodeSelector: {{grpolora.dev/pool: inference}}
    tolerations: [{{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}}]
    resources: {{requests: {{cpu: "8", memory: 48Gi}}}}
"""
ON_RUNTIME = f"""\
apiVersion: {c.API_VERSION}
kind: GRPOLoraJob
metadata: {{name: tenant, namespace: team-a}}
spec:
  runtimeRef: {{kind: ClusterGRPOLoraRuntime, name: a100}}
  model: {{name: Qwen/Qwen3-0.6B}}
  task: {{name: arithmetic}}
  checkpoint: {{pvc: {{claimName: first-checkpoints}}}}
"""


async def test_a_tenants_job_is_merged_with_its_runtime_read_from_the_cluster(tmp_path, capsys):
    async with running_cluster(authorize=None) as cluster:
        await ready_cluster(cluster)
        await create(cluster, yaml.safe_load(RUNTIME))
        code, out, err = await validate(capsys, tmp_path, cluster, ON_RUNTIME)
        assert code == 0, err
        assert "GRPOLoraJob team-a/tenant is valid" in out
        # Merged: the runtime's requests and placement, so no BestEffort or placement warning on the bare job.
        assert "BestEffort" not in err and "warning: spec.trainer" not in err, err
        assert "not checked here: spec.runtimeRef" not in err
        # A namespace's own GRPOLoraRuntime, read from the job's namespace.
        namespaced = yaml.safe_load(RUNTIME) | {"kind": c.RUNTIME_KIND, "metadata": {"name": "small",
                                                                                    "namespace": "team-a"}}
        await create(cluster, namespaced)
        on_own = ON_RUNTIME.replace("{kind: ClusterGRPOLoraRuntime, name: a100}", f"{{kind: {c.RUNTIME_KIND}, "
                                    "name: small}")
        code, out, err = await validate(capsys, tmp_path, cluster, on_own)
        assert code == 0 and "GRPOLoraJob team-a/tenant is valid" in out, err
        assert "BestEffort" not in err
        code, out, err = await validate(capsys, tmp_path, cluster, ON_RUNTIME.replace("name: a100}", "name: h100}"))
    assert code == 1 and "is valid" not in out
    assert (
        "spec.runtimeRef.name: ClusterGRPOLoraRuntime h100 does not exist in the cluster (context gpu-cluster): the "
        "job would wait for it"
    ) in err


async def test_objects_the_same_file_creates_are_not_missing(tmp_path, capsys):
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": "first-ckpt", "namespace": "team-a"},
             "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}}}  # fmt: skip
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "wandb-key"}, "stringData": {"key": "x"}}
    job = JOB.replace("first-checkpoints", "first-ckpt").replace("name: wandb", "name: wandb-key")
    text = "\n---\n".join([yaml.safe_dump(claim), yaml.safe_dump(secret), job])  # the Secret: no namespace, -n's
    async with running_cluster(authorize=None) as cluster:
        await ready_cluster(cluster)
        code, out, err = await validate(capsys, tmp_path, cluster, text, "-n", "team-a")
    assert code == 0, err
    assert "does not exist" not in err
    assert "GRPOLoraJob team-a/first is valid" in out


async def test_the_namespace_must_exist_and_be_watched_by_the_operator(tmp_path, capsys):
    async with running_cluster(authorize=None) as cluster:
        await ready_cluster(cluster, watched=("--namespace", "team-b", "--namespace", "team-c"))
        code, out, err = await validate(capsys, tmp_path, cluster)
        assert code == 1 and "is valid" not in out
        assert (
            "metadata.namespace: the operator grpo-lora-system/grpo-lora-operator watches namespaces team-b, team-c, "
            "not team-a: it would never run the job; add team-a to the chart's watch.namespaces"
        ) in err
        code, out, err = await validate(capsys, tmp_path, cluster, JOB.replace("team-a", "team-z"))
    assert code == 1
    assert "metadata.namespace: Namespace team-z does not exist in the cluster (context gpu-cluster)" in err


POOL = f"""\
apiVersion: {c.API_VERSION}
kind: RolloutPool
metadata: {{name: shared, namespace: team-a}}
spec:
  model: {{name: Qwen/Qwen3-0.6B, tokenFrom: {{secretName: hub-token}}}}
  maxLoraRank: 8
  nodeSelector: {{grpolora.dev/pool: inference}}
  tolerations: [{{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}}]
  resources: {{requests: {{cpu: "8", memory: 48Gi}}}}
"""


async def test_rollout_pools_are_checked_and_a_jobs_pool_is_read_from_the_cluster(tmp_path, capsys):
    start, end = JOB.index("  inference:\n"), JOB.index("  checkpoint:")
    on_pool = JOB[:start] + "  inference: {poolRef: {name: shared}}\n" + JOB[end:]
    async with running_cluster(authorize=None) as cluster:
        await ready_cluster(cluster)
        code, out, err = await validate(capsys, tmp_path, cluster, POOL)
        assert code == 1 and "is valid" not in out
        assert (
            "RolloutPool team-a/shared: line 5: spec.model.tokenFrom.secretName: Secret team-a/hub-token does not exist"
        ) in err
        code, out, err = await validate(capsys, tmp_path, cluster, on_pool)
        assert code == 1
        assert "spec.inference.poolRef.name: RolloutPool team-a/shared does not exist in the cluster" in err
        await create(cluster, yaml.safe_load(POOL))
        ranked = on_pool.replace("  task:", "  lora: {rank: 32}\n  task:")
        code, out, err = await validate(capsys, tmp_path, cluster, ranked)
    assert code == 1  # read from the cluster, the pool's maxLoraRank refuses the job's rank
    assert "spec.lora.rank: 32 is above RolloutPool shared's maxLoraRank (8)" in err, err
    assert "not checked here: spec.inference.poolRef" not in err


async def test_a_missing_toleration_is_not_taken_for_a_missing_device_plugin(tmp_path, capsys):
    bare = JOB.replace("    nodeSelector: {grpolora.dev/pool: trainer}\n", "").replace(
        "    tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]\n", "", 1
    )
    async with running_cluster(authorize=None) as cluster:
        await ready_cluster(cluster)  # the GPU nodes are tainted; the CPU node "system" is not
        code, _, err = await validate(capsys, tmp_path, cluster, bare)
    assert code == 0, err
    assert "device plugin" not in err, err
    assert (
        "warning: line 8: spec.trainer.tolerations: the nodes that offer nvidia.com/gpu are tainted "
        "(nvidia.com/gpu=present:NoSchedule) and the role tolerates none of them: add a toleration"
    ) in err


async def test_strict_fails_on_the_clusters_warnings(tmp_path, capsys):
    async with running_cluster(authorize=None) as cluster:
        await ready_cluster(cluster)
        await cluster.session.delete(
            cluster.url + f"/apis/apps/v1/namespaces/grpo-lora-system/deployments/{c.OPERATOR_NAME}"
        )
        code, _, err = await validate(capsys, tmp_path, cluster, JOB)
        assert code == 0, err
        assert "warning: no operator Deployment" in err
        code, _, err = await validate(capsys, tmp_path, cluster, JOB, "--strict")
    assert code == 1
    assert "cluster (context gpu-cluster): fails --strict: 1 warning" in err
