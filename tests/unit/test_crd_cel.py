"""The CRD's CEL rules (x-kubernetes-validations), evaluated with a real CEL evaluator (cel-python), agree with the
Python validation: every object the model refuses for a cross-field rule, `kubectl apply` refuses too, and no
valid object is refused."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from grpolora.api.crd import crd
from grpolora.api.load import InvalidJob, parse_job
from grpolora.api.spec import GRPOSpec, max_job_name_length
from grpolora.operator.job_view import changed_fields
from grpolora.testing.kube_apiserver import cel_rules, cel_violations
from tests.helpers import EXAMPLES, job_doc


def schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def python_valid(doc: dict[str, Any]) -> bool:
    try:
        parse_job(doc)
    except InvalidJob:
        return False
    return True


def named(name: str) -> dict[str, Any]:
    doc = job_doc()
    doc["metadata"]["name"] = name
    return doc


LONGEST = max_job_name_length()
# (document, valid): each cross-field rule both ways, including fields left to their defaults.
CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("defaults", job_doc(), True),
    ("tp is the replica's gpus", job_doc(inference={"gpusPerReplica": 4, "tensorParallelSize": 4}), True),
    ("tp below the gpus: data parallel", job_doc(inference={"gpusPerReplica": 4, "tensorParallelSize": 2}), False),
    ("tp does not divide gpus", job_doc(inference={"gpusPerReplica": 4, "tensorParallelSize": 3}), False),
    ("tp > default gpus", job_doc(inference={"tensorParallelSize": 2}), False),
    ("cpu replicas with tp 2", job_doc(inference={"gpusPerReplica": 0, "tensorParallelSize": 2}), False),
    ("cpu replicas", job_doc(inference={"gpusPerReplica": 0}), True),
    ("nccl with gpus", job_doc(sync={"backend": "nccl"}), True),
    ("nccl, cpu trainer", job_doc(sync={"backend": "nccl"}, trainer={"gpusPerReplica": 0}), False),
    ("nccl, cpu inference", job_doc(sync={"backend": "nccl"}, inference={"gpusPerReplica": 0}), False),
    ("gloo on cpu", job_doc(sync={"backend": "gloo"}, trainer={"gpusPerReplica": 0}), True),
    ("status port = master port", job_doc(trainer={"statusPort": 29500}), False),
    ("sync port = status port", job_doc(sync={"port": 8080}), False),
    ("master port = sync port", job_doc(trainer={"masterPort": 29600}), False),
    ("ports moved apart", job_doc(trainer={"masterPort": 29600}, sync={"port": 29700}), True),
    ("staleness 2, default slots", job_doc(grpo={"maxStaleness": 2}), False),
    ("staleness 2, 3 slots", job_doc(grpo={"maxStaleness": 2}, inference={"maxLoras": 3}), True),
    ("pipelined, default slots", job_doc(grpo={"pipelined": True}), True),
    ("pipelined and staleness 1", job_doc(grpo={"pipelined": True, "maxStaleness": 1}), True),
    ("pipelined and staleness 0", job_doc(grpo={"pipelined": True, "maxStaleness": 0}), False),
    (
        "pipelined and staleness 2",
        job_doc(grpo={"pipelined": True, "maxStaleness": 2}, inference={"maxLoras": 3}),
        False,
    ),
    ("reference on the replicas", job_doc(grpo={"referenceFrom": "inference"}), True),
    ("reference on the replicas, temperature 1", job_doc(grpo={"referenceFrom": "inference", "temperature": 1}), True),
    (
        "reference on the replicas, temperature 0.7",
        job_doc(grpo={"referenceFrom": "inference", "temperature": 0.7}),
        False,
    ),
    ("reference on the replicas, topP 0.9", job_doc(grpo={"referenceFrom": "inference", "topP": 0.9}), False),
    ("reference on the replicas, topK 20", job_doc(grpo={"referenceFrom": "inference", "topK": 20}), False),
    ("reference on the replicas, topK 0", job_doc(grpo={"referenceFrom": "inference", "topK": 0}), True),
    ("reference on the trainer, temperature 0.7", job_doc(grpo={"referenceFrom": "trainer", "temperature": 0.7}), True),
    ("64 mini-batches of the default 64 completions", job_doc(grpo={"miniBatches": 64}), True),
    ("65 mini-batches of the default 64 completions", job_doc(grpo={"miniBatches": 65}), False),
    ("4 mini-batches of 2 x 2", job_doc(grpo={"promptsPerStep": 2, "generationsPerPrompt": 2, "miniBatches": 4}), True),
    (
        "5 mini-batches of 2 x 2",
        job_doc(grpo={"promptsPerStep": 2, "generationsPerPrompt": 2, "miniBatches": 5}),
        False,
    ),
    ("warmup of the default 100 steps", job_doc(grpo={"warmupSteps": 100}), True),
    ("warmup past the default 100 steps", job_doc(grpo={"warmupSteps": 101}), False),
    ("warmup past 10 steps", job_doc(grpo={"steps": 10, "warmupSteps": 11}), False),
    ("overlong buffer of the default 256 tokens", job_doc(grpo={"overlongBuffer": 256}), True),
    ("overlong buffer past the default 256 tokens", job_doc(grpo={"overlongBuffer": 257}), False),
    ("overlong buffer past 64 tokens", job_doc(grpo={"maxNewTokens": 64, "overlongBuffer": 65}), False),
    # spec.environment: one kind of environment; a service's settings only with its url.
    ("a built-in environment", job_doc(environment={"builtin": "calculator"}), True),
    ("an environment service", job_doc(environment={"url": "http://env:8000", "retries": 0}), True),
    ("two kinds of environment", job_doc(environment={"builtin": "calculator", "plugin": "a:b"}), False),
    ("no kind of environment", job_doc(environment={"maxTurns": 3}), False),
    ("retries of a built-in", job_doc(environment={"builtin": "calculator", "retries": 0}), False),
    ("retries of a built-in, the default", job_doc(environment={"builtin": "calculator", "retries": 2}), True),
    ("headers of a plugin", job_doc(environment={"plugin": "a:b", "headersFrom": {"secretName": "s"}}), False),
    # ... and environment processes' settings only without one (a service runs its own).
    ("processes of a plugin", job_doc(environment={"plugin": "a:b", "processes": 8}), True),
    ("processes of a service", job_doc(environment={"url": "http://env:8000", "processes": 8}), False),
    ("processes of a service, the default", job_doc(environment={"url": "http://env:8000", "processes": 4}), True),
    ("process memory of a service", job_doc(environment={"url": "http://env:8000", "processMemoryMiB": 512}), False),
    # An agent runs in the environment processes; a server the operator runs is a service (issue 48).
    ("an agent", job_doc(environment={"agent": "a:b", "processes": 8}), True),
    ("an agent and a plugin", job_doc(environment={"agent": "a:b", "plugin": "a:c"}), False),
    ("a served plugin", job_doc(environment={"plugin": "a:b", "server": {"replicas": 2}, "retries": 0}), True),
    ("a server of its own", job_doc(environment={"server": {"command": ["env-server"]}}), True),
    ("a server with nothing to serve", job_doc(environment={"server": {"replicas": 2}}), False),
    ("an agent's sandbox without a command", job_doc(environment={"agent": "a:b", "server": {"replicas": 1}}), False),
    ("an agent's sandbox", job_doc(environment={"agent": "a:b", "server": {"command": ["sandbox"]}}), True),
    ("a url and a server", job_doc(environment={"url": "http://env:8000", "server": {"command": ["s"]}}), False),
    ("processes of a served plugin", job_doc(environment={"plugin": "a:b", "server": {}, "processes": 8}), False),
    ("retries of an agent", job_doc(environment={"agent": "a:b", "retries": 0}), False),
    # spec.task: a chat template from the spec or from a ConfigMap, not both.
    ("a chat template from a ConfigMap", job_doc(task={"name": "arithmetic", "chatTemplateFrom": {"name": "t",
     "key": "k"}}), True),
    ("a chat template twice", job_doc(task={"name": "arithmetic", "chatTemplate": "qwen3", "chatTemplateFrom": {
     "name": "t", "key": "k"}}), False),
    # A job on a pool: its serving fields are the pool's (fit is checked when it attaches, not at apply).
    ("on a pool", job_doc(inference={"poolRef": {"name": "shared"}}), True),
    ("on a pool, staleness 3", job_doc(inference={"poolRef": {"name": "shared"}}, grpo={"maxStaleness": 3}), True),
    ("on a pool with nccl", job_doc(inference={"poolRef": {"name": "shared"}}, sync={"backend": "nccl"}), True),
    ("on a pool with replicas", job_doc(inference={"poolRef": {"name": "shared"}, "replicas": 2}), False),
    ("on a pool with maxLoras", job_doc(inference={"poolRef": {"name": "shared"}, "maxLoras": 4}), False),
    ("longest name", named("a" * LONGEST), True),
    ("name one too long", named("a" * (LONGEST + 1)), False),
    ("name with capitals", named("Demo"), False),
    ("name starting with a digit", named("1demo"), False),
    # No Secret a job names may be one of the operator's (a job's token, a pool's attachment list).
    ("a user's Secret", job_doc(tracking={"mlflow": {"trackingUri": "http://m", "secretName": "mlflow"}}), True),
    ("a user's token Secret", job_doc(tracking={"wandb": {"project": "p", "secretName": "hf-token"}}), True),
    ("another job's token", job_doc(tracking={"wandb": {"project": "p", "secretName": "other-grpolora-token"}}), False),
    (
        "a pool's attachment list",
        job_doc(output={"push": {"s3": {"url": "s3://b/x", "secretName": "shared-pool-jobs"}}}),
        False,
    ),
]


@pytest.mark.parametrize(("doc", "valid"), [(d, v) for _, d, v in CASES], ids=[i for i, _, _ in CASES])
def test_cel_rules_agree_with_the_python_validation(doc: dict[str, Any], valid: bool):
    assert python_valid(doc) == valid
    violations = cel_violations(schema(), doc)
    assert (not violations) == valid, violations


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_the_cel_rules(path):
    import yaml

    for doc in yaml.safe_load_all(path.read_text()):
        assert cel_violations(schema(), doc) == []


def test_generations_per_prompt_is_a_schema_bound_not_a_rule():
    """Not cross-field: the schema's minimum carries it, from the same Field(ge=2)."""
    field = schema()["properties"]["spec"]["properties"]["grpo"]["properties"]["generationsPerPrompt"]
    bound = next(m.ge for m in GRPOSpec.model_fields["generations_per_prompt"].metadata if hasattr(m, "ge"))
    assert field["minimum"] == bound == 2


def created(doc: dict[str, Any], status: str = "True") -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    doc["status"] = {"conditions": [{"type": "Created", "status": status, "reason": "r", "message": "",
                                     "lastTransitionTime": "2026-01-01T00:00:00Z"}]}  # fmt: skip
    return doc


UPDATES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("suspend", {"suspend": True}, {}),
    ("ttl", {"ttlSecondsAfterFinished": 60}, {}),
    ("model", {"model": {"name": "Qwen/Qwen3-1.7B"}}, {}),
    ("a nested field", {"grpo": {"steps": 5}}, {"grpo": {"steps": 6}}),
    ("a section added", {"lora": {"rank": 8}}, {}),
    ("a toleration", {"trainer": {"tolerations": [{"key": "a", "operator": "Exists"}]}}, {}),
]


@pytest.mark.parametrize(("change", "before"), [(c, b) for _, c, b in UPDATES], ids=[i for i, _, _ in UPDATES])
def test_immutability_rule_agrees_with_the_operator_once_children_exist(change, before):
    old, new = job_doc(**before), job_doc(**before)
    new["spec"].update(change)
    refused_by_operator = bool(changed_fields(parse_job(old).spec.to_wire(), parse_job(new).spec.to_wire()))
    assert bool(cel_violations(schema(), created(new), created(old))) == refused_by_operator
    # Before the children exist (no Created condition, or Created False) any valid change applies.
    assert cel_violations(schema(), new, old) == []
    assert cel_violations(schema(), created(new, "False"), created(old, "False")) == []


def test_every_rule_is_exercised_both_ways():
    """A rule that never fails above (or never passes) is untested."""
    failed = {rule for _, doc, _ in CASES for rule in cel_violations(schema(), doc, rules_only=True)}
    failed |= {
        rule
        for _, change, before in UPDATES
        for rule in cel_violations(
            schema(), created(job_doc(**before) | {"spec": {**job_doc(**before)["spec"], **change}}),
            created(job_doc(**before)), rules_only=True,
        )
    }  # fmt: skip
    assert failed == {r["rule"] for r in cel_rules(schema())}
    assert cel_violations(schema(), job_doc()) == []
