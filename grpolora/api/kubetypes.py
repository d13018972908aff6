"""Validate the Kubernetes core types a job passes through to its pods, as the API server would.

`resources`, `tolerations`, `affinity`, `env` and `networkPolicy.metricsFrom` are copied into the trainer Job, the
inference StatefulSet and the NetworkPolicy as written. Left to the API server, a mistake there is found only when
the operator creates those objects; checked here, `grpolora validate` and the operator's reconcile name the field.

Two layers: the Kubernetes OpenAPI schemas of those types (kubeschema.json, extracted from kubernetes-validate's
strict schemas by tests/kube_schema.py: unknown fields, types, required fields), plus the few value rules the API
server enforces in code that matter here (quantities and the resource rules of grpolora.api.quantity, toleration
operators and effects). Other server-side rules
(e.g. a toleration with `operator: Exists` must have no value) are left to the API server; the operator reports
its refusal in the job's status (see grpolora.operator.controller).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from grpolora.api import quantity

KUBERNETES_VERSION: Final = "1.33.0"
SCHEMA_FILE: Final = Path(__file__).with_name("kubeschema.json")
ROOT_TYPES: Final = {
    "ResourceRequirements": "io.k8s.api.core.v1.ResourceRequirements",
    "Toleration": "io.k8s.api.core.v1.Toleration",
    "Affinity": "io.k8s.api.core.v1.Affinity",
    "EnvVar": "io.k8s.api.core.v1.EnvVar",
    "NetworkPolicyPeer": "io.k8s.api.networking.v1.NetworkPolicyPeer",
    "NetworkPolicyEgressRule": "io.k8s.api.networking.v1.NetworkPolicyEgressRule",
    "PodTemplateSpec": "io.k8s.api.core.v1.PodTemplateSpec",
}
# k8s.io/apimachinery/pkg/api/resource: the quantity grammar (number, then a binary, decimal or exponent suffix), for
# the API emulator's message; validation parses with grpolora.api.quantity, as the API server does.
QUANTITY: Final = re.compile(
    r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$"
)
TOLERATION_OPERATORS: Final = ("Equal", "Exists")
TAINT_EFFECTS: Final = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_JSON_TYPES: Final = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": dict,
    "array": list,
}


@functools.cache
def _definitions() -> dict[str, Any]:
    definitions: dict[str, Any] = json.loads(SCHEMA_FILE.read_text())["definitions"]
    return definitions


def problems(value: Any, type_name: str, path: str = "", *, partial: bool = False) -> list[tuple[str, str]]:
    """(path below `path`, message) for each way `value` is not a valid Kubernetes `type_name` (see ROOT_TYPES).

    `partial`: a patch of such an object (required fields may be missing; it is merged over a complete one)."""
    found = list(_walk(value, {"$ref": f"#/$defs/{ROOT_TYPES[type_name]}"}, path, partial))
    if not found:
        found = list(_values(value, type_name, path))
    return found


def _walk(value: Any, schema: dict[str, Any], path: str, partial: bool = False) -> Iterator[tuple[str, str]]:
    if "$ref" in schema:
        yield from _walk(value, _definitions()[schema["$ref"].rsplit("/", 1)[-1]], path, partial)
        return
    if "oneOf" in schema:
        if not any(not list(_walk(value, option, path, partial)) for option in schema["oneOf"]):
            yield path, f"Invalid value: {json.dumps(value)}: must be a string or a number"
        return
    types = schema.get("type")
    if types is not None:
        allowed = [types] if isinstance(types, str) else types
        if value is None:
            if "null" not in allowed:
                yield path, "Required value"
            return
        if not any(_is(value, t) for t in allowed if t != "null"):
            wanted = " or ".join(t for t in allowed if t != "null")
            yield path, f"Invalid value: {json.dumps(value)}: expected {wanted}, got {_json_type(value)}"
            return
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(json.dumps(v) for v in schema["enum"])
        yield path, f"Unsupported value: {json.dumps(value)}: supported values: {supported}"
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for name in [] if partial else schema.get("required", []):
            if name not in value:
                yield _join(path, name), "Required value"
        extra = schema.get("additionalProperties")
        for name, item in value.items():
            if name in properties:
                yield from _walk(item, properties[name], _join(path, name), partial)
            elif isinstance(extra, dict):
                yield from _walk(item, extra, _join(path, name), partial)
            elif extra is False or properties:
                yield _join(path, name), f'unknown field "{name}"'
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            yield from _walk(item, schema["items"], f"{path}[{index}]", partial)


def _values(value: Any, type_name: str, path: str) -> Iterator[tuple[str, str]]:
    """The API server's value rules that the schemas do not carry (only called on schema-valid values)."""
    if type_name == "ResourceRequirements":
        yield from quantity.requirements_problems(value, path)
    elif type_name == "PodTemplateSpec":  # the sidecars' and init containers' resources
        spec = value.get("spec") or {}
        for kind in ("containers", "initContainers"):
            for i, container in enumerate(spec.get(kind) or []):
                resources = container.get("resources") if isinstance(container, dict) else None
                if isinstance(resources, dict):
                    yield from quantity.requirements_problems(resources, _join(path, f"spec.{kind}[{i}].resources"))
    elif type_name == "Toleration":
        operator, effect = value.get("operator"), value.get("effect")
        if operator and operator not in TOLERATION_OPERATORS:
            supported = ", ".join(f'"{o}"' for o in TOLERATION_OPERATORS)
            yield _join(path, "operator"), f'Unsupported value: "{operator}": supported values: {supported}'
        if effect and effect not in TAINT_EFFECTS:
            supported = ", ".join(f'"{e}"' for e in TAINT_EFFECTS)
            yield _join(path, "effect"), f'Unsupported value: "{effect}": supported values: {supported}'


# k8s.io/apimachinery/pkg/util/validation: IsQualifiedName's name part, and a DNS-1123 subdomain as its prefix.
_QUALIFIED_NAME: Final = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
EXTENDED_RESOURCE_PATTERN: Final = (
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$"
)
"""The shape of an extended resource name, for the CRD (RE2 has no look-ahead: the kubernetes.io and `requests.`
exclusions are extended_resource_problem's)."""
REQUESTS_PREFIX: Final = "requests."


def extended_resource_problem(name: str) -> str | None:
    """Why `name` is not an extended resource name (a device plugin's, such as nvidia.com/gpu), or None. The API
    server's rule, pkg/apis/core/helper/helpers.go IsExtendedResourceName: not a native resource (a name without a
    domain, or in the kubernetes.io namespace), not starting with `requests.`, and `requests.<name>` a qualified
    name (a DNS subdomain of at most 253 characters, `/`, a name of at most 63)."""
    if "/" not in name:
        return "has no domain (`vendor.com/gpu`)"
    if "kubernetes.io/" in name:
        return "is in the kubernetes.io namespace, which has no extended resources"
    if name.startswith(REQUESTS_PREFIX):
        return "starts with `requests.`, which resource quotas reserve"
    prefix, _, short = (REQUESTS_PREFIX + name).rpartition("/")
    if not (_DNS_SUBDOMAIN.match(prefix) and len(prefix) <= 253 and _QUALIFIED_NAME.match(short) and len(short) <= 63):
        return "is not an extended resource name (a lower-case DNS domain, `/`, and a name of letters, digits, `-_.`)"
    return None


def _is(value: Any, json_type: str) -> bool:
    if isinstance(value, bool):
        return json_type == "boolean"
    return isinstance(value, _JSON_TYPES.get(json_type, object))


def _json_type(value: Any) -> str:
    return next((t for t in _JSON_TYPES if _is(value, t)), type(value).__name__)


def _join(path: str, name: str) -> str:
    if name.startswith("["):
        return path + name
    return f"{path}.{name}" if path else name
