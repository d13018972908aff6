"""What a real API server refuses, for the emulator: schema validation, a few value rules, owner-reference admission.

- Built-in kinds are validated against the Kubernetes 1.33 OpenAPI schemas that kubernetes-validate carries (strict,
  i.e. unknown fields refused, when the request asks for `fieldValidation=Strict` as kubectl and the operator do;
  a real server drops unknown fields otherwise, and so does nothing here). A schema failure answers 400 BadRequest.
- A few rules the API server enforces in Go code rather than in its schema answer 422 Invalid with the server's
  wording: tolerations (operator and effect values, `Exists` with a value, a key-less `Equal`), resource quantities,
  env var names. Only these; anything else a real server would refuse in code passes here.
- GRPOLoraJobs are validated against the CRD's openAPIV3Schema (422 Invalid, with the field path); unknown fields are
  refused under `fieldValidation=Strict` and pruned otherwise, as a real server does. The CRD's CEL rules
  (`x-kubernetes-validations`) are evaluated with cel-python on writes of the spec, transition rules (those that
  read `oldSelf`) on updates only, as a real server does; a rule that fails to evaluate refuses the object.
- OwnerReferencesPermissionEnforcement: setting `blockOwnerDeletion: true` needs `update` on the owner's
  `finalizers` subresource (403 Forbidden otherwise).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kmock
import kubernetes_validate
from referencing import Registry, Resource

from grpolora.api import constants as c
from grpolora.api import quantity
from grpolora.api.crd import CRDS

KUBERNETES_VERSION = "1.33.0"
# pkg/apis/core/validation: IsEnvVarName (a C identifier, plus '-' and '.').
ENV_VAR_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


class Refused(kmock.KubernetesError):
    """An API refusal, rendered by kmock as a metav1.Status with this code, reason and message."""


def invalid(obj: Mapping[str, Any], causes: list[tuple[str, str]]) -> Refused:
    """422 Invalid, worded as the API server words it: `<Kind>.<group> "<name>" is invalid: <path>: <detail>`."""
    kind, group = obj.get("kind", ""), str(obj.get("apiVersion", "")).rpartition("/")[0]
    qualified = f"{kind}.{group}" if group else kind
    details = [f"{path}: {detail}" for path, detail in causes]
    listed = details[0] if len(details) == 1 else "[" + ", ".join(details) + "]"
    name = (obj.get("metadata") or {}).get("name", "")
    return Refused(
        status=422,
        reason="Invalid",
        message=f'{qualified} "{name}" is invalid: {listed}',
        details={"name": name, "kind": kind, "causes": [{"field": p, "message": d} for p, d in causes]},
    )


def bad_request(message: str) -> Refused:
    return Refused(status=400, reason="BadRequest", message=message, details={})


def not_served() -> Refused:
    """404 for a resource the API server does not serve (its CRD is not installed)."""
    return Refused(
        status=404, reason="NotFound", message="the server could not find the requested resource", details={}
    )


def conflict(plural: str, group: str, name: str) -> Refused:
    """409 Conflict, as the API server answers a write whose resourceVersion precondition no longer holds."""
    resource = f"{plural}.{group}" if group else plural
    message = (
        f'Operation cannot be fulfilled on {resource} "{name}": the object has been modified; please apply your '
        "changes to the latest version and try again"
    )
    return Refused(status=409, reason="Conflict", message=message, details={"name": name, "kind": plural})


def forbidden(resource: str, name: str, message: str) -> Refused:
    return Refused(status=403, reason="Forbidden", message=f'{resource} "{name}" is forbidden: {message}', details={})


# ---- built-in kinds ----------------------------------------------------------------------------------------


@functools.cache
def _builtin_validator(kind: str, api_version: str, strict: bool) -> jsonschema.Draft202012Validator | None:
    """kubernetes-validate's schema for this kind, compiled once (its own validate() reloads it on every call)."""
    folder = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    folder /= f"v{KUBERNETES_VERSION}-local" + ("-strict" if strict else "")
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)  # batch/v1 -> batch-v1, as it names files
    schema_file = folder / f"{kind.lower()}-{group_version}.json"
    if not schema_file.exists():
        return None
    schema = json.loads(schema_file.read_text())
    definitions = json.loads((folder / "_definitions.json").read_text())
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate_builtin(obj: Mapping[str, Any], *, strict: bool) -> None:
    validator = _builtin_validator(str(obj.get("kind", "")), str(obj.get("apiVersion", "")), strict)
    error = jsonschema.exceptions.best_match(validator.iter_errors(dict(obj))) if validator is not None else None
    if error is not None:
        exc = error
        path = _path(exc.path)
        kind = obj.get("kind")
        if strict and "Additional properties" in exc.message:
            field = re.findall(r"'([^']+)' was unexpected", exc.message)
            where = ".".join(p for p in (path, *field) if p)
            raise bad_request(f'strict decoding error: unknown field "{where}"')
        raise bad_request(f'{kind} in version "v1" cannot be handled as a {kind}: {path}: {exc.message}')
    causes = list(_go_rules(obj))
    if causes:
        raise invalid(obj, causes)


def _go_rules(obj: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """pkg/apis/core/validation rules for the pod specs in Pods, Jobs and StatefulSets (the ones listed above)."""
    spec = obj.get("spec") or {}
    if obj.get("kind") == "Pod":
        pod, prefix = spec, "spec"
    elif obj.get("kind") in ("Job", "StatefulSet"):
        pod, prefix = (spec.get("template") or {}).get("spec") or {}, "spec.template.spec"
    else:
        return
    for i, toleration in enumerate(pod.get("tolerations") or []):
        yield from _toleration(toleration, f"{prefix}.tolerations[{i}]")
    for i, container in enumerate(pod.get("containers") or []):
        where = f"{prefix}.containers[{i}]"
        # ValidateResourceRequirements (grpolora.api.quantity, which `validate` applies to the spec): paths as the
        # API server names them, `limits[memory]`, and `requests` for a request against its limit.
        for path, detail in quantity.requirements_problems(container.get("resources") or {}):
            section, _, resource = path.partition(".")
            against_limit = section == "requests" and " limit of " in detail
            yield f"{where}.resources.{section}" + ("" if against_limit else f"[{resource}]"), detail
        for j, var in enumerate(container.get("env") or []):
            if not ENV_VAR_NAME.match(var.get("name") or ""):
                yield (
                    f"{where}.env[{j}].name",
                    f"Invalid value: {json.dumps(var.get('name'))}: a valid environment variable name must consist "
                    "of alphabetic characters, digits, '_', '-', or '.', and must not start with a digit",
                )


def _toleration(toleration: Mapping[str, Any], where: str) -> Iterator[tuple[str, str]]:
    key, operator, value, effect = (toleration.get(k) for k in ("key", "operator", "value", "effect"))
    operator = operator or "Equal"
    if operator not in ("Equal", "Exists"):
        yield f"{where}.operator", f'Unsupported value: "{operator}": supported values: "Equal", "Exists"'
    if not key and operator != "Exists":
        yield f"{where}.operator", f'Invalid value: "{operator}": operator must be Exists when `key` is empty, ' \
            "which means \"match all values and all keys\""  # fmt: skip
    if operator == "Exists" and value:
        yield f"{where}.operator", f"Invalid value: {json.dumps(value)}: value must be empty when `operator` is " \
            "'Exists'"  # fmt: skip
    if effect and effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
        yield (
            f"{where}.effect",
            f'Unsupported value: "{effect}": supported values: "NoExecute", "NoSchedule", "PreferNoSchedule"',
        )
    if toleration.get("tolerationSeconds") is not None and effect != "NoExecute":
        yield f"{where}.effect", f"Invalid value: {json.dumps(effect)}: effect must be 'NoExecute' when " \
            "`tolerationSeconds` is set"  # fmt: skip


# ---- the GRPOLoraJob CRD ----------------------------------------------------------------------------------


def crd_schema(kind: str = c.KIND) -> dict[str, Any]:
    """The openAPIV3Schema of the GRPOLoraJob (or RolloutPool) CRD."""
    schema: dict[str, Any] = CRDS[kind]()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def crd_scale_paths(kind: str) -> dict[str, str] | None:
    """The CRD's scale subresource (specReplicasPath, statusReplicasPath, labelSelectorPath), or None where it has
    none."""
    scale: dict[str, str] | None = CRDS[kind]()["spec"]["versions"][0]["subresources"].get("scale")
    return scale


def validate_custom(
    obj: dict[str, Any], schema: Mapping[str, Any], *, strict: bool, part: str, old: Mapping[str, Any] | None = None
) -> None:
    """Validate `obj[part]` ('spec' or 'status') as the API server does; prune unknown fields unless strict. Writes
    of the spec also run the CEL rules (`old`: the stored object, on updates)."""
    if part not in obj:
        return
    sub_schema = schema["properties"][part]
    unknown = list(_unknown(obj[part], sub_schema, part))
    if unknown and strict:
        raise bad_request("strict decoding error: " + ", ".join(f'unknown field "{p}"' for p in unknown))
    # As the API server: pruned, then defaulted (a field with a schema `default:` absent from an object that is
    # there gets that default), then validated.
    obj[part] = _defaulted(_pruned(obj[part], sub_schema), sub_schema)
    validator = jsonschema.Draft4Validator(sub_schema)  # openAPIV3Schema is close to draft 4 (boolean exclusive bounds)
    errors = sorted(validator.iter_errors(obj[part]), key=lambda e: list(e.path))
    if errors:
        raise invalid(obj, [(_path([part, *e.path]), _detail(e)) for e in errors])
    violations = cel_violations(schema, obj, old) if part == "spec" else []
    if violations:
        raise invalid(obj, violations)


# ---- CEL rules -------------------------------------------------------------------------------------------------

CEL_KEY = "x-kubernetes-validations"


def cel_rules(schema: Mapping[str, Any]) -> Iterator[dict[str, str]]:
    """Every rule in the schema."""
    yield from schema.get(CEL_KEY) or []
    for child in (schema.get("properties") or {}).values():
        yield from cel_rules(child)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from cel_rules(schema[key])


def cel_violations(
    schema: Mapping[str, Any],
    new: Any,
    old: Any = None,
    path: str = "",
    *,
    rules_only: bool = False,
) -> list[Any]:
    """The CEL rules `new` breaks, as (field path, detail) in the API server's wording (or the rules themselves with
    `rules_only`). `old` is the stored object on an update; rules that read `oldSelf` run only where it exists."""
    found: list[Any] = []
    for rule in schema.get(CEL_KEY) or []:
        transition = "oldSelf" in rule["rule"]
        if transition and old is None:
            continue
        activation = {"self": celpy.json_to_cel(new)}
        if transition:
            activation["oldSelf"] = celpy.json_to_cel(old)
        try:
            result = _cel_program(rule["rule"]).evaluate(activation)
        except celpy.CELEvalError as exc:
            result = exc
        if result is True or (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            continue
        where = path + rule.get("fieldPath", "") if path or rule.get("fieldPath") else "<nil>"
        message = rule["message"] if not isinstance(result, celpy.CELEvalError) else f"rule failed: {result}"
        kind = "object" if isinstance(new, dict) else type(new).__name__
        found.append(rule["rule"] if rules_only else (where.lstrip("."), f'Invalid value: "{kind}": {message}'))
    if isinstance(new, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, value in new.items():
            child = properties.get(key, extra if isinstance(extra, dict) else None)
            if child is not None:
                before = old.get(key) if isinstance(old, dict) else None
                found += cel_violations(child, value, before, f"{path}.{key}", rules_only=rules_only)
    elif isinstance(new, list) and isinstance(schema.get("items"), dict):
        # Old list items are not correlated (a real server correlates only map- and set-type lists).
        for i, value in enumerate(new):
            found += cel_violations(schema["items"], value, None, f"{path}[{i}]", rules_only=rules_only)
    return found


@functools.cache
def _cel_program(rule: str) -> celpy.Runner:
    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


def _detail(error: jsonschema.ValidationError) -> str:
    value = json.dumps(error.instance)
    if error.validator == "enum":
        supported = ", ".join(json.dumps(v) for v in error.validator_value)
        return f"Unsupported value: {value}: supported values: {supported}"
    if error.validator in ("minimum", "maximum"):
        relation = "greater than or equal to" if error.validator == "minimum" else "less than or equal to"
        return f"Invalid value: {value}: {part_of(error)} should be {relation} {error.validator_value}"
    if error.validator == "type":
        given = type(error.instance).__name__
        return f'Invalid value: "{given}": {part_of(error)} must be of type {error.validator_value}'
    if error.validator == "required":
        return "Required value"
    return f"Invalid value: {value}: {error.message}"


def part_of(error: jsonschema.ValidationError) -> str:
    return _path(error.path) or "value"


def _unknown(value: Any, schema: Mapping[str, Any], path: str) -> Iterator[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict):
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if properties is not None and key in properties:
                yield from _unknown(item, properties[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                yield from _unknown(item, extra, f"{path}.{key}")
            elif properties is not None:
                yield f"{path}.{key}"
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _unknown(item, schema["items"], f"{path}[{i}]")


def _pruned(value: Any, schema: Mapping[str, Any]) -> Any:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return value
    if isinstance(value, dict):
        properties, extra = schema.get("properties"), schema.get("additionalProperties")
        if properties is None and not isinstance(extra, dict):
            return value
        return {
            key: _pruned(item, properties[key] if properties and key in properties else extra)
            for key, item in value.items()
            if (properties and key in properties) or isinstance(extra, dict)
        }
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_pruned(item, schema["items"]) for item in value]
    return value


def _defaulted(value: Any, schema: Mapping[str, Any]) -> Any:
    """Structural defaulting (apiextensions-apiserver's structuraldefaulting): every absent property of an object
    present in `value` that has a `default:` gets it, at any depth."""
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        filled = {key: _defaulted(item, properties[key]) if key in properties else item for key, item in value.items()}
        for key, child in properties.items():
            if key not in filled and "default" in child:
                filled[key] = copy.deepcopy(child["default"])
        return filled
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_defaulted(item, schema["items"]) for item in value]
    return value


def _path(parts: Any) -> str:
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path
