"""The Kubernetes fields a job passes through to its pods are checked as the API server would check them."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest

from grpolora.api.kubetypes import SCHEMA_FILE, problems
from grpolora.api.load import InvalidJob, parse_job
from tests.helpers import job_doc
from tests.kube_schema import render
from tests.unit.test_cli import grpolora


def test_the_shipped_schemas_are_a_fresh_extraction_from_kubernetes_validate():
    assert SCHEMA_FILE.read_text() == render(), "regenerate: PYTHONSAFEPATH=1 .venv/bin/python tests/kube_schema.py"


@pytest.mark.parametrize(
    ("spec", "path", "words"),
    [
        ({"trainer": {"tolerations": [{"key": "gpu", "operator": "Bogus"}]}}, "spec.trainer.tolerations[0].operator",
         'Unsupported value: "Bogus"'),
        ({"trainer": {"tolerations": [{"key": "gpu", "efect": "NoSchedule"}]}}, "spec.trainer.tolerations[0].efect",
         'unknown field "efect"'),
        ({"inference": {"tolerations": [{"key": "gpu", "effect": "NoScheduler"}]}},
         "spec.inference.tolerations[0].effect", '"NoSchedule", "PreferNoSchedule", "NoExecute"'),
        ({"trainer": {"resources": {"limits": {"memory": "16 GB"}}}}, "spec.trainer.resources.limits.memory",
         "quantities must match"),
        ({"inference": {"resources": {"limit": {"cpu": "2"}}}}, "spec.inference.resources.limit", "unknown field"),
        ({"trainer": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": "gpu"}]}]}}}}},
         "spec.trainer.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
         ".matchExpressions[0].values", "expected array, got string"),
        ({"trainer": {"env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"nam": "hf"}}}]}},
         "spec.trainer.env[0].valueFrom.secretKeyRef.nam", "unknown field"),
        ({"networkPolicy": {"metricsFrom": [{"podSelector": {"matchLabel": {"app": "prometheus"}}}]}},
         "spec.networkPolicy.metricsFrom[0].podSelector.matchLabel", "unknown field"),
    ],
)  # fmt: skip
def test_a_wrong_kubernetes_field_is_an_error_at_its_path(spec, path, words):
    with pytest.raises(InvalidJob) as caught:
        parse_job(job_doc(**spec))
    found = {p.path: p.message for p in caught.value.problems}
    assert path in found, found
    assert words in found[path]


def test_valid_kubernetes_fields_pass_as_the_api_server_takes_them():
    spec = {
        "trainer": {
            "resources": {"requests": {"cpu": "500m", "memory": "16Gi"}, "limits": {"memory": 17179869184}},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 10, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                   "labelSelector": {"matchLabels": {"a": "b"}}}}]}},
            "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
        },
        "networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]},
    }  # fmt: skip
    parse_job(job_doc(**spec))


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        ({"key": "k", "operator": "Equal", "value": "v", "effect": "NoExecute", "tolerationSeconds": 30}, "Toleration"),
        ({"limits": {"cpu": "1.5", "memory": "1e9"}}, "ResourceRequirements"),
        ({"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}, "EnvVar"),
    ],
)
def test_what_the_kubernetes_schema_accepts_is_accepted(value, type_name):
    assert problems(value, type_name) == []
    # The same value inside a Pod passes kubernetes-validate's strict schema (the source of kubeschema.json).
    container = {"name": "c", "image": "i"}
    pod_spec: dict = {"containers": [container]}
    if type_name == "Toleration":
        pod_spec["tolerations"] = [value]
    elif type_name == "ResourceRequirements":
        container["resources"] = value
    else:
        container["env"] = [value]
    kubernetes_validate.validate(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": pod_spec}, "1.33.0", strict=True
    )


def test_validate_names_the_wrong_toleration_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    doc = job_doc(trainer={"tolerations": [{"key": "gpu", "operator": "Exist"}]})
    bad.write_text(json.dumps(doc))
    result = grpolora("validate", str(bad))
    assert result.returncode != 0
    assert 'spec.trainer.tolerations[0].operator: Unsupported value: "Exist"' in result.stderr + result.stdout


def test_validate_warns_that_a_job_without_a_checkpoint_claim_loses_progress_and_its_final_adapter(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(job_doc()))
    result = grpolora("validate", str(path))
    assert result.returncode == 0
    said = result.stdout + result.stderr
    assert "spec.checkpoint.pvc" in said and "step 0" in said and "final adapter" in said
