"""The model's credentials and its place in the pods, as rendered: the hub token of spec.model.tokenFrom and the job's
own sync token reach the workers as read-only files, never as environment variables (Checkov's CKV_K8S_35, "prefer
using secrets as files over secrets as environment variables"); huggingface_hub reads the hub token from the file
HF_TOKEN_PATH names (its constants.HF_TOKEN_PATH). A role's cacheSizeLimit (a runtime may set it for its jobs)
sizes the emptyDir the model is downloaded into and requests that much ephemeral storage, so that the scheduler
places the pod on a node with the disk, and the kubelet evicts only the pod that overflows it (Kubernetes docs,
"Local ephemeral storage": an emptyDir's sizeLimit is enforced by eviction; requests.ephemeral-storage is what the
scheduler counts). Table-driven over a job's trainer and inference pods and a RolloutPool's servers, each checked
against Kubernetes' schemas."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from grpolora.api import constants as c
from grpolora.api import contract
from grpolora.api.contract import ContractError, WorkerEnv
from grpolora.api.load import InvalidJob, parse_job, parse_runtime
from grpolora.api.plan import HUB_TOKEN_FILE, HUB_TOKEN_MOUNT, TOKEN_MOUNT, plan, plan_pool
from grpolora.api.pool import Attachments
from grpolora.api.runtime import resolve
from grpolora.api.spec import GRPOLoraJob
from grpolora.operator import builders
from tests.helpers import job_doc
from tests.unit.test_pool import pool, pool_doc
from tests.unit.test_render import K8S_VERSION
from tests.unit.test_runtime import on_runtime, runtime_doc

HF = {"secretName": "hf", "key": "HF_TOKEN"}


def job_pods(**model: Any) -> dict[str, dict[str, Any]]:
    """The pod templates of a job's trainer Job and inference StatefulSet, by role."""
    objects = builders.build_children(
        plan(parse_job(job_doc(model={"name": "Qwen/Qwen3-0.6B", **model}))), owner_uid="u", token="t"
    )
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    return {o["metadata"]["labels"][c.LABEL_ROLE]: o["spec"]["template"] for o in objects if o["kind"] in WORKLOADS}


def pool_pods(cache_size_limit: str | None = None, **model: Any) -> dict[str, dict[str, Any]]:
    doc = pool_doc(**({"cacheSizeLimit": cache_size_limit} if cache_size_limit else {}))
    doc["spec"]["model"] |= model
    objects = builders.build_pool_children(
        plan_pool(pool(**doc["spec"])), owner_uid="u", attachments=Attachments(pool="shared", jobs=[])
    )
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    return {"pool": next(o for o in objects if o["kind"] == "StatefulSet")["spec"]["template"]}


WORKLOADS = ("Job", "StatefulSet")


def container(template: dict[str, Any]) -> dict[str, Any]:
    (only,) = template["spec"]["containers"]
    return only


def env(template: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(template)["env"]}


def volume(template: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((v for v in template["spec"]["volumes"] if v["name"] == name), None)


def mount(template: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((m for m in container(template)["volumeMounts"] if m["name"] == name), None)


def test_no_worker_pod_reads_a_secret_from_its_environment():
    for template in [*job_pods(tokenFrom=HF).values(), *pool_pods(tokenFrom=HF).values()]:
        assert not [e for e in container(template)["env"] if "secretKeyRef" in (e.get("valueFrom") or {})]
        assert "envFrom" not in container(template)


@pytest.mark.parametrize("role", [c.ROLE_TRAINER, c.ROLE_INFERENCE])
def test_the_job_token_is_a_read_only_file_named_by_the_contract(role):
    template = job_pods()[role]
    assert contract.TOKEN not in env(template)
    assert env(template)[contract.TOKEN_FILE] == f"{TOKEN_MOUNT}/{c.TOKEN_SECRET_KEY}"
    assert volume(template, c.TOKEN_VOLUME) == {
        "name": c.TOKEN_VOLUME,
        "secret": {"secretName": "demo-grpolora-token", "items": [{"key": "token", "path": "token"}]},
    }
    assert mount(template, c.TOKEN_VOLUME) == {"name": c.TOKEN_VOLUME, "mountPath": TOKEN_MOUNT, "readOnly": True}


def test_a_pool_server_gets_no_job_token():
    template = pool_pods()["pool"]
    assert contract.TOKEN_FILE not in env(template) and volume(template, c.TOKEN_VOLUME) is None


@pytest.mark.parametrize(
    ("pods", "model", "expected"),
    [
        (job_pods, {}, None),
        (job_pods, {"tokenFrom": HF}, ("hf", "HF_TOKEN")),
        (job_pods, {"tokenFrom": {"secretName": "hf"}}, ("hf", "token")),  # the key's default
        (pool_pods, {}, None),
        (pool_pods, {"tokenFrom": HF}, ("hf", "HF_TOKEN")),
    ],
    ids=["job-none", "job-token", "job-default-key", "pool-none", "pool-token"],
)
def test_the_hub_token_is_a_file_where_hf_token_path_points(pods, model, expected):
    for role, template in pods(**model).items():
        if expected is None:
            assert contract.HUB_TOKEN_PATH not in env(template), role
            assert volume(template, c.HUB_TOKEN_VOLUME) is None, role
            continue
        secret, key = expected
        assert env(template)[contract.HUB_TOKEN_PATH] == HUB_TOKEN_FILE == f"{HUB_TOKEN_MOUNT}/token", role
        assert volume(template, c.HUB_TOKEN_VOLUME) == {
            "name": c.HUB_TOKEN_VOLUME,
            "secret": {"secretName": secret, "items": [{"key": key, "path": "token"}]},
        }, role
        assert mount(template, c.HUB_TOKEN_VOLUME) == {
            "name": c.HUB_TOKEN_VOLUME,
            "mountPath": HUB_TOKEN_MOUNT,
            "readOnly": True,
        }, role


def templates(job: GRPOLoraJob) -> dict[str, dict[str, Any]]:
    objects = builders.build_children(plan(job), owner_uid="u", token="t")
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    return {o["metadata"]["labels"][c.LABEL_ROLE]: o["spec"]["template"] for o in objects if o["kind"] in WORKLOADS}


def cache_and_request(template: dict[str, Any]) -> tuple[str | None, str | None]:
    """The /cache emptyDir's size limit and the container's ephemeral-storage request."""
    cache = volume(template, "cache")
    assert cache is not None and set(cache["emptyDir"]) <= {"sizeLimit"}
    requests = container(template)["resources"].get("requests") or {}
    return cache["emptyDir"].get("sizeLimit"), requests.get("ephemeral-storage")


@pytest.mark.parametrize(
    ("trainer", "inference", "expected"),
    [
        ({}, {}, {"trainer": (None, None), "inference": (None, None)}),
        (
            {"cacheSizeLimit": "40Gi"},
            {"cacheSizeLimit": "30Gi"},
            {"trainer": ("40Gi", "40Gi"), "inference": ("30Gi", "30Gi")},
        ),
        # The role's own request stands: it covers the cache and whatever else the pod writes.
        (
            {"cacheSizeLimit": "40Gi", "resources": {"requests": {"ephemeral-storage": "60Gi"}}},
            {"cacheSizeLimit": "40Gi", "resources": {"requests": {"memory": "8Gi"}}},
            {"trainer": ("40Gi", "60Gi"), "inference": ("40Gi", "40Gi")},
        ),
    ],
    ids=["unsized", "sized", "own-request"],
)
def test_the_model_cache_is_sized_and_its_storage_requested(trainer, inference, expected):
    rendered = templates(parse_job(job_doc(trainer=trainer, inference=inference)))
    assert {role: cache_and_request(t) for role, t in rendered.items()} == expected
    if "memory" in str(inference):
        assert container(rendered["inference"])["resources"]["requests"]["memory"] == "8Gi"


def test_a_pools_servers_get_the_pools_cache_size():
    (template,) = pool_pods(cache_size_limit="20Gi").values()
    assert cache_and_request(template) == ("20Gi", "20Gi")


def test_a_runtime_sizes_the_cache_for_every_job_on_it():
    size = {"cacheSizeLimit": "50Gi"}
    runtime = parse_runtime(runtime_doc(trainer=size, inference=size))
    job = resolve(parse_job(on_runtime()), runtime)
    assert {role: cache_and_request(t) for role, t in templates(job).items()} == {
        "trainer": ("50Gi", "50Gi"),
        "inference": ("50Gi", "50Gi"),
    }
    own = resolve(parse_job(on_runtime(trainer={"cacheSizeLimit": "80Gi"})), runtime)
    assert cache_and_request(templates(own)["trainer"]) == ("80Gi", "80Gi")


@pytest.mark.parametrize(
    ("model", "path", "message"),
    [
        ({}, "spec.trainer.cacheSizeLimit", "is not a Kubernetes quantity"),
        (
            {"tokenFrom": {"secretName": "demo-grpolora-token"}},
            "spec.model.tokenFrom.secretName",
            "name the operator gives its own",
        ),
        ({"tokenFrom": {"secretName": "hf", "key": ""}}, "spec.model.tokenFrom.key", "at least 1 character"),
        ({"tokenFrom": {"name": "hf"}}, "spec.model.tokenFrom", ""),
    ],
    ids=["cache-size-limit", "managed-secret", "empty-key", "unknown-field"],
)
def test_bad_fields_name_the_field(model, path, message):
    with pytest.raises(InvalidJob) as caught:
        parse_job(
            job_doc(
                model={"name": "Qwen/Qwen3-0.6B", **model}, trainer={"cacheSizeLimit": "40 GB"} if not model else {}
            )
        )
    assert path in str(caught.value) and message in str(caught.value), str(caught.value)


def test_the_hub_token_secret_is_among_the_secrets_the_job_names():
    job = parse_job(job_doc(model={"name": "Qwen/Qwen3-0.6B", "tokenFrom": HF}))
    assert ("model.tokenFrom.secretName", "hf") in job.spec.secret_references()


def test_a_pod_template_may_not_mount_over_the_token_files():
    for mount_path in (TOKEN_MOUNT, HUB_TOKEN_MOUNT):
        overlay = {
            "spec": {"containers": [{"name": "trainer", "volumeMounts": [{"name": "x", "mountPath": mount_path}]}]}
        }
        with pytest.raises(InvalidJob, match="set by the operator"):
            parse_job(job_doc(trainer={"podTemplate": overlay}))


def test_workers_read_the_token_from_the_file_and_name_a_missing_one(tmp_path):
    environ = plan(parse_job(job_doc())).env_for("inference", 0, token="local-token")
    assert WorkerEnv.from_environ(environ).token == "local-token"  # `grpolora run` passes it as is
    del environ[contract.TOKEN]
    token_file = tmp_path / "token"
    token_file.write_text("from-the-secret")
    environ[contract.TOKEN_FILE] = str(token_file)
    assert WorkerEnv.from_environ(environ).token == "from-the-secret"
    token_file.unlink()
    with pytest.raises(ContractError, match=f"{contract.TOKEN_FILE}={token_file}: cannot read"):
        WorkerEnv.from_environ(environ)
