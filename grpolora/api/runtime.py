"""A job on a runtime (spec.runtimeRef): the one merge of a GRPOLoraRuntime's or ClusterGRPOLoraRuntime's spec
under a job's, used by `grpolora validate|render|run` and by the operator.

The rule: **the job's fields win, field by field.** Mappings merge key by key, at any depth (so a job that sets
`trainer.resources.requests.memory` keeps the runtime's `trainer.resources.limits` and its `trainer.image`);
anything else the job sets (a value, a list such as `tolerations` or `env`, `null`) replaces the runtime's whole.
A job on a RolloutPool (spec.inference.poolRef) takes its servers from the pool, so the runtime's `inference` is
left out for it.

Merged as written, before defaults: a default is no choice of the job's, so it must not hide the runtime's value.
The models apply the defaults to the merged spec (grpolora.api.spec), and the CRD carries no `default:` on these
fields, which the API server would otherwise write into every job (grpolora.api.crd).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from grpolora.api import constants as c
from grpolora.api.load import InvalidJob, Problem, Runtime, parse_job
from grpolora.api.spec import ClusterGRPOLoraRuntime, GRPOLoraJob, GRPOLoraRuntime, RuntimeRef


def merge(under: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` merged onto `under`: mappings key by key (recursively), anything else `over` has replaces `under`'s."""
    merged = dict(under)
    for key, value in over.items():
        below = merged.get(key)
        merged[key] = merge(below, value) if isinstance(below, Mapping) and isinstance(value, Mapping) else value
    return merged


def resolve_spec(runtime_spec: Mapping[str, Any], job_spec: Mapping[str, Any]) -> dict[str, Any]:
    """A job's spec as written, merged over its runtime's spec as written (the module's rule)."""
    base = dict(runtime_spec)
    if ((job_spec.get("inference") or {}).get("poolRef")) is not None:
        base.pop("inference", None)
    return merge(base, job_spec)


def resolved_document(job: Mapping[str, Any], runtime_spec: Mapping[str, Any]) -> dict[str, Any]:
    """A whole job document (as written or as read from the API) with its spec resolved on `runtime_spec`."""
    return {**job, "spec": resolve_spec(runtime_spec, job.get("spec") or {})}


def as_written(document: GRPOLoraJob | Runtime) -> dict[str, Any]:
    """A parsed document as its author wrote it: the fields set, without the defaults the models filled in."""
    return document.model_dump(by_alias=True, mode="json", exclude_unset=True)


def describe(ref: RuntimeRef, namespace: str) -> str:
    """How messages name the runtime a job refers to: `ClusterGRPOLoraRuntime gpu-a100`, `GRPOLoraRuntime ns/x`."""
    return f"{ref.kind} {ref.name}" if ref.kind == c.CLUSTER_RUNTIME_KIND else f"{ref.kind} {namespace}/{ref.name}"


def key_of(ref: RuntimeRef, namespace: str) -> tuple[str, str, str]:
    """(kind, namespace, name) of the runtime a job of `namespace` names (a cluster runtime has namespace "")."""
    return (ref.kind, "" if ref.kind == c.CLUSTER_RUNTIME_KIND else namespace, ref.name)


def runtime_key(runtime: Runtime) -> tuple[str, str, str]:
    return (runtime.kind, runtime.namespace, runtime.name)


def resolve(job: GRPOLoraJob, runtime: Runtime, *, source: str = "") -> GRPOLoraJob:
    """`job` on `runtime` (the one its spec.runtimeRef names), validated as one job; InvalidJob naming the
    runtime when the merged spec is invalid (a field may come from either)."""
    ref = job.spec.runtime_ref
    assert ref is not None and key_of(ref, job.namespace) == runtime_key(runtime), "resolved on another runtime"
    return parse_resolved(as_written(job), as_written(runtime)["spec"], describe(ref, job.namespace), source=source)


def parse_resolved(
    job: Mapping[str, Any], runtime_spec: Mapping[str, Any], where: str, *, source: str = ""
) -> GRPOLoraJob:
    """A job document merged with the spec of its runtime (`where` names it), validated as one job; InvalidJob
    naming the runtime when the merged spec is invalid (a field may come from either)."""
    try:
        return parse_job(resolved_document(job, runtime_spec), source=source)
    except InvalidJob as exc:
        with_runtime = f" (the job merged with {where})"
        raise InvalidJob([Problem(p.path, p.message + with_runtime, p.line) for p in exc.problems], source) from None


class RuntimeNotGiven(InvalidJob):
    """A job names a runtime that none of the documents given holds (`grpolora validate` then checks the job alone,
    `render` and `run` cannot go on)."""


def runtimes_by_key(documents: Iterable[object]) -> dict[tuple[str, str, str], Runtime]:
    """The runtimes among `documents`, by (kind, namespace, name) (key_of)."""
    return {runtime_key(d): d for d in documents if isinstance(d, GRPOLoraRuntime | ClusterGRPOLoraRuntime)}


def resolve_given(
    job: GRPOLoraJob, runtimes: Mapping[tuple[str, str, str], Runtime], *, source: str = "", command: str = "validate"
) -> GRPOLoraJob:
    """`job` resolved on its runtime among `runtimes` (itself when it names none), for the commands that read files:
    RuntimeNotGiven when none of them is its runtime, InvalidJob when only one of another namespace is or when the
    merged spec is invalid."""
    ref = job.spec.runtime_ref
    if ref is None:
        return job
    runtime = runtimes.get(key_of(ref, job.namespace))
    if runtime is not None:
        return resolve(job, runtime, source=source)
    elsewhere = sorted(ns for kind, ns, name in runtimes if (kind, name) == (ref.kind, ref.name))
    if elsewhere:
        message = (
            f"{ref.kind} {ref.name} is in namespace {', '.join(elsewhere)}, not {job.namespace}: a job names a "
            f"{c.RUNTIME_KIND} of its own namespace (or a {c.CLUSTER_RUNTIME_KIND})"
        )
        raise InvalidJob([Problem("spec.runtimeRef.name", message)], source)
    message = (
        f"names {describe(ref, job.namespace)}, which none of the files given holds; give its file too "
        f"(grpolora {command} RUNTIME_FILE JOB_FILE)"
    )
    raise RuntimeNotGiven([Problem("spec.runtimeRef.name", message)], source)


def ref_in(job: Mapping[str, Any]) -> RuntimeRef | None:
    """The runtime a job document (as read from the API) names; None when it names none or names it wrongly (the
    job's own validation then says so)."""
    raw = (job.get("spec") or {}).get("runtimeRef")
    if raw is None:
        return None
    try:
        return RuntimeRef.model_validate(raw)
    except ValueError:
        return None


def record_of(runtime: Mapping[str, Any]) -> dict[str, Any]:
    """What a started job keeps of its runtime (the operator's `grpolora.dev/runtime` annotation): which one, which
    version of it, and the spec it was merged with."""
    meta = runtime.get("metadata") or {}
    return {
        "kind": runtime.get("kind"),
        "name": meta.get("name"),
        "generation": meta.get("generation"),
        "resourceVersion": meta.get("resourceVersion"),
        "spec": runtime.get("spec") or {},
    }


def describe_record(record: Mapping[str, Any], namespace: str) -> str:
    """`ClusterGRPOLoraRuntime a100 (generation 3)`, as the RuntimeResolved condition says it."""
    ref = RuntimeRef(kind=record["kind"], name=record["name"])
    generation = f" (generation {record['generation']})" if record.get("generation") is not None else ""
    return describe(ref, namespace) + generation
