"""A job on a runtime (spec.runtimeRef): the one merge of a GRPOLoraRuntime's or ClusterGRPOLoraRuntime's spec
under a job's, used by `grpolora validate|render|run` and by the operator.

The rule: **the job's fields win, field by field, and a job adds to the runtime's lists.** Mappings merge key by key,
at any depth (so a job that sets `trainer.resources.requests.memory` keeps the runtime's `trainer.resources.limits`
and its `trainer.image`). Lists merge as Kubernetes users know from strategic merge patches: a role's `env` by
`name`, its `tolerations` as a union (the runtime's first, an equal one once), and the lists of its `podTemplate`
by their merge keys (containers, volumes, env... by name, volumeMounts by mountPath: overlay.MERGE_KEYS); an item
the job gives with the key of one of the runtime's is merged into it, in its place. A job drops one of the
runtime's items with `$patch: delete` on an item with its key (a toleration: the whole toleration), or replaces
the runtime's list with an item `{$patch: replace}`, as a strategic merge patch says it; deleting an item the
runtime does not have is an error. Any other list, and any value (`null` too), the job sets replaces the
runtime's. A job on a RolloutPool (spec.inference.poolRef) takes its servers from the pool, so the runtime's
`inference` is left out for it. A runtime's `environment.server` (where environment servers run: image, resources,
placement, env) merges into a job's spec.environment.server by the same rules (its `env` by name, its `tolerations`
as a union), and only into a job that runs one: a runtime never turns a job's environment into a served one.

Merged as written, before defaults: a default is no choice of the job's, so it must not hide the runtime's value.
The models apply the defaults to the merged spec (grpolora.api.spec), and the CRD carries no `default:` on these
fields, which the API server would otherwise write into every job (grpolora.api.crd).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any, Final

from grpolora.api import constants as c
from grpolora.api import overlay
from grpolora.api.load import InvalidJob, Problem, Runtime, parse_job
from grpolora.api.spec import ClusterGRPOLoraRuntime, GRPOLoraJob, GRPOLoraRuntime, RuntimeRef

UNION: Final = ""
"""The merge key of a list merged as a union of whole items (tolerations: a toleration has no key)."""
ROLES: Final = (c.ROLE_TRAINER, c.ROLE_INFERENCE)
ROLE_LISTS: Final = {"env": "name", "tolerations": UNION}
"""The lists of a role's spec that merge, and their keys; a podTemplate's merge by overlay.MERGE_KEYS."""
ENVIRONMENT_SERVER: Final = ("environment", "server")
"""Where a runtime's environment server fields are; its lists merge as a role's (ROLE_LISTS)."""


class MergeError(ValueError):
    """The job's `$patch` items do not fit its runtime's lists: (path in the spec, message) each."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{path}: {message}" for path, message in errors))


def merge(under: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """The spec `over` (a job's, as written) merged onto `under` (its runtime's): see the module docstring.
    MergeError when a `$patch: delete` finds nothing to delete."""
    errors: list[tuple[str, str]] = []
    merged = _merge(under, over, (), errors)
    if errors:
        raise MergeError(errors)
    return merged


def _merge(under: Mapping[str, Any], over: Mapping[str, Any], at: tuple[str, ...], errors: list) -> dict[str, Any]:
    merged = copy.deepcopy(dict(under))
    for key, value in over.items():
        below, here = merged.get(key), (*at, key)
        key_of_items = _list_key(here)
        if isinstance(value, Mapping) and isinstance(below, Mapping | None):
            # A section the runtime does not set merges onto nothing: its lists' directives still apply (a delete
            # finds nothing, an error; a replace leaves the job's items), and none reaches the merged spec.
            merged[key] = _merge(below or {}, value, here, errors)
        elif key_of_items is not None and isinstance(value, list) and isinstance(below, list | None):
            merged[key] = _merge_list(below or [], value, key_of_items, here, errors)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _list_key(at: tuple[str, ...]) -> str | None:
    """The merge key of the list at `at` (UNION for a union), or None for a list replaced whole."""
    if len(at) == 2 and at[0] in ROLES:
        return ROLE_LISTS.get(at[1])
    if len(at) == 3 and at[:2] == ENVIRONMENT_SERVER:
        return ROLE_LISTS.get(at[2])
    if len(at) > 2 and at[0] in ROLES and at[1] == "podTemplate":
        return overlay.MERGE_KEYS.get(at[-1])
    return None


def _merge_list(below: list[Any], over: list[Any], key: str, at: tuple[str, ...], errors: list) -> list[Any]:
    def same(item: Any, other: Any) -> bool:
        if not (isinstance(item, Mapping) and isinstance(other, Mapping)):
            return item == other
        if key == UNION:
            return {k: v for k, v in item.items() if k != overlay.PATCH} == other
        return item.get(key) == other.get(key)

    replace = any(isinstance(i, Mapping) and i.get(overlay.PATCH) == "replace" for i in over)
    result = [] if replace else copy.deepcopy(below)
    for index, item in enumerate(over):
        if isinstance(item, Mapping) and set(item) == {overlay.PATCH}:
            continue  # {$patch: replace}
        found = next((i for i, old in enumerate(result) if same(item, old)), None)
        if isinstance(item, Mapping) and item.get(overlay.PATCH) == "delete":
            if found is None:
                errors.append((_path(at) + f"[{index}]", _nothing_to_delete(item, below, key)))
            else:
                del result[found]
        elif found is None:
            result.append(copy.deepcopy(item))
        elif key != UNION:
            result[found] = _merge(result[found], item, (*at, f"[{item.get(key)}]"), errors)
    return result


def _nothing_to_delete(item: Mapping[str, Any], below: list[Any], key: str) -> str:
    if key == UNION:
        return "`$patch: delete` drops the runtime's equal item, and the runtime has none: write it as the runtime does"
    has = ", ".join(str(old.get(key)) for old in below if isinstance(old, Mapping)) or "none"
    return (
        f"`$patch: delete` drops the runtime's item with {key} {item.get(key)}, and the runtime has none (it has: "
        f"{has})"
    )


def _path(at: tuple[str, ...]) -> str:
    return "".join(part if part.startswith("[") else f".{part}" for part in at).removeprefix(".")


SERVICE_ACCOUNT_FIELDS: Final = ("serviceAccountName", "serviceAccount")  # the second: PodSpec's deprecated alias


def resolve_spec(runtime_spec: Mapping[str, Any], job_spec: Mapping[str, Any], where: str = "its runtime") -> dict:
    """A job's spec as written, merged over its runtime's spec as written (the module's rule); MergeError when the
    job's `$patch` items do not fit, or when it changes a service account the runtime pins (`where` names it)."""
    base = dict(runtime_spec)
    if ((job_spec.get("inference") or {}).get("poolRef")) is not None:
        base.pop("inference", None)
    if ((job_spec.get("environment") or {}).get("server")) is None:
        base.pop("environment", None)  # no server of its own: nothing of the runtime's to place
    merged = merge(base, job_spec)
    errors = [e for role in ROLES for e in _service_account_changed(role, base, job_spec, merged, where)]
    if errors:
        raise MergeError(errors)
    return merged


def _pod_spec(spec: Mapping[str, Any], role: str) -> Mapping[str, Any]:
    template = (spec.get(role) or {}).get("podTemplate") or {}
    return template.get("spec") or {} if isinstance(template, Mapping) else {}


def _service_account_changed(
    role: str, runtime: Mapping[str, Any], job: Mapping[str, Any], merged: Mapping[str, Any], where: str
) -> list[tuple[str, str]]:
    """A runtime that names a service account for a role's pods pins it: whoever may create a job may otherwise run
    its pods as any service account of the namespace (docs/operator.md, *Trust boundary*), and a platform team that
    gives a runtime's pods an identity (a cloud IAM role through workload identity) means it as a rule, not a
    default. So the merged pods must run as that account, whatever the job wrote (another name, the deprecated
    alias, null)."""
    own = _pod_spec(runtime, role)
    pinned = next((own[f] for f in SERVICE_ACCOUNT_FIELDS if own.get(f)), None)
    if pinned is None:
        return []
    result = _pod_spec(merged, role)
    if all(result.get(f) in (None, pinned) for f in SERVICE_ACCOUNT_FIELDS) and result.get(SERVICE_ACCOUNT_FIELDS[0]):
        return []
    written = _pod_spec(job, role)
    field = next((f for f in SERVICE_ACCOUNT_FIELDS if f in written and written[f] != pinned), None)
    path = f"{role}.podTemplate.spec.{field}" if field else f"{role}.podTemplate"
    message = (
        f"{where} pins the {role} pods' service account to {pinned}: a job on it may not choose another; remove "
        "this field"
    )
    return [(path, message)]


def resolved_document(job: Mapping[str, Any], runtime_spec: Mapping[str, Any], where: str = "its runtime") -> dict:
    """A whole job document (as written or as read from the API) with its spec resolved on `runtime_spec`."""
    return {**job, "spec": resolve_spec(runtime_spec, job.get("spec") or {}, where)}


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
    with_runtime = f" (the job merged with {where})"
    try:
        return parse_job(resolved_document(job, runtime_spec, where), source=source)
    except InvalidJob as exc:
        raise InvalidJob([Problem(p.path, p.message + with_runtime, p.line) for p in exc.problems], source) from None
    except MergeError as exc:
        raise InvalidJob(
            [Problem(f"spec.{path}", message + with_runtime) for path, message in exc.errors], source
        ) from None


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
