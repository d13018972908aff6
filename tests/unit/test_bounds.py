"""Every count, size, length, replica number and duration of a job or a pool has a maximum, in the spec and in the
CRD (so that `kubectl apply` refuses `steps: 1.0e+30` as `grpolora validate` does, and CEL cost estimates stay
bounded). The reason for each bound is in grpolora/api/constants.py and in the field's description."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml

from grpolora.api import constants as c
from grpolora.api.crd import crd, pool_crd
from grpolora.api.load import InvalidJob, parse_job, parse_pool
from tests.helpers import job_doc

# Integers that are identifiers or Kubernetes' own fields (bounded by Kubernetes where they land), not amounts.
NOT_AMOUNTS = {
    "spec.grpo.seed",  # any seed is a seed
    "spec.podSecurity.runAsUser",
    "spec.podSecurity.runAsGroup",
    "spec.podSecurity.fsGroup",
    "metadata.generation",
}


def integer_fields(schema: dict, path: str = "") -> Iterator[tuple[str, dict]]:
    if schema.get("type") == "integer":
        yield path, schema
    for name, child in (schema.get("properties") or {}).items():
        yield from integer_fields(child, f"{path}.{name}" if path else name)
    if "items" in schema:
        yield from integer_fields(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from integer_fields(schema["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("kind", [c.KIND, c.POOL_KIND])
def test_every_amount_in_the_crd_has_a_maximum(kind):
    schema = (crd() if kind == c.KIND else pool_crd())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    unbounded = [
        path
        for path, field in integer_fields(schema["properties"]["spec"], "spec")
        if "maximum" not in field and path not in NOT_AMOUNTS and not path.startswith("spec.trainer.podTemplate")
    ]
    assert not unbounded, f"{kind}: integer fields without a maximum: {unbounded}"


@pytest.mark.parametrize(
    ("spec_change", "path", "limit"),
    [
        ({"grpo": {"steps": 1.0e9}}, "spec.grpo.steps", c.MAX_STEPS),
        ({"trainer": {"replicas": 1_000_000}}, "spec.trainer.replicas", c.MAX_REPLICAS),
        ({"inference": {"maxModelLen": 1_000_000_000}}, "spec.inference.maxModelLen", c.MAX_MODEL_LEN),
        ({"grpo": {"maxNewTokens": 100_000_000}}, "spec.grpo.maxNewTokens", c.MAX_MODEL_LEN),
        ({"trainer": {"gpusPerReplica": 64}}, "spec.trainer.gpusPerReplica", c.MAX_GPUS_PER_POD),
    ],
)
def test_a_huge_value_is_refused_naming_the_field_and_the_bound(spec_change, path, limit):
    with pytest.raises(InvalidJob) as refused:
        parse_job(job_doc(**spec_change))
    (problem,) = [p for p in refused.value.problems if p.path == path]
    assert f"less than or equal to {limit}" in problem.message


def test_a_huge_pool_is_refused_too():
    pool = yaml.safe_load(
        "apiVersion: grpolora.dev/v1alpha1\nkind: RolloutPool\nmetadata: {name: p}\n"
        "spec: {model: {name: m}, replicas: 100000, maxJobs: 100000}"
    )
    with pytest.raises(InvalidJob) as refused:
        parse_pool(pool)
    paths = {p.path for p in refused.value.problems}
    assert {"spec.replicas", "spec.maxJobs"} <= paths


def test_a_value_beyond_any_integer_names_the_fields_bound():
    with pytest.raises(InvalidJob) as refused:
        parse_job(job_doc(grpo={"steps": 1.0e30}))
    (problem,) = [p for p in refused.value.problems if p.path == "spec.grpo.steps"]
    assert problem.message == f"1e+30 is far too large; at most {c.MAX_STEPS}"
