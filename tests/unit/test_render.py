"""The operator's desired state, rendered from the plan: valid Kubernetes objects with placement and env."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from grpolora.api import constants as c
from grpolora.api import contract
from grpolora.api.load import load_jobs, parse_job
from grpolora.api.plan import plan, trainer_secrets
from grpolora.operator.builders import build_children, workloads
from tests.helpers import EXAMPLES, ROOT, job_doc
from tests.unit.test_cli_conventions import run

K8S_VERSION = "1.33.0"


def children(doc_or_job, uid: str = "1234") -> list[dict[str, Any]]:
    job = parse_job(doc_or_job) if isinstance(doc_or_job, dict) else doc_or_job
    return build_children(plan(job), owner_uid=uid, token="tok")


def by_kind(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def env_of(workload: dict[str, Any]) -> dict[str, Any]:
    container = workload["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_rendered_object_validates_against_kubernetes_schemas(path):
    for job in load_jobs(path):
        for obj in children(job):
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_a_job_gets_secret_services_policy_and_both_workloads():
    objs = by_kind(children(job_doc(inference={"replicas": 2})))
    assert set(objs) == {
        ("Secret", "demo-grpolora-token"),
        ("Service", "demo-trainer"),
        ("Service", "demo-inference"),
        ("NetworkPolicy", "demo"),
        ("PodDisruptionBudget", "demo-inference"),
        ("Job", "demo-trainer"),
        ("StatefulSet", "demo-inference"),
    }
    for obj in objs.values():
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "grpolora.dev/v1alpha1",
            "kind": "GRPOLoraJob",
            "name": "demo",
            "uid": "1234",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        labels = obj["metadata"]["labels"]
        assert labels[c.LABEL_NAME] == "grpo-lora" and labels[c.LABEL_INSTANCE] == "demo"
        assert labels[c.LABEL_JOB] == "demo"
        assert obj["metadata"]["namespace"] == "team-a"


def test_headless_services_publish_not_ready_addresses():
    objs = by_kind(children(job_doc()))
    for role in ("trainer", "inference"):
        svc = objs[("Service", f"demo-{role}")]["spec"]
        assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
        # (and the job's uid: only the pods of this incarnation of the job, see test_kueue.py)
        assert svc["selector"] == {c.LABEL_JOB: "demo", c.LABEL_ROLE: role, c.LABEL_JOB_UID: "1234"}
    ports = {p["name"]: p["port"] for p in objs[("Service", "demo-trainer")]["spec"]["ports"]}
    assert ports == {"master": 29500, "sync": 29600, "http": 8080}


def test_gpu_example_places_each_role_on_its_own_pool_with_full_rendezvous_env():
    (job,) = load_jobs(ROOT / "examples" / "qwen3-0.6b-gpu.yaml")
    objs = by_kind(children(job))
    trainer = objs[("Job", "qwen3-arithmetic-trainer")]
    inference = objs[("StatefulSet", "qwen3-arithmetic-inference")]
    for workload, pool, gpus in ((trainer, "trainer", 1), (inference, "inference", 1)):
        pod = workload["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"grpolora.dev/pool": pool}
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert pod["automountServiceAccountToken"] is False
    t_env, i_env = env_of(trainer), env_of(inference)
    master = "qwen3-arithmetic-trainer-0.qwen3-arithmetic-trainer.rl.svc"
    assert t_env[contract.MASTER_ADDR] == master and t_env[contract.SYNC_ADDR] == master
    assert t_env[contract.MASTER_PORT] == "29500" and t_env[contract.WORLD_SIZE] == "1"
    assert t_env[contract.SYNC_WORLD_SIZE] == "3" and t_env[contract.SYNC_BACKEND] == "nccl"
    assert t_env[contract.INFERENCE_ENDPOINTS].count("http://") == 2
    assert t_env[contract.NODE_RANK] == {"fieldRef": {"fieldPath": c.JOB_COMPLETION_INDEX_FIELD}}
    assert i_env[contract.REPLICA_INDEX] == {"fieldRef": {"fieldPath": c.STATEFULSET_POD_INDEX_FIELD}}
    # The token is a file (tests/unit/test_model_place.py): GRPOLORA_TOKEN itself is for local runs.
    assert i_env[contract.TOKEN_FILE] == "/var/run/grpolora/token/token" and contract.TOKEN not in i_env
    optional = {contract.RANK, contract.LOCAL_RANK, contract.OUTPUT_DIR, contract.DATA_DIR, contract.SECRETS_DIR,
                contract.TOKEN, contract.HUB_TOKEN_PATH, contract.CHAT_TEMPLATE_FILE, contract.ENVIRONMENT_URL,
                contract.ENVIRONMENT_TOKEN, contract.ENVIRONMENT_TOKEN_FILE, contract.ENVIRONMENT_PORT,
                *contract.POOL_ONLY}  # fmt: skip
    assert set(contract.ALL) - optional <= set(t_env)


def test_trainer_is_an_indexed_job_the_operator_restarts_as_a_group():
    objs = by_kind(children(job_doc(trainer={"replicas": 3})))
    spec = objs[("Job", "demo-trainer")]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 3
    assert spec["backoffLimit"] == 0
    assert spec["template"]["spec"]["subdomain"] == "demo-trainer"
    assert spec["template"]["spec"]["restartPolicy"] == "Never"


def test_inference_probes_separate_started_from_ready():
    objs = by_kind(children(job_doc()))
    container = objs[("StatefulSet", "demo-inference")]["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["startupProbe"]["httpGet"]["path"] == "/started"  # the engine's hang is the liveness probe's
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"


def test_user_env_and_volumes():
    doc = job_doc(
        trainer={"env": [{"name": "NCCL_DEBUG", "value": "INFO"}]},
        model={"name": "llama", "source": {"pvc": {"claimName": "weights", "subPath": "hub"}}},
        checkpoint={"path": "/ckpt", "pvc": {"claimName": "ckpts"}},
    )
    objs = by_kind(children(doc))
    pod = objs[("Job", "demo-trainer")]["spec"]["template"]["spec"]
    assert env_of(objs[("Job", "demo-trainer")])["NCCL_DEBUG"] == "INFO"
    assert env_of(objs[("Job", "demo-trainer")])[contract.MODEL] == "/models/llama"
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "hub"}
    assert mounts["checkpoints"]["mountPath"] == "/ckpt"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "ckpts"}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}


def test_one_claim_named_by_several_fields_is_one_volume_with_a_mount_each(tmp_path, capsys):
    # The kubelet keys a pod's volumes by the PersistentVolume, not by the volume's name: two volumes of one claim
    # leave the pod in ContainerCreating for ever ("Cannot mount the same PVC multiple times on one Pod",
    # kubernetes/kubernetes#127004, open; #99453 the same with subPaths), and the API server admits such a pod
    # (kubernetes/kubernetes#126730, the validation that would refuse it, was closed unmerged). One claim for the
    # weights, the checkpoints and the results is what a small cluster with one RWX share does.
    shared = {"claimName": "work"}
    doc = job_doc(
        model={"name": "llama", "source": {"pvc": {**shared, "subPath": "models"}}},
        checkpoint={"path": "/ckpt", "pvc": {**shared, "subPath": "ckpt"}},
        output={"path": "/out", "pvc": {**shared, "subPath": "out"}},
        task={"dataset": {"pvc": {**shared, "subPath": "data"}, "path": "train.parquet"}, "reward": [{"name": "math"}]},
    )
    objs = by_kind(children(doc))
    for kind, name, paths in (
        ("Job", "demo-trainer", {"/models": True, "/ckpt": False, "/out": False, "/data": True}),
        ("StatefulSet", "demo-inference", {"/models": True}),
    ):
        pod = objs[(kind, name)]["spec"]["template"]["spec"]
        claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert len(claims) == 1, claims
        (volume,) = claims
        # A PVC source's readOnly holds for every mount of the volume: read-only lives on the mounts, and the
        # source is read-only only when every mount is (the inference pods only read the weights).
        assert volume["persistentVolumeClaim"] == {"claimName": "work", **({} if False in paths.values() else
                                                   {"readOnly": True})}  # fmt: skip
        mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]}
        assert {path: m.get("readOnly", False) for path, m in mounts.items()} == paths
        subpaths = {"/models": "models", "/ckpt": "ckpt", "/out": "out", "/data": "data"}
        assert {path: m["subPath"] for path, m in mounts.items()} == {path: subpaths[path] for path in paths}
    for obj in objs.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    # `grpolora render` prints the one volume.
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    code, out, err = run(capsys, "render", str(path))
    assert code == 0, err
    rendered = by_kind(list(yaml.safe_load_all(out)))
    for kind, name in (("Job", "demo-trainer"), ("StatefulSet", "demo-inference")):
        volumes = rendered[(kind, name)]["spec"]["template"]["spec"]["volumes"]
        assert [v["name"] for v in volumes if "persistentVolumeClaim" in v] == ["model"]
    # Two claims stay two volumes.
    apart = by_kind(children(job_doc(checkpoint={"pvc": {"claimName": "a"}}, output={"pvc": {"claimName": "b"}})))
    pod = apart[("Job", "demo-trainer")]["spec"]["template"]["spec"]
    assert [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v] == [
        "a", "b"]  # fmt: skip


def test_network_policy_admits_only_the_jobs_pods_and_the_operator():
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    objs = by_kind(children(job_doc(networkPolicy={"metricsFrom": peers})))
    ingress = objs[("NetworkPolicy", "demo")]["spec"]["ingress"]
    assert ingress[0] == {"from": [{"podSelector": {"matchLabels": {c.LABEL_JOB: "demo"}}}]}
    assert ingress[1]["ports"] == [{"port": 8080, "protocol": "TCP"}]
    # The operator's /status poll: from the operator's pods in the operator's namespace only.
    assert ingress[1]["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "grpo-lora-system"}},
            "podSelector": {"matchLabels": {c.LABEL_NAME: c.OPERATOR_NAME}},
        }
    ]
    elsewhere = build_children(plan(parse_job(job_doc())), owner_uid="u", token="t", operator_namespace="ops")
    policy = next(o for o in elsewhere if o["kind"] == "NetworkPolicy")
    assert policy["spec"]["ingress"][1]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "ops"
    }
    assert ingress[2]["from"] == peers
    assert not [o for o in children(job_doc(networkPolicy={"enabled": False})) if o["kind"] == "NetworkPolicy"]


def test_workloads_are_the_pod_owning_children():
    p = plan(parse_job(job_doc()))
    assert [w["kind"] for w in workloads(p)] == ["Job", "StatefulSet"]


def pod_of(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == kind)["spec"]["template"]["spec"]


def test_pods_run_as_non_root_without_a_fixed_uid_by_default():
    # OpenShift's restricted-v2 assigns the UID and fsGroup from the namespace's range and refuses fixed ones; the
    # images run as the numeric USER 1000:1000, which satisfies runAsNonRoot elsewhere.
    for kind in ("Job", "StatefulSet"):
        security = pod_of(children(job_doc()), kind)["securityContext"]
        assert security == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def test_pod_security_ids_are_settable_in_the_spec():
    objects = children(job_doc(podSecurity={"runAsUser": 1001, "runAsGroup": 1002, "fsGroup": 2000}))
    for kind in ("Job", "StatefulSet"):
        security = pod_of(objects, kind)["securityContext"]
        assert (security["runAsUser"], security["runAsGroup"], security["fsGroup"]) == (1001, 1002, 2000)
        # Large PVCs (models, checkpoints): no recursive chown on every start once the root has the right group.
        assert security["fsGroupChangePolicy"] == "OnRootMismatch"
        kubernetes_validate.validate(next(o for o in objects if o["kind"] == kind), K8S_VERSION, strict=True)


def test_shared_memory_is_bounded():
    for kind in ("Job", "StatefulSet"):
        shm = next(v for v in pod_of(children(job_doc()), kind)["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    big = children(job_doc(trainer={"shmSizeLimit": "32Gi"}))
    assert next(v for v in pod_of(big, "Job")["volumes"] if v["name"] == "shm")["emptyDir"]["sizeLimit"] == "32Gi"


def test_trainer_mounts_the_dataset_volume_and_named_secrets_read_only():
    doc = job_doc(
        task={
            "dataset": {"pvc": {"claimName": "prompts", "subPath": "v3"}, "path": "train.parquet"},
            "reward": [
                {"name": "math"},
                {"url": "http://reward.rl.svc:8000/score", "headersFrom": {"secretName": "reward-auth"}},
            ],
        },
        environment={"url": "http://env.rl.svc:8000", "headersFrom": {"secretName": "env-auth"}},
    )
    objs = by_kind(children(doc))
    trainer = objs[("Job", "demo-trainer")]
    pod = trainer["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["dataset"] == {"name": "dataset", "mountPath": "/data", "readOnly": True, "subPath": "v3"}
    assert volumes["dataset"]["persistentVolumeClaim"] == {"claimName": "prompts", "readOnly": True}
    assert mounts["secret-0"] == {
        "name": "secret-0",
        "mountPath": "/var/run/grpolora/secrets/reward-auth",
        "readOnly": True,
    }
    assert volumes["secret-0"] == {"name": "secret-0", "secret": {"secretName": "reward-auth"}}
    assert mounts["secret-1"]["mountPath"] == "/var/run/grpolora/secrets/env-auth"  # the environment service's
    assert volumes["secret-1"] == {"name": "secret-1", "secret": {"secretName": "env-auth"}}
    # Every Secret the job names for the trainer to read is mounted: the list the operator checks exists
    # (secret_references) and the one it mounts agree, but for the model's token and the pods' own references.
    named = {name for path, name in parse_job(doc).spec.secret_references() if path.split(".")[0] in ("task",
             "environment", "tracking", "output")}  # fmt: skip
    assert set(trainer_secrets(parse_job(doc).spec)) == named == {"reward-auth", "env-auth"}
    assert env_of(trainer)[contract.DATA_DIR] == "/data"
    assert env_of(trainer)[contract.SECRETS_DIR] == "/var/run/grpolora/secrets"
    # Inference pods read neither: no volume, and no variable pointing at a folder they do not have.
    servers = objs[("StatefulSet", "demo-inference")]
    inference = servers["spec"]["template"]["spec"]
    assert not {"dataset", "secret-0"} & {v["name"] for v in inference["volumes"]}
    assert not {contract.DATA_DIR, contract.SECRETS_DIR} & set(env_of(servers))
    for obj in objs.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_trainer_mounts_the_output_volume_and_tracking_and_push_secrets():
    (job,) = load_jobs(ROOT / "examples" / "gsm8k-data.yaml")
    p = plan(job)
    objs = by_kind(children(job))
    trainer = objs[("Job", "qwen3-gsm8k-trainer")]
    pod = trainer["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    output = mounts["/results/qwen3-gsm8k"]
    assert volumes[output["name"]]["persistentVolumeClaim"] == {"claimName": "results"}
    assert (
        env_of(trainer)[contract.OUTPUT_DIR]
        == "/results/qwen3-gsm8k"
        == p.env_for("trainer", 0, token="t")[contract.OUTPUT_DIR]
    )
    secrets = {m["mountPath"].rsplit("/", 1)[1]: volumes[m["name"]]["secret"]["secretName"] for m in mounts.values()
               if m["name"].startswith("secret-")}  # fmt: skip
    assert secrets == {"reward-auth": "reward-auth", "mlflow": "mlflow", "s3": "s3"}
    assert all(m["readOnly"] for m in mounts.values() if m["name"].startswith("secret-"))
    # Without spec.output, results stay next to the checkpoints (no output variable: the worker defaults to them).
    (plain,) = load_jobs(ROOT / "examples" / "model-cache" / "qwen3-from-a-volume.yaml")
    assert plain.spec.output is None and plain.spec.checkpoint.pvc is not None
    assert contract.OUTPUT_DIR not in env_of(by_kind(children(plain))[("Job", f"{plain.name}-trainer")])


def test_an_output_that_only_pushes_lands_beside_the_checkpoints():
    # docs/tasks.md: outputs go to spec.output.path on spec.output.pvc, "by default the checkpoint folder (on the
    # checkpoint PVC when set)". A spec.output with only `push` named neither, yet the trainer wrote metrics.jsonl,
    # samples, status.json and the final adapter to an emptyDir at /var/lib/grpolora/output, lost with the pod.
    push = {"push": {"s3": {"url": "s3://b/p"}}}
    job = parse_job(job_doc(output=push, checkpoint={"path": "/ckpt", "pvc": {"claimName": "ckpts"}}))
    trainer = by_kind(children(job))[("Job", "demo-trainer")]
    pod = trainer["spec"]["template"]["spec"]
    assert {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]} >= {"/ckpt"}
    assert "output" not in {v["name"] for v in pod["volumes"]}
    assert contract.OUTPUT_DIR not in env_of(trainer)  # the worker's default: the checkpoint folder
    assert contract.OUTPUT_DIR not in plan(job).env_for("trainer", 0, token="t")
    # A claim of its own without a path is mounted at the documented folder; a path is the user's.
    for output, folder in (({"pvc": {"claimName": "r"}}, "/var/lib/grpolora/output"), ({"path": "/o"}, "/o")):
        trainer = by_kind(children(job_doc(output=output | push)))[("Job", "demo-trainer")]
        container = trainer["spec"]["template"]["spec"]["containers"][0]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["output"] == folder == env_of(trainer)[contract.OUTPUT_DIR]


def test_validate_warns_when_no_output_persists():
    from grpolora.api.load import job_warnings

    def warning(**fields) -> str | None:
        found = [w.message for w in job_warnings(parse_job(job_doc(**fields))) if w.path == "spec.output"]
        return found[0] if found else None

    def warned(**fields) -> bool:
        return warning(**fields) is not None

    push = {"push": {"s3": {"url": "s3://b/p"}}}
    assert warned()
    assert warned(output={"path": "/out"}, checkpoint={"pvc": {"claimName": "c"}})  # output set, on no volume
    assert not warned(checkpoint={"pvc": {"claimName": "c"}})  # outputs default to the checkpoint volume
    assert not warned(output={"pvc": {"claimName": "r"}})
    assert not warned(output=push, checkpoint={"pvc": {"claimName": "c"}})  # push only: beside the checkpoints
    # Pushed, on no volume: the adapter leaves the pod, the rest of the run folder does not.
    assert "only the adapter outlives the pod" in warning(output=push)
    assert "only the adapter outlives the pod" in warning(output={"path": "/out"} | push)


# ---- the GPU resource name: nvidia.com/gpu, a MIG profile, another vendor's --------------------------------


def _limits(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind]
    return obj["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]


def test_each_role_requests_gpus_under_the_resource_name_it_gives():
    doc = job_doc(
        trainer={"gpusPerReplica": 2, "gpuResource": "nvidia.com/mig-1g.10gb"},
        inference={"gpusPerReplica": 1, "gpuResource": "amd.com/gpu"},
    )
    objects = build_children(plan(parse_job(doc)), owner_uid="u", token="t")
    trainer, inference = _limits(objects, "Job"), _limits(objects, "StatefulSet")
    assert trainer["nvidia.com/mig-1g.10gb"] == 2 and "nvidia.com/gpu" not in trainer
    assert inference["amd.com/gpu"] == 1 and "nvidia.com/gpu" not in inference
    # Kueue's Workload counts what the pods request: its pod sets carry the same templates.
    from grpolora.operator.builders import queue_workload

    sets = queue_workload(plan(parse_job(doc)))["spec"]["podSets"]
    assert [s["template"]["spec"]["containers"][0]["resources"]["limits"] for s in sets] == [trainer, inference]


def test_the_gpu_resource_defaults_to_nvidia_com_gpu():
    objects = build_children(plan(parse_job(job_doc(trainer={"gpusPerReplica": 1}))), owner_uid="u", token="t")
    assert _limits(objects, "Job")[c.DEFAULT_GPU_RESOURCE] == 1 and c.DEFAULT_GPU_RESOURCE == "nvidia.com/gpu"


# ---- every Kubernetes version the chart supports -----------------------------------------------------------

CHART_MINIMUM = "1.28.0"  # charts/grpo-lora-operator/Chart.yaml kubeVersion (a test below reads it)
ALL_EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))


def test_the_oldest_version_checked_is_the_charts_minimum():
    chart = (ROOT / "charts" / "grpo-lora-operator" / "Chart.yaml").read_text()
    assert f'kubeVersion: ">={CHART_MINIMUM}-0"' in chart


@pytest.mark.parametrize("version", [CHART_MINIMUM, K8S_VERSION])
def test_every_rendered_object_of_every_example_validates_at_each_supported_version(version, capsys):
    """Strict schemas of the chart's minimum and of the version the emulator plays: a CI gate pinned to the minimum
    (kubeconform, kubernetes-validate) refuses what that version's schema does not have or requires, e.g. 1.28's
    podFailurePolicy rule, where `onPodConditions` is required even beside `onExitCodes`."""
    import yaml

    from grpolora.cli import main

    assert main(["render", *map(str, ALL_EXAMPLES)]) == 0
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    assert {"Job", "StatefulSet", "Service", "NetworkPolicy", "Secret"} <= {o["kind"] for o in objects}
    for obj in objects:
        if obj["apiVersion"] != c.KUEUE_API_VERSION:  # Kueue's Workload is no built-in kind (not in these schemas)
            kubernetes_validate.validate(obj, version, strict=True)
