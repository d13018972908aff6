"""The CRD: generated from the models, equal to the shipped file, structural, and accepting our examples."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from grpolora.api.crd import CRD_FILES, PRESERVE, crd, crd_yaml, pool_crd
from grpolora.api.load import parse_job
from grpolora.api.status import (
    AttachedJob,
    Condition,
    FailedAttempt,
    JobStatus,
    PoolStatus,
    RendezvousStatus,
    ReplicaAdapter,
    ReplicaCounts,
    RestartCounts,
    RoleReplicas,
)
from tests.helpers import EXAMPLES, ROOT, job_doc

SHIPPED = ROOT / "crds" / "grpolorajobs.grpolora.dev.yaml"


def schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_shipped_crd_equals_the_generated_one():
    assert SHIPPED.read_text() == crd_yaml(), "regenerate: grpolora crd > crds/grpolorajobs.grpolora.dev.yaml"


def test_crd_is_a_valid_apiextensions_object():
    kubernetes_validate.validate(crd(), "1.33.0", strict=True)


def test_identity_and_printer_columns():
    spec = crd()["spec"]
    assert spec["group"] == "grpolora.dev" and spec["scope"] == "Namespaced"
    assert spec["names"]["plural"] == "grpolorajobs" and spec["names"]["shortNames"] == ["glj"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"]["status"] == {}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"] if not c.get("priority")}
    assert columns == {
        "Phase": ".status.phase",
        "Reason": ".status.reason",
        "Step": ".status.progress",
        "SyncRound": ".status.syncRound",
        "Reward": ".status.rewardMean",
        "Ready": ".status.ready",
        "Restarts": ".status.trainerRestarts",
        "Age": ".metadata.creationTimestamp",
    }
    wide = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"] if c.get("priority") == 1}
    assert wide == {"Epoch": ".status.rendezvous.epoch", "Message": ".status.message"}


def walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural_and_documented():
    for path, node in walk(schema()["properties"]["spec"], "spec"):
        if not path.endswith(("[]", "{}")):
            assert node.get("description"), f"{path} has no description (kubectl explain shows nothing)"
        assert "type" in node or node.get(PRESERVE), f"{path} has no type"
        for bad in ("anyOf", "oneOf", "allOf", "$ref", "title", "const"):
            assert bad not in node, f"{path} uses {bad}"


def openapi_validator(subschema: dict[str, Any]) -> jsonschema.Draft4Validator:
    # OpenAPI v3.0 schemas use draft-4 semantics (boolean exclusiveMinimum); x-kubernetes-* keys are ignored.
    return jsonschema.Draft4Validator(subschema)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_the_crd_schema(path):
    for doc in yaml.safe_load_all(path.read_text()):
        if doc["kind"] == "GRPOLoraJob":  # a claim the job names may come beside it
            openapi_validator(schema()).validate(doc)


def test_crd_schema_rejects_what_the_model_rejects():
    with pytest.raises(jsonschema.ValidationError):
        openapi_validator(schema()).validate(job_doc(lora={"rank": 0}))
    with pytest.raises(jsonschema.ValidationError):
        openapi_validator(schema()).validate(job_doc(grpo={"generationsPerPrompt": 1}))


def pruned(value: Any, node: dict[str, Any]) -> Any:
    """What the API server keeps of `value` under a structural schema (unknown fields are dropped)."""
    if node.get(PRESERVE):
        return value
    if isinstance(value, dict):
        if "properties" in node:
            return {k: pruned(v, node["properties"][k]) for k, v in value.items() if k in node["properties"]}
        if isinstance(node.get("additionalProperties"), dict):
            return {k: pruned(v, node["additionalProperties"]) for k, v in value.items()}
        return {}
    if isinstance(value, list):
        return [pruned(v, node.get("items", {})) for v in value]
    return value


def test_everything_the_operator_writes_to_status_survives_pruning():
    status = JobStatus(
        phase="Running",
        message="training",
        reason="Training",
        progress="3/10",
        ready="3/3",
        observed_generation=2,
        step=3,
        steps_lost=2,
        total_steps=10,
        sync_round=3,
        last_sync_time="2026-01-01T00:00:00Z",
        last_sync_seconds=0.2,
        last_sync_bytes=123,
        reward_mean=0.5,
        kl=0.01,
        mismatch=0.001,
        eval_reward=0.4,
        adapter_path="/var/lib/grpolora/output/final-adapter",
        last_push="s3://bucket/run/step-000002/",
        last_push_step=2,
        push_error="spec.output.push.s3: 403 Forbidden",
        staleness=1,
        dropped_stale=0,
        prompts_skipped=2,
        trainer_restarts=0,
        restarts_by_cause=RestartCounts(failure=1, disruption=2),
        trainer_incarnation=3,
        last_failed_attempt=FailedAttempt(
            attempt=2, pod="p", exit_code=1, reason="Error", finished_at="2026-01-01T00:30:00Z", log_tail="a\nb"
        ),
        start_time="2026-01-01T00:00:00Z",
        completion_time="2026-01-01T01:00:00Z",
        active_since="2026-01-01T00:00:00Z",
        conditions=[
            Condition(
                type="Progressing",
                status="True",
                reason="Training",
                message="m",
                last_transition_time="2026-01-01T00:00:00Z",
                observed_generation=2,
            )
        ],
        replicas=ReplicaCounts(),
        pool="shared",
        token_digest="0123456789abcdef",
        rendezvous=RendezvousStatus(
            master_addr="a",
            master_port=1,
            trainer_world_size=1,
            sync_addr="a",
            sync_port=2,
            sync_world_size=3,
            sync_backend="gloo",
            epoch=1,
            inference_endpoints=["http://x:8000"],
        ),
    ).to_wire()
    status["kopf"] = {"progress": {"handler": {"retries": 1}}}
    status_schema = schema()["properties"]["status"]
    assert pruned(status, status_schema) == status
    openapi_validator(status_schema).validate(status)
    # The example above sets every status field, so this covers all of them.
    assert {field.alias for field in JobStatus.model_fields.values()} <= set(status)


def test_spec_fields_survive_pruning():
    spec = parse_job(
        job_doc(
            trainer={
                "tolerations": [{"key": "k", "operator": "Exists"}],
                "affinity": {
                    "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}
                },
            }
        )
    ).spec.to_wire()
    assert pruned(spec, schema()["properties"]["spec"]) == spec


# ---- RolloutPool ---------------------------------------------------------------------------------------------

POOL_EXAMPLE = ROOT / "examples" / "pool" / "qwen3-shared-pool.yaml"


def pool_schema() -> dict[str, Any]:
    return pool_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_both_shipped_crds_equal_the_generated_ones():
    for kind, file in CRD_FILES.items():
        assert (ROOT / "crds" / file).read_text() == crd_yaml(kind), "regenerate: make crd"
    assert sorted(p.name for p in (ROOT / "crds").glob("*.yaml")) == sorted(CRD_FILES.values())


def test_pool_crd_is_a_valid_apiextensions_object_with_its_identity_and_columns():
    kubernetes_validate.validate(pool_crd(), "1.33.0", strict=True)
    spec = pool_crd()["spec"]
    assert pool_crd()["metadata"]["name"] == "rolloutpools.grpolora.dev"
    assert spec["group"] == "grpolora.dev" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "RolloutPool" and spec["names"]["shortNames"] == ["rpool"]
    assert spec["names"]["categories"] == ["all", "grpolora"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"]["status"] == {}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"] if not c.get("priority")}
    assert columns == {
        "Ready": ".status.replicas.ready",
        "Jobs": ".status.jobs",
        "Waiting": ".status.waiting",
        "Tokens/s": ".status.tokensPerSecond",
        "Age": ".metadata.creationTimestamp",
    }


def test_pool_schema_is_structural_and_takes_the_example_and_refuses_what_the_model_refuses():
    for path, node in walk(pool_schema()):
        assert node.get("type") or node.get(PRESERVE), f"{path or '<root>'} has no type"
    doc = yaml.safe_load(POOL_EXAMPLE.read_text())
    openapi_validator(pool_schema()).validate(doc)
    with pytest.raises(jsonschema.ValidationError):
        openapi_validator(pool_schema()).validate({**doc, "spec": {**doc["spec"], "maxJobs": 0}})
    rules = [r["rule"] for r in pool_schema()["x-kubernetes-validations"]]
    assert any("metadata.name.matches" in rule for rule in rules)


def test_everything_the_operator_writes_to_a_pool_status_survives_pruning():
    status = PoolStatus(
        message="2/4 jobs attached",
        observed_generation=1,
        conditions=[
            Condition(type="Ready", status="True", reason="AllReady", last_transition_time="2026-01-01T00:00:00Z")
        ],
        replicas=RoleReplicas(desired=2, ready=1),
        selector="grpolora.dev/pool=shared,grpolora.dev/role=inference",
        attached_jobs=[
            AttachedJob(
                job="rl/a", uid="u", token_digest="0123", adapter_versions=[ReplicaAdapter(replica=0, live_version=3)]
            )
        ],
        waiting_jobs=["rl/b"],
        jobs="1/4",
        waiting=1,
        slots_in_use=2,
        slots=8,
        tokens_per_second=1234.5,
    ).to_wire()
    status_schema = pool_schema()["properties"]["status"]
    assert pruned(status, status_schema) == status
    openapi_validator(status_schema).validate(status)
    assert {field.alias for field in PoolStatus.model_fields.values()} <= set(status)


POOL_UPDATES: list[tuple[str, dict[str, Any], bool]] = [
    ("replicas up", {"replicas": 3}, True),
    ("replicas down", {"replicas": 1}, True),
    ("replicas back to the default", {"replicas": None}, True),
    ("maxJobs", {"maxJobs": 9}, False),
    ("adaptersPerJob", {"adaptersPerJob": 3}, False),
    ("the model", {"model": {"name": "Qwen/Qwen3-1.7B", "dtype": "bfloat16"}}, False),
    ("a field added", {"maxModelLen": 4096}, False),
    ("a field removed", {"maxLoraRank": None}, False),
    ("replicas and maxJobs", {"replicas": 3, "maxJobs": 9}, False),
]


@pytest.mark.parametrize(
    ("change", "allowed"), [(c, a) for _, c, a in POOL_UPDATES], ids=[i for i, _, _ in POOL_UPDATES]
)
def test_only_a_pools_replicas_can_change_its_servers_run_with_the_rest(change: dict[str, Any], allowed: bool):
    from grpolora.testing.kube_apiserver import cel_violations

    doc = yaml.safe_load(POOL_EXAMPLE.read_text())
    spec = {**doc["spec"], **change}
    changed = {**doc, "spec": {k: v for k, v in spec.items() if v is not None}}
    assert cel_violations(pool_schema(), doc, doc) == []
    violations = cel_violations(pool_schema(), changed, doc)
    if allowed:
        assert violations == []
    else:
        ((path, message),) = violations
        assert path == "spec" and "only spec.replicas" in message and "delete and re-create" in message
    assert cel_violations(pool_schema(), changed) == []  # a create has no old object


def test_a_pool_has_the_scale_subresource_so_kubectl_scale_works():
    """`kubectl scale rolloutpool/x --replicas=3` (and an HPA) writes spec.replicas through /scale; it reads the
    replicas the pool has from status.replicas.ready, and an HPA the pods' selector from status.selector."""
    version = pool_crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas.ready",
        "labelSelectorPath": ".status.selector",
    }
    selector = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["selector"]
    assert selector["type"] == "string"  # apiextensions-apiserver requires a string there
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["replicas"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["replicas"]
    assert spec["type"] == "integer" and status["properties"]["ready"]["type"] == "integer"
