"""Pod template overlays: merged over the rendered pod template like a strategic merge patch, never replacing what
the operator sets (a clash names both paths), and schema-valid after the merge."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from grpolora.api.load import InvalidJob, parse_job
from grpolora.api.overlay import MERGE_KEYS, merge
from grpolora.api.plan import plan
from grpolora.operator.builders import build_children
from tests.helpers import job_doc

ROLE_KIND = {"trainer": "Job", "inference": "StatefulSet"}


def template(role: str, **spec: Any) -> dict[str, Any]:
    objects = build_children(plan(parse_job(job_doc(**spec))), owner_uid="u", token="t")
    return next(o for o in objects if o["kind"] == ROLE_KIND[role])["spec"]["template"]


def problems(**spec: Any) -> list[str]:
    try:
        parse_job(job_doc(**spec))
    except InvalidJob as exc:
        return [str(p) for p in exc.problems]
    return []


ISTIO_AND_RDMA = {
    "metadata": {"annotations": {"sidecar.istio.io/inject": "false"}, "labels": {"team": "rl"}},
    "spec": {
        "priorityClassName": "gpu-high",
        "schedulerName": "volcano",
        "serviceAccountName": "trainer-sa",
        "imagePullSecrets": [{"name": "registry"}],
        "volumes": [{"name": "datasets", "persistentVolumeClaim": {"claimName": "datasets"}}],
        "securityContext": {"sysctls": [{"name": "net.core.somaxconn", "value": "1024"}]},
        "containers": [
            {
                "name": "trainer",
                "volumeMounts": [{"name": "datasets", "mountPath": "/data", "readOnly": True}],
                "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
            },
            {"name": "log-shipper", "image": "fluent/fluent-bit:3.0"},
        ],
    },
}


def test_an_overlay_adds_to_the_rendered_template_and_the_result_is_a_valid_job():
    base = template("trainer")
    merged = template("trainer", trainer={"podTemplate": ISTIO_AND_RDMA})
    assert merged["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
    assert merged["metadata"]["labels"] == {**base["metadata"]["labels"], "team": "rl"}
    pod = merged["spec"]
    assert pod["schedulerName"] == "volcano" and pod["priorityClassName"] == "gpu-high"
    assert [v["name"] for v in pod["volumes"]] == [v["name"] for v in base["spec"]["volumes"]] + ["datasets"]
    trainer, shipper = pod["containers"]
    assert trainer["name"] == "trainer" and shipper["name"] == "log-shipper"
    assert trainer["volumeMounts"][-1] == {"name": "datasets", "mountPath": "/data", "readOnly": True}
    assert trainer["volumeMounts"][:-1] == base["spec"]["containers"][0]["volumeMounts"]
    assert trainer["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert [e["name"] for e in trainer["env"]] == [e["name"] for e in base["spec"]["containers"][0]["env"]]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["sysctls"]
    objects = build_children(
        plan(parse_job(job_doc(trainer={"podTemplate": ISTIO_AND_RDMA}))), owner_uid="u", token="t"
    )
    for obj in objects:
        kubernetes_validate.validate(obj, "1.33.0", strict=True)


def test_the_inference_overlay_applies_to_the_statefulset_only():
    merged = template("inference", inference={"podTemplate": {"spec": {"runtimeClassName": "nvidia"}}})
    assert merged["spec"]["runtimeClassName"] == "nvidia"
    assert (
        "runtimeClassName"
        not in template("trainer", inference={"podTemplate": {"spec": {"runtimeClassName": "x"}}})["spec"]
    )


@pytest.mark.parametrize(
    ("overlay", "path", "owner"),
    [
        ({"spec": {"automountServiceAccountToken": True}}, "spec.automountServiceAccountToken", "set by the operator"),
        ({"metadata": {"labels": {"grpolora.dev/role": "x"}}}, "metadata.labels.grpolora.dev/role", "operator"),
        ({"spec": {"nodeSelector": {"pool": "a"}}}, "spec.nodeSelector", "`spec.trainer.nodeSelector`"),
        ({"spec": {"containers": [{"name": "trainer", "image": "x"}]}}, "spec.containers[trainer].image",
         "`spec.trainer.image`"),
        ({"spec": {"containers": [{"name": "trainer", "env": [{"name": "GRPOLORA_TOKEN", "value": "x"}]}]}},
         "spec.containers[trainer].env", "`spec.trainer.env`"),
        ({"spec": {"containers": [{"name": "trainer", "ports": []}]}}, "spec.containers[trainer].ports", "operator"),
        ({"spec": {"volumes": [{"name": "shm", "emptyDir": {}}]}}, "spec.volumes[shm]", "operator"),
        ({"spec": {"containers": [{"name": "trainer", "volumeMounts": [{"name": "d", "mountPath": "/cache"}]}]}},
         "spec.containers[trainer].volumeMounts[/cache]", "operator"),
        ({"spec": {"securityContext": {"runAsUser": 0}}}, "spec.securityContext.runAsUser", "`spec.podSecurity"),
    ],
)  # fmt: skip
def test_a_clash_with_what_the_operator_sets_names_both_paths(overlay, path, owner):
    (problem,) = problems(trainer={"podTemplate": overlay})
    assert problem.startswith("spec.trainer.podTemplate.") and f"`{path}`" in problem and owner in problem


def test_an_overlay_that_is_not_a_pod_template_is_refused_naming_the_field():
    (problem,) = problems(inference={"podTemplate": {"spec": {"containers": [{"name": "x", "imag": "y"}]}}})
    assert problem.startswith("spec.inference.podTemplate.spec.containers[0].imag") and "unknown field" in problem


@pytest.mark.parametrize("role", ["trainer", "inference"])
def test_every_field_the_builders_set_is_owned(role):
    """The ownership table and the builders agree: an overlay that sets any value the operator renders is refused."""
    spec = {
        role: {"nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "k", "operator": "Exists"}],
               "affinity": {"podAffinity": {}}, "env": [{"name": "X", "value": "1"}], "imagePullPolicy": "Always"},
        "podSecurity": {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000},
        "model": {"name": "m", "source": {"pvc": {"claimName": "models"}}},
        "checkpoint": {"pvc": {"claimName": "ckpt"}},
    }  # fmt: skip
    rendered = template(role, **spec)
    for path, overlay in _single_value_overlays(rendered):
        assert problems(**{**spec, role: {**spec[role], "podTemplate": overlay}}), f"{path} can be overridden"


def _single_value_overlays(value: Any, path: str = "") -> Any:
    """(path, an overlay that sets just this rendered value) for every leaf of the rendered template."""
    if isinstance(value, dict):
        for key, item in value.items():
            for sub_path, overlay in _single_value_overlays(item, f"{path}.{key}"):
                yield sub_path, {key: overlay}
    elif isinstance(value, list) and path.rsplit(".", 1)[-1] in MERGE_KEYS:
        merge_key = MERGE_KEYS[path.rsplit(".", 1)[-1]]
        for element in value:
            key_value = element[merge_key]
            for sub_path, overlay in _single_value_overlays(element, f"{path}[{key_value}]"):
                if overlay != {merge_key: key_value}:  # naming the item sets nothing
                    yield sub_path, [{**overlay, merge_key: key_value}]
    else:
        yield path, value


def test_merge_matches_named_items_and_replaces_other_lists():
    base = {"a": [{"name": "x", "v": 1}], "volumes": [{"name": "x", "v": 1}], "m": {"k": 1}}
    merged = merge(base, {"a": [{"name": "y"}], "volumes": [{"name": "x", "w": 2}, {"name": "y"}], "m": {"j": 2}})
    assert merged == {
        "a": [{"name": "y"}],
        "volumes": [{"name": "x", "v": 1, "w": 2}, {"name": "y"}],
        "m": {"k": 1, "j": 2},
    }
