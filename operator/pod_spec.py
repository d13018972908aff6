"""The pod spec of a role's pods, pure (run by the operator, and by `grpolora render`): containers, probes,
resources, volumes and mounts, security, and the env contract each worker reads (grpolora.api.contract).
grpolora.operator.builders wraps it in the workloads' pod templates (labels, the user's podTemplate overlay, what
Kueue's admission adds)."""

from __future__ import annotations

import copy
from typing import Any

from grpolora.api import constants as c
from grpolora.api import contract
from grpolora.api.plan import (
    CHAT_TEMPLATE_MOUNT,
    CHAT_TEMPLATE_NAME,
    DATASET_MOUNT,
    HUB_TOKEN_MOUNT,
    MODEL_MOUNT,
    POOL_JOBS_MOUNT,
    SECRET_FILE,
    SECRETS_MOUNT,
    TOKEN_MOUNT,
    JobPlan,
    Placement,
    PoolPlan,
    RolePlan,
    environment_server_command,
    trainer_secrets,
)
from grpolora.api.spec import ModelSpec, PodSecuritySpec, RoleSpec
from grpolora.operator import names

Plan = JobPlan | PoolPlan

# The images' numeric USER (Dockerfile): runAsNonRoot holds without the pods fixing a uid (see PodSecuritySpec).
WORKER_UID = 1000
SHM_MOUNT = c.SHM_MOUNT
CACHE_MOUNT = c.CACHE_MOUNT
# Inference servers need minutes for large models (download + load); give the startup probe 30 minutes.
STARTUP_PROBE_PERIOD_SECONDS = 10
STARTUP_PROBE_FAILURES = 180


def build_pod_spec(plan: Plan, role: RolePlan, *, restart_policy: str, subdomain: str | None = None) -> dict:
    placement = role.placement
    model, security = _model_and_security(plan)
    http = role.ports["http"]
    container: dict[str, Any] = {
        "name": role.role,
        "image": placement.image,
        # The inference engine's LoRA slots, visible in `grpolora render` and `kubectl describe`; the worker checks
        # them against the spec it reads from the environment.
        "args": [
            "worker",
            role.role,
            *([f"--lora-slots={_lora_slots(plan)}"] if role.role == "inference" else []),
        ],
        "ports": [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in role.ports.items()],
        "env": _env(plan, role),
        "resources": _resources(placement, role_spec(plan, role).cache_size_limit),
        "volumeMounts": [
            {"name": "shm", "mountPath": SHM_MOUNT},
            {"name": "cache", "mountPath": CACHE_MOUNT},
        ],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        # The worker's own message (contract.write_termination_message), else its last log lines, reach the
        # container's terminated state, where the operator reads why it failed.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if placement.image_pull_policy:
        container["imagePullPolicy"] = placement.image_pull_policy
    volumes: list[dict[str, Any]] = [
        # NCCL and vLLM's CPU backend use shared memory well beyond the default 64 MiB.
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": role_spec(plan, role).shm_size_limit}},
        # The model is downloaded here (HF_HOME): sized by the role's cacheSizeLimit, which _resources also requests.
        {"name": "cache", "emptyDir": _sized(role_spec(plan, role).cache_size_limit)},
    ]
    for name, path, secret, key in _secret_files(role, model):
        container["volumeMounts"].append({"name": name, "mountPath": path, "readOnly": True})
        volumes.append({"name": name, "secret": {"secretName": secret, "items": [{"key": key, "path": SECRET_FILE}]}})
    if model.source is not None:
        pvc = model.source.pvc
        mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
        if pvc.sub_path:
            mount["subPath"] = pvc.sub_path
        container["volumeMounts"].append(mount)
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": True}})
    if isinstance(plan, JobPlan) and (template := plan.spec.task.chat_template_from) is not None:
        # Both roles render with it: the trainer its prompts and episodes, a job's own servers its chat sessions.
        container["volumeMounts"].append({"name": "chat-template", "mountPath": CHAT_TEMPLATE_MOUNT, "readOnly": True})
        volumes.append({"name": "chat-template", "configMap": {"name": template.name, "items": [
            {"key": template.key, "path": CHAT_TEMPLATE_NAME}]}})  # fmt: skip
    if isinstance(plan, PoolPlan):
        # The attachment list: the Secret's key is a file in this folder, updated in place when jobs attach or
        # detach (a whole-volume mount, not subPath, so that the kubelet refreshes it).
        volume = c.POOL_JOBS_VOLUME
        container["volumeMounts"].append({"name": volume, "mountPath": POOL_JOBS_MOUNT, "readOnly": True})
        volumes.append({"name": volume, "secret": {"secretName": plan.jobs_secret}})
    if role.role == c.ROLE_TRAINER:
        assert isinstance(plan, JobPlan)
        spec = plan.spec
        ckpt_pvc = spec.checkpoint.pvc
        container["volumeMounts"].append(
            {"name": "checkpoints", "mountPath": spec.checkpoint.path}
            | ({"subPath": ckpt_pvc.sub_path} if ckpt_pvc and ckpt_pvc.sub_path else {})
        )
        volumes.append(
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": ckpt_pvc.claim_name}}
            if ckpt_pvc
            else {"name": "checkpoints", "emptyDir": {}}
        )
        mounts, extra = _trainer_inputs(plan)
        container["volumeMounts"] += mounts
        volumes += extra
        container["readinessProbe"] = _http_probe("/health", http, period=10)
    else:
        # Started = engine up and the jobs served, whether or not the engine answers now (app.py's /started): an
        # engine hung right after the start is then the liveness probe's to replace, not the startup probe's 30 min.
        container["startupProbe"] = _http_probe(
            "/started", http, period=STARTUP_PROBE_PERIOD_SECONDS, failures=STARTUP_PROBE_FAILURES
        )
        # Ready = engine up and serving the adapter version the trainer last sent.
        container["readinessProbe"] = _http_probe("/ready", http, period=5)
        # Live = engine up and answering a round trip within c.ENGINE_PROBE_SECONDS (a hung engine fails it); the
        # probe's own timeout is longer, so that the kubelet reads the server's verdict (`grpolora run` plays it too).
        container["livenessProbe"] = _http_probe(
            "/health", http, period=c.LIVENESS_PERIOD_SECONDS, failures=c.LIVENESS_FAILURES
        ) | {"timeoutSeconds": c.LIVENESS_TIMEOUT_SECONDS}
    _one_volume_per_claim(volumes, container["volumeMounts"])
    pod: dict[str, Any] = {
        "restartPolicy": restart_policy,
        # Workers talk to nobody's API server: progress flows to the operator over HTTP.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security(security),
        "containers": [container],
        "volumes": volumes,
    }
    if subdomain:
        pod["subdomain"] = subdomain
    return _placed(pod, plan, placement)


def _placed(pod: dict[str, Any], plan: Plan, placement: Placement) -> dict[str, Any]:
    """`pod` with where the role's placement puts it: its nodeSelector, tolerations, affinity, the cluster's image
    pull Secrets and the job's PriorityClass (every role's pods, the environment server's too)."""
    if placement.node_selector:
        pod["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        pod["tolerations"] = [copy.deepcopy(dict(t)) for t in placement.tolerations]
    if placement.affinity:
        pod["affinity"] = copy.deepcopy(dict(placement.affinity))
    if placement.image_pull_secrets:  # the cluster's (grpolora.api.plan.WorkerDefaults); a podTemplate adds its own
        pod["imagePullSecrets"] = [{"name": name} for name in placement.image_pull_secrets]
    if isinstance(plan, JobPlan) and plan.spec.scheduling.priority_class_name:  # a podTemplate's own one wins
        pod["priorityClassName"] = plan.spec.scheduling.priority_class_name
    return pod


def environment_pod_spec(plan: JobPlan, role: RolePlan) -> dict[str, Any]:
    """The pod spec of spec.environment.server's pods: its command (or the project's service of the job's builtin or
    plugin, grpolora.api.plan.environment_server_command), the job's token as a read-only file, a readiness probe
    on GET /health of its port (the service answers it without the token; a server of one's own must too,
    docs/operator.md), its RuntimeClass (gVisor, Kata), and the security every pod of the job has. No model, no
    shared memory, no service-account token: a sandbox gets as little as it can."""
    environment = plan.spec.environment
    assert environment is not None and environment.server is not None
    server, placement = environment.server, role.placement
    port = role.ports["http"]
    ((volume, mount, secret, key),) = _secret_files(role, plan.spec.model, hub_token=False)
    command, args = environment_server_command(environment, port=port, token_file=f"{mount}/{SECRET_FILE}")
    container: dict[str, Any] = {
        "name": role.role,
        "image": placement.image,
        "command": command,
        "args": args,
        "ports": [{"name": name, "containerPort": p, "protocol": "TCP"} for name, p in role.ports.items()],
        "env": _env(plan, role),
        "resources": _resources(placement),
        # HOME is there in the project's images (Dockerfile): a plugin's caches go to an emptyDir, not the image.
        "volumeMounts": [
            {"name": "cache", "mountPath": CACHE_MOUNT},
            {"name": volume, "mountPath": mount, "readOnly": True},
        ],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "readinessProbe": _http_probe("/health", port, period=5),
    }
    if placement.image_pull_policy:
        container["imagePullPolicy"] = placement.image_pull_policy
    pod: dict[str, Any] = {
        "restartPolicy": "Always",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security(plan.spec.pod_security),
        "containers": [container],
        "volumes": [
            {"name": "cache", "emptyDir": {}},
            {"name": volume, "secret": {"secretName": secret, "items": [{"key": key, "path": SECRET_FILE}]}},
        ],
    }
    if server.runtime_class_name:
        pod["runtimeClassName"] = server.runtime_class_name
    return _placed(pod, plan, placement)


def _one_volume_per_claim(volumes: list[dict[str, Any]], mounts: list[dict[str, Any]]) -> None:
    """Merge the volumes of one PersistentVolumeClaim (spec.model.source.pvc, checkpoint.pvc, output.pvc and
    task.dataset.pvc may name the same one) into the first, its mounts renamed to it. The kubelet keys a pod's
    volumes by the PersistentVolume, so a second volume of a claim is never mounted and the pod waits in
    ContainerCreating for ever, which the API server admits (kubernetes/kubernetes#127004). A PVC source's readOnly
    holds for every mount of the volume: the mounts keep their own, and the source is read-only only when all are."""
    kept: dict[str, dict[str, Any]] = {}  # claim name -> its one volume
    renamed: dict[str, str] = {}
    for volume in list(volumes):
        if (claim := volume.get("persistentVolumeClaim")) is None:
            continue
        if (first := kept.setdefault(claim["claimName"], volume)) is not volume:
            renamed[volume["name"]] = first["name"]
            volumes.remove(volume)
    for mount in mounts:
        mount["name"] = renamed.get(mount["name"], mount["name"])
    for claim_name, volume in kept.items():
        read_only = all(m.get("readOnly", False) for m in mounts if m["name"] == volume["name"])
        volume["persistentVolumeClaim"] = {"claimName": claim_name} | ({"readOnly": True} if read_only else {})


def _secret_files(role: RolePlan, model: ModelSpec, *, hub_token: bool = True) -> list[tuple[str, str, str, str]]:
    """(volume, mount path, Secret, key) of each Secret key the worker reads as a file: the job's token (the contract
    variable that names its file is in _env) and spec.model.tokenFrom's hub token (HF_TOKEN_PATH, from the plan; not
    for the environment server, which loads no model)."""
    found = [(c.TOKEN_VOLUME, TOKEN_MOUNT, *var.secret) for var in role.env if var.secret is not None]
    assert len(found) <= 1, "one Secret key per pod is mounted at TOKEN_MOUNT"
    if hub_token and model.token_from is not None:
        found.append((c.HUB_TOKEN_VOLUME, HUB_TOKEN_MOUNT, model.token_from.secret_name, model.token_from.key))
    return found


def _trainer_inputs(plan: JobPlan) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Mounts and volumes that only the trainer needs: the dataset volume and the Secrets the job names, read-only
    (the trainer reads prompts and credentials, never writes them), and the output folder."""
    spec = plan.job.spec
    mounts: list[dict[str, Any]] = []
    volumes: list[dict[str, Any]] = []
    dataset = spec.task.dataset
    if dataset is not None and dataset.pvc is not None:
        mount = {"name": "dataset", "mountPath": DATASET_MOUNT, "readOnly": True}
        if dataset.pvc.sub_path:
            mount["subPath"] = dataset.pvc.sub_path
        mounts.append(mount)
        volumes.append(
            {"name": "dataset", "persistentVolumeClaim": {"claimName": dataset.pvc.claim_name, "readOnly": True}}
        )
    if spec.output is not None and spec.output.folder is not None:  # else beside the checkpoints
        mounts.append({"name": "output", "mountPath": spec.output.folder})
        volumes.append(
            {"name": "output", "persistentVolumeClaim": {"claimName": spec.output.pvc.claim_name}}
            if spec.output.pvc
            else {"name": "output", "emptyDir": {}}
        )
        if spec.output.pvc and spec.output.pvc.sub_path:
            mounts[-1]["subPath"] = spec.output.pvc.sub_path
    for i, name in enumerate(trainer_secrets(spec)):
        mounts.append({"name": f"secret-{i}", "mountPath": f"{SECRETS_MOUNT}/{name}", "readOnly": True})
        volumes.append({"name": f"secret-{i}", "secret": {"secretName": name}})
    return mounts, volumes


def role_spec(plan: Plan, role: RolePlan) -> RoleSpec:
    if isinstance(plan, PoolPlan):
        return plan.pool.spec
    spec = plan.spec
    return spec.trainer if role.role == c.ROLE_TRAINER else spec.inference


def _model_and_security(plan: Plan) -> tuple[ModelSpec, PodSecuritySpec]:
    spec = plan.pool.spec if isinstance(plan, PoolPlan) else plan.spec
    return spec.model, spec.pod_security


def _lora_slots(plan: Plan) -> int:
    """The engine's LoRA slots: a job's inference.maxLoras, or every attached job's slots on a pool."""
    return plan.pool.spec.lora_slots if isinstance(plan, PoolPlan) else plan.spec.inference.max_loras


def _pod_security(security: PodSecuritySpec) -> dict[str, Any]:
    result: dict[str, Any] = {"runAsNonRoot": True}
    for key, value in (
        ("runAsUser", security.run_as_user),
        ("runAsGroup", security.run_as_group),
        ("fsGroup", security.fs_group),
    ):
        if value is not None:
            result[key] = value
    if security.fs_group is not None:
        # Large PVCs: change ownership only when the volume root does not already match, not on every start.
        result["fsGroupChangePolicy"] = "OnRootMismatch"
    result["seccompProfile"] = {"type": "RuntimeDefault"}
    return result


def _env(plan: Plan, role: RolePlan) -> list[dict[str, Any]]:
    index_field = c.JOB_COMPLETION_INDEX_FIELD if role.role == c.ROLE_TRAINER else c.STATEFULSET_POD_INDEX_FIELD
    result: list[dict[str, Any]] = []
    for var in role.env:
        if var.replica_index:
            result.append({"name": var.name, "valueFrom": {"fieldRef": {"fieldPath": index_field}}})
        elif var.secret is not None:  # a file (_secret_files mounts it): no secret in the env
            assert var.secret_file is not None, f"{var.name}: a Secret key reaches pods as a file"
            result.append({"name": var.secret_file, "value": f"{TOKEN_MOUNT}/{SECRET_FILE}"})
        else:
            result.append({"name": var.name, "value": var.value})
    if role.role == c.ROLE_TRAINER:
        # Fencing (contract.TRAINER_INCARNATION): the incarnation the operator marks the trainer's pod template with
        # (job_workloads.with_restart_attempt); the downward API gives "" for the first, unmarked, incarnation
        # (Kubernetes pkg/fieldpath: a missing annotation is the empty string).
        incarnation = f"metadata.annotations['{names.INCARNATION_ANNOTATION}']"
        result.append({"name": contract.TRAINER_INCARNATION, "valueFrom": {"fieldRef": {"fieldPath": incarnation}}})
    return result + [copy.deepcopy(dict(v)) for v in role.user_env]


def _sized(size_limit: str | None) -> dict[str, Any]:
    return {"sizeLimit": size_limit} if size_limit else {}


def _resources(placement: Placement, cache_size: str | None = None) -> dict[str, Any]:
    result = copy.deepcopy(dict(placement.resources))
    if placement.gpus:
        result.setdefault("limits", {})[placement.gpu_resource] = placement.gpus
    if cache_size:
        # The scheduler counts requests, not an emptyDir's sizeLimit: without this a pod lands on a node whose disk
        # cannot hold the model. A request of the role's own covers it and whatever else the pod writes.
        result.setdefault("requests", {}).setdefault("ephemeral-storage", cache_size)
    return result


def _http_probe(path: str, port: int, *, period: int, failures: int = 3) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures}
