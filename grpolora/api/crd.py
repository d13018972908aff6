"""The CustomResourceDefinitions (GRPOLoraJob, RolloutPool, GRPOLoraRuntime, ClusterGRPOLoraRuntime), generated
from the spec and status models (their one source) by one function each.

`crds/<plural>.grpolora.dev.yaml` are these functions' output (CRD_FILES); a test keeps them equal
(`make crd`, i.e. `grpolora crd --kind <Kind>`, regenerates them).
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from grpolora.api import constants as c
from grpolora.api.spec import (
    CEL_VALIDATIONS,
    DNS_1035_LABEL,
    GRPOLoraJobSpec,
    GRPOLoraRuntimeSpec,
    RolloutPoolSpec,
    cel_rule,
    max_job_name_length,
)
from grpolora.api.status import JobStatus, PoolStatus

PRESERVE = "x-kubernetes-preserve-unknown-fields"
# Keys a structural OpenAPI v3 schema may carry (JSON-Schema-only keys such as `title` are dropped).
_KEEP = {
    "type",
    "description",
    "properties",
    "required",
    "items",
    "additionalProperties",
    "enum",
    "default",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "format",
    "nullable",
    PRESERVE,
    CEL_VALIDATIONS,
}


def crd() -> dict[str, Any]:
    """The GRPOLoraJob CustomResourceDefinition as a dict."""
    spec_schema = structural(GRPOLoraJobSpec.model_json_schema(by_alias=True, mode="validation"))
    # No server-side defaults in the sections a runtime may set: the API server would write them into every job, and
    # a default written there would then win over the runtime's value as if the job had set it (grpolora.api.runtime
    # merges before defaults). A job on a pool (inference.poolRef) must leave `inference` unset besides. The models
    # apply the defaults to the merged spec; the descriptions say them. Of `environment`, a runtime sets only where
    # its server runs (GRPOLoraRuntimeSpec.environment): the rest keeps its defaults.
    runtime_schema = structural(GRPOLoraRuntimeSpec.model_json_schema(by_alias=True, mode="validation"))
    _defaults_described_where(spec_schema, runtime_schema)
    column = _printer_column
    return _custom_resource(
        kind=c.KIND,
        plural=c.PLURAL,
        singular=c.SINGULAR,
        short_names=c.SHORT_NAMES,
        spec_schema=spec_schema,
        status_schema=structural(JobStatus.model_json_schema(by_alias=True, mode="serialization")),
        spec_description="Desired state of a GRPO LoRA training job.",
        description="A GRPO reinforcement-learning job that trains a LoRA adapter and syncs it to vLLM inference "
        "replicas after each step.",
        rules=root_rules(),
        columns=[
            column("Phase", "string", ".status.phase", "Job phase"),
            column("Reason", "string", ".status.reason", "Why the job waits, or what it does"),
            column("Step", "string", ".status.progress", "Optimizer steps completed / steps to run"),
            column("SyncRound", "integer", ".status.syncRound", "Adapter version being served"),
            column("Reward", "number", ".status.rewardMean", "Mean reward of the last step"),
            column("Ready", "string", ".status.ready", "Ready pods / desired (trainer ranks and inference replicas)"),
            column("Restarts", "integer", ".status.trainerRestarts", "Trainer restarts (any cause)"),
            column("Epoch", "integer", ".status.rendezvous.epoch", "Sync-group epoch", priority=1),
            column("Message", "string", ".status.message", "Why the job is in its phase", priority=1),
            column("Age", "date", ".metadata.creationTimestamp", "Time since creation"),
        ],
    )


def pool_crd() -> dict[str, Any]:
    """The RolloutPool CustomResourceDefinition as a dict (same machinery, same group and version)."""
    column = _printer_column
    spec_schema = structural(RolloutPoolSpec.model_json_schema(by_alias=True, mode="validation"))
    spec_schema.setdefault(CEL_VALIDATIONS, []).append(pool_spec_rule())
    return _custom_resource(
        kind=c.POOL_KIND,
        plural=c.POOL_PLURAL,
        singular=c.POOL_SINGULAR,
        short_names=c.POOL_SHORT_NAMES,
        spec_schema=spec_schema,
        status_schema=structural(PoolStatus.model_json_schema(by_alias=True, mode="serialization")),
        spec_description="Desired state of a shared rollout pool. Only replicas can change once it exists: the rest is "
        "what its servers run with and its jobs attached by.",
        description="vLLM servers of one base model shared by several GRPOLoraJobs (spec.inference.poolRef), each "
        "job's adapters in LoRA slots of its own.",
        rules=name_rules(),
        # `kubectl scale rolloutpool/<name> --replicas=N` (and a HorizontalPodAutoscaler) write spec.replicas.
        scale={
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas.ready",
            "labelSelectorPath": ".status.selector",  # an autoscaler's way to the pods (PoolStatus.selector)
        },
        columns=[
            column("Ready", "integer", ".status.replicas.ready", "Ready server replicas"),
            column("Desired", "integer", ".status.replicas.desired", "Server replicas", priority=1),
            column("Jobs", "string", ".status.jobs", "Jobs attached / spec.maxJobs"),
            column("Waiting", "integer", ".status.waiting", "Jobs waiting for a free place"),
            column("Tokens/s", "number", ".status.tokensPerSecond", "Completion tokens per second, all jobs"),
            column("Slots", "integer", ".status.slotsInUse", "LoRA slots in use", priority=1),
            column("Message", "string", ".status.message", "What the pool is doing", priority=1),
            column("Age", "date", ".metadata.creationTimestamp", "Time since creation"),
        ],
    )


def runtime_crd(kind: str = c.RUNTIME_KIND) -> dict[str, Any]:
    """The CRD of a runtime kind: GRPOLoraRuntime (namespaced) or ClusterGRPOLoraRuntime (cluster-scoped). The same
    models as the job's sections, so the same bounds and rules, and no defaults (applied after the merge)."""
    spec_schema = structural(GRPOLoraRuntimeSpec.model_json_schema(by_alias=True, mode="validation"))
    _defaults_described(spec_schema)
    cluster = kind == c.CLUSTER_RUNTIME_KIND
    return _custom_resource(
        kind=kind,
        plural=c.CLUSTER_RUNTIME_PLURAL if cluster else c.RUNTIME_PLURAL,
        singular=c.CLUSTER_RUNTIME_SINGULAR if cluster else c.RUNTIME_SINGULAR,
        short_names=c.CLUSTER_RUNTIME_SHORT_NAMES if cluster else c.RUNTIME_SHORT_NAMES,
        spec_schema=spec_schema,
        status_schema=None,
        spec_description="Where and how the jobs that name this runtime run; a job's own fields win, field by field.",
        description=(
            "Where and how GRPOLoraJobs run (images, resources, placement, sync, security, output), named by jobs "
            + ("of every namespace" if cluster else "of its namespace")
            + " with spec.runtimeRef."
        ),
        rules=[],
        columns=[_printer_column("Age", "date", ".metadata.creationTimestamp", "Time since creation")],
        scope="Cluster" if cluster else "Namespaced",
        # Configuration, not workloads: `kubectl get all` (the `all` category) leaves them out, as ConfigMaps.
        categories=("grpolora",),
    )


def _defaults_described_where(schema: dict[str, Any], runtime: dict[str, Any]) -> None:
    """_defaults_described on every field of `schema` (the job's spec) that `runtime` (a runtime's spec) has too:
    a section the runtime has whole loses every default, one it has in part only those of that part."""
    for name, part in (runtime.get("properties") or {}).items():
        own = schema["properties"][name]
        if set(part.get("properties") or {}) < set(own.get("properties") or {}):
            _default_described(own)
            _defaults_described_where(own, part)
        else:
            _defaults_described(own)


def _default_described(schema: dict[str, Any]) -> None:
    """The `default:` of this field (not its children's) removed and said in its description instead."""
    if "default" in schema:
        value = schema.pop("default")
        written = value if isinstance(value, str) else json.dumps(value)
        schema["description"] = f"{schema.get('description', '')} Default: {written}.".lstrip()


def _defaults_described(schema: dict[str, Any]) -> None:
    """Every `default:` under `schema` removed, and said in its field's description instead (kubectl explain)."""
    _default_described(schema)
    for child in (schema.get("properties") or {}).values():
        _defaults_described(child)
    if isinstance(schema.get("items"), dict):
        _defaults_described(schema["items"])


def _custom_resource(
    *,
    kind: str,
    plural: str,
    singular: str,
    short_names: tuple[str, ...],
    spec_schema: dict[str, Any],
    status_schema: dict[str, Any] | None,
    spec_description: str,
    description: str,
    rules: list[dict[str, str]],
    columns: list[dict[str, Any]],
    scope: str = "Namespaced",
    categories: tuple[str, ...] = ("all", "grpolora"),
    scale: dict[str, str] | None = None,
) -> dict[str, Any]:
    properties: dict[str, Any] = {
        "apiVersion": {"type": "string", "description": c.API_VERSION},
        "kind": {"type": "string", "description": kind},
        "metadata": metadata_schema(),
        "spec": spec_schema,
    }
    spec_schema["description"] = spec_description
    version: dict[str, Any] = {"name": c.VERSION, "served": True, "storage": True}
    if status_schema is not None:  # runtimes have none: nothing observes them
        # Kopf keeps its own bookkeeping under status.kopf when told to; keep it unpruned.
        status_schema["properties"]["kopf"] = {
            "type": "object",
            PRESERVE: True,
            "description": "Kopf's handler bookkeeping.",
        }
        status_schema["description"] = "Observed state, written by the operator."
        properties["status"] = status_schema
        version["subresources"] = {"status": {}}
    if scale is not None:  # `kubectl scale`, and what an autoscaler patches
        version.setdefault("subresources", {})["scale"] = scale
    root: dict[str, Any] = {"type": "object", "description": description, "required": ["spec"]}
    if rules:
        root[CEL_VALIDATIONS] = rules
    root["properties"] = properties
    version["additionalPrinterColumns"] = columns
    version["schema"] = {"openAPIV3Schema": root}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{c.GROUP}",
            "labels": {c.LABEL_NAME: c.OPERATOR_NAME},
        },
        "spec": {
            "group": c.GROUP,
            "scope": scope,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": singular,
                "shortNames": list(short_names),
                "categories": list(categories),
            },
            "versions": [version],
        },
    }


def metadata_schema() -> dict[str, Any]:
    """metadata.name and generateName bounded (the only metadata fields a CRD may restrict): the CEL rules on the name
    are then estimated at its real size, not at 3 MiB (Kubernetes releases without the estimator's own 253-character
    cap assume an unbounded name otherwise, unless both are typed here). The name must be an RFC 1035 label anyway
    (a rule below); generateName leaves room for the random suffix."""
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": c.DNS_LABEL_MAX},
            "generateName": {"type": "string", "maxLength": c.DNS_LABEL_MAX - 1},
        },
    }


def name_rules() -> list[dict[str, str]]:
    """CEL rules on metadata.name, the same for jobs and pools (both name children `<name>-<suffix>`)."""
    longest = max_job_name_length()
    return [
        cel_rule(
            f"self.metadata.name.matches('{DNS_1035_LABEL.pattern}')",
            "metadata.name must be an RFC 1035 label: lower-case letters, digits and '-', starting with a letter "
            "and ending with a letter or digit (it names Services)",
        ),
        cel_rule(
            f"self.metadata.name.size() <= {longest}",
            f"metadata.name may have at most {longest} characters: child objects are named `<name>-"
            f"{c.ROLE_INFERENCE}` and must stay within the {c.DNS_LABEL_MAX}-character DNS label limit",
        ),
    ]


def pool_spec_rule() -> dict[str, str]:
    """A RolloutPool's spec: only POOL_MUTABLE_SPEC_FIELDS (replicas) may change. Every other field is a fact its
    servers were started with (vLLM's LoRA slots are maxJobs x adaptersPerJob, its rank maxLoraRank, the model, the
    serving settings in the pods' environment) and that jobs attached by: changing one would need new servers, and
    every attached job would run against servers that no longer match what it was admitted for."""
    fixed = [
        field.alias or name
        for name, field in RolloutPoolSpec.model_fields.items()
        if (field.alias or name) not in c.POOL_MUTABLE_SPEC_FIELDS
    ]
    return cel_rule(
        " && ".join(
            f"(has(self.{f}) ? has(oldSelf.{f}) && self.{f} == oldSelf.{f} : !has(oldSelf.{f}))" for f in fixed
        ),
        "only spec." + " and spec.".join(c.POOL_MUTABLE_SPEC_FIELDS) + " of a RolloutPool can change (kubectl "
        "scale): its servers run with the rest of the spec they were started with; delete and re-create the "
        "RolloutPool to change it (its attached jobs then fail with PoolDeleted)",
    )


def root_rules() -> list[dict[str, str]]:
    """CEL rules that need metadata.name or the old object (rules inside the spec come from grpolora.api.spec)."""
    created = (
        f"has(oldSelf.status) && has(oldSelf.status.conditions) && oldSelf.status.conditions.exists(c, "
        f"c.type == '{c.CONDITION_CREATED}' && c.status == 'True')"
    )
    fixed = [
        field.alias or name
        for name, field in GRPOLoraJobSpec.model_fields.items()
        if (field.alias or name) not in c.MUTABLE_SPEC_FIELDS
    ]
    unchanged = " && ".join(
        f"(has(self.spec.{f}) ? has(oldSelf.spec.{f}) && self.spec.{f} == oldSelf.spec.{f} : !has(oldSelf.spec.{f}))"
        for f in fixed
    )
    return [
        *name_rules(),
        cel_rule(
            f"!({created}) || ({unchanged})",
            "only spec." + " and spec.".join(c.MUTABLE_SPEC_FIELDS) + " can change once the job's children "
            "exist (condition Created); delete and re-create the job to apply other changes",
        ),
    ]


class _NoAliasDumper(yaml.SafeDumper):
    """Writes repeated subtrees out in full: `&id001` anchors in a CRD confuse readers and some tools."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def crd_yaml(kind: str = c.KIND) -> str:
    """The CRD of `kind` (GRPOLoraJob or RolloutPool) as the YAML shipped in crds/ (CRD_FILES)."""
    return yaml.dump(CRDS[kind](), Dumper=_NoAliasDumper, sort_keys=False, width=120)


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """Pydantic JSON Schema -> a Kubernetes structural schema: refs inlined, Optional unwrapped, only
    OpenAPI v3 keywords kept, exclusive bounds in OpenAPI v3.0 form."""
    definitions = schema.get("$defs", {})

    def convert(node: dict[str, Any]) -> dict[str, Any]:
        node = dict(node)
        if "$ref" in node:
            target = definitions[node.pop("$ref").rsplit("/", 1)[-1]]
            node = {**target, **node}  # the field's own description wins over the model's docstring
        if PRESERVE in node:
            # Kubernetes objects and unions of types: kept as written, validated by the API server or the model.
            kept = {"description": node.get("description", ""), PRESERVE: True}
            if node.get("type") in ("object", "array"):
                kept["type"] = node["type"]
            if node.get("type") == "array" and "items" in node:
                kept["items"] = convert(node["items"])
            kept["description"] = _one_line(kept["description"])
            return _drop_empty(kept)
        if "anyOf" in node:
            options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
            if len(options) != 1:
                raise ValueError(f"cannot express a union of {options} structurally; mark it {PRESERVE}")
            inner = convert(options[0])
            node = {**inner, **{k: v for k, v in node.items() if k in ("description",)}}
            if node.get("default") is None:
                node.pop("default", None)
        if "const" in node:
            node["enum"] = [node.pop("const")]
        for bound, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(node.get(bound), int | float) and not isinstance(node.get(bound), bool):
                node[inclusive] = node[bound]
                node[bound] = True
        if "properties" in node:
            node["properties"] = {k: convert(v) for k, v in node["properties"].items()}
        if isinstance(node.get("items"), dict):
            node["items"] = convert(node["items"])
        if isinstance(node.get("additionalProperties"), dict):
            node["additionalProperties"] = convert(node["additionalProperties"])
        elif node.get("type") == "object" and "properties" in node:
            node.pop("additionalProperties", None)  # closed models: unknown fields are pruned/rejected
        if node.get("type") in ("object", "array"):
            node.pop("default", None)  # object defaults come from the model, not from the API server
        if "description" in node:
            node["description"] = _one_line(node["description"])
        return {k: node[k] for k in sorted(node, key=_key_order) if k in _KEEP}

    root = convert(schema)
    root.pop("description", None)
    return root


def _one_line(text: str) -> str:
    """Docstrings wrap at the source's line length; kubectl explain re-wraps, so keep paragraphs only."""
    return "\n\n".join(" ".join(p.split()) for p in text.split("\n\n"))


def _key_order(key: str) -> tuple[int, str]:
    first = ("description", "type", "required", "properties")
    return (first.index(key), "") if key in first else (len(first), key)


def _drop_empty(node: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in node.items() if v not in ("", None)}


def _printer_column(name: str, kind: str, path: str, description: str, priority: int = 0) -> dict[str, Any]:
    column: dict[str, Any] = {"name": name, "type": kind, "jsonPath": path, "description": description}
    if priority:
        column["priority"] = priority
    return column


CRDS: dict[str, Any] = {
    c.KIND: crd,
    c.POOL_KIND: pool_crd,
    c.RUNTIME_KIND: lambda: runtime_crd(c.RUNTIME_KIND),
    c.CLUSTER_RUNTIME_KIND: lambda: runtime_crd(c.CLUSTER_RUNTIME_KIND),
}
"""Each kind's CRD function."""
CRD_FILES: dict[str, str] = {
    c.KIND: f"{c.CRD_NAME}.yaml",
    c.POOL_KIND: f"{c.POOL_CRD_NAME}.yaml",
    c.RUNTIME_KIND: f"{c.RUNTIME_CRD_NAME}.yaml",
    c.CLUSTER_RUNTIME_KIND: f"{c.CLUSTER_RUNTIME_CRD_NAME}.yaml",
}
"""Each kind's file name in crds/ and in the chart's files/."""
