"""`grpolora validate --cluster`: what a job needs from the cluster it is about to run on, checked from a kubeconfig
(docs/operator.md, *Before the first job*).

The checks are pure functions over a `ClusterView` (what was read), so that they are tested on their own; `connect`
reads it through the official `kubernetes` client, which handles kubeconfig contexts and exec auth plugins as kubectl
does. Nothing is written to the cluster. A check the kubeconfig's user may not make (403) is reported as not checked,
not as a problem.

Errors are what makes the job fail or wait for ever (a missing CRD, PersistentVolumeClaim, Secret or RuntimeClass);
warnings are what may be fine on an autoscaled cluster (no node offers the GPU resource or matches the node selector
now: a node pool scaled to zero has no nodes until a pod asks for one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final

from pydantic import BaseModel

from grpolora import __version__
from grpolora.api import constants as c
from grpolora.api.load import Problem
from grpolora.api.spec import GRPOLoraJob, PvcRef, RoleSpec

NOT_ALLOWED: Final = "not allowed"
"""What a lookup answers when the kubeconfig's user may not read it (403)."""


@dataclasses.dataclass(frozen=True)
class Node:
    name: str
    labels: Mapping[str, str]
    allocatable: Mapping[str, str]
    taints: Sequence[Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class ClusterView:
    """What `validate --cluster` read: lists as found (None where not allowed), and a lookup for named objects."""

    context: str
    # The context's namespace (else `default`): where kubectl apply puts an object without metadata.namespace.
    namespace: str
    nodes: Sequence[Node] | None
    crds: Mapping[str, Mapping[str, Any]] | None  # installed CRDs of our group, by name
    operator_versions: Sequence[tuple[str, str]] | None  # (namespace/name, app.kubernetes.io/version) of each
    exists: Callable[[str, str, str], bool | str]  # (kind, namespace, name) -> found, or NOT_ALLOWED


@dataclasses.dataclass
class Findings:
    errors: list[Problem] = dataclasses.field(default_factory=list)
    warnings: list[Problem] = dataclasses.field(default_factory=list)
    not_checked: list[Problem] = dataclasses.field(default_factory=list)


def check_cluster(view: ClusterView, shipped_crds: Mapping[str, Mapping[str, Any]]) -> Findings:
    """The cluster-wide part: our CRDs installed and as new as this grpolora's, the operator running."""
    found = Findings()
    if view.crds is None:
        found.not_checked.append(Problem("", "the CRDs (listing customresourcedefinitions is not allowed)"))
    else:
        for name, shipped in shipped_crds.items():
            installed = view.crds.get(name)
            if installed is None:
                found.errors.append(
                    Problem(
                        "",
                        f"CustomResourceDefinition {name} is not installed: install the "
                        "chart (helm install), or kubectl apply -f crds/",
                    )
                )
                continue
            missing = sorted(_fields_missing(_spec_schema(shipped), _spec_schema(installed), "spec"))
            if missing:
                shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                found.errors.append(
                    Problem(
                        "",
                        f"CustomResourceDefinition {name} is older than grpolora "
                        f"{__version__}: it lacks {shown}, which the API server would drop from "
                        "jobs; upgrade the chart (or kubectl apply --server-side -f crds/)",
                    )
                )
    if view.operator_versions is None:
        found.not_checked.append(Problem("", "the operator (listing deployments in all namespaces is not allowed)"))
    elif not view.operator_versions:
        found.warnings.append(
            Problem(
                "",
                f"no operator Deployment (label app.kubernetes.io/name={c.OPERATOR_NAME}) "
                "in any namespace: jobs would be accepted but never run",
            )
        )
    else:
        for where, version in view.operator_versions:
            if version != __version__:
                found.warnings.append(
                    Problem(
                        "",
                        f"the operator {where} is version {version or 'unknown'}, this "
                        f"grpolora {__version__}: fields one knows the other may not",
                    )
                )
    return found


def check_job(job: GRPOLoraJob, view: ClusterView) -> Findings:
    """What `job` (resolved on its runtime, where it names one) needs from the cluster, at its fields' paths."""
    found = Findings()
    namespace, spec = job.namespace, job.spec
    named = [("PersistentVolumeClaim", path, claim) for path, claim in claim_references(spec)]
    named += [("Secret", path, secret) for path, secret in spec.secret_references()]
    roles = [(c.ROLE_TRAINER, spec.trainer)]
    if spec.inference.pool_ref is None:  # a pool's servers are the pool's
        roles.append((c.ROLE_INFERENCE, spec.inference))
    for role, role_spec in roles:
        runtime_class = (role_spec.pod_template.get("spec") or {}).get("runtimeClassName")
        if runtime_class:
            named.append(("RuntimeClass", f"{role}.podTemplate.spec.runtimeClassName", runtime_class))
    for kind, path, name in named:
        scope = "" if kind == "RuntimeClass" else namespace
        answer = view.exists(kind, scope, name)
        where = f"{scope}/{name}" if scope else name
        if answer == NOT_ALLOWED:
            found.not_checked.append(Problem(f"spec.{path}", f"{kind} {where} (reading it is not allowed)"))
        elif not answer:
            found.errors.append(
                Problem(
                    f"spec.{path}",
                    f"{kind} {where} does not exist in the cluster (context "
                    f"{view.context}): the pods would wait for it",
                )
            )
    if view.nodes is None:
        found.not_checked.append(Problem("spec", "the nodes (listing nodes is not allowed)"))
        return found
    for role, role_spec in roles:
        found.warnings += _placement_warnings(f"spec.{role}", role_spec, view.nodes)
    return found


def claim_references(spec: BaseModel) -> list[tuple[str, str]]:
    """(field path, claim name) of every PersistentVolumeClaim the spec names: its `pvc` fields, wherever they
    are, and the volumes of its pod template overlays."""
    found = [(f"{path}.claimName", ref.claim_name) for path, ref in _pvc_refs(spec, "")]
    for role in (c.ROLE_TRAINER, c.ROLE_INFERENCE):
        role_spec = getattr(spec, role, None)
        if not isinstance(role_spec, RoleSpec):
            continue
        for i, volume in enumerate((role_spec.pod_template.get("spec") or {}).get("volumes") or []):
            claim = ((volume or {}).get("persistentVolumeClaim") or {}).get("claimName")
            if claim:
                found.append((f"{role}.podTemplate.spec.volumes[{i}].persistentVolumeClaim.claimName", str(claim)))
    return found


def _pvc_refs(value: Any, path: str) -> Iterator[tuple[str, PvcRef]]:
    if isinstance(value, PvcRef):
        yield path, value
    elif isinstance(value, BaseModel):
        for name, field in type(value).model_fields.items():
            wire = field.alias or name
            yield from _pvc_refs(getattr(value, name), f"{path}.{wire}" if path else wire)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _pvc_refs(item, f"{path}[{i}]")


def _placement_warnings(at: str, role: RoleSpec, nodes: Sequence[Node]) -> list[Problem]:
    selector = dict(role.node_selector)
    placed = [n for n in nodes if all(n.labels.get(k) == v for k, v in selector.items())]
    if selector and not placed:
        return [
            Problem(
                f"{at}.nodeSelector",
                f"no node has the labels {selector} now (kubectl get nodes -l "
                f"{','.join(f'{k}={v}' for k, v in selector.items())}); fine only if an autoscaler adds "
                "such nodes",
            )
        ]
    untolerated = [n for n in placed if not _tolerates(role.tolerations, n.taints)]
    if placed and len(untolerated) == len(placed):
        taints = sorted(
            {f"{t.get('key')}={t.get('value', '')}:{t.get('effect')}" for n in placed for t in _hard_taints(n.taints)}
        )
        return [
            Problem(
                f"{at}.tolerations",
                f"every node the role may use is tainted ({', '.join(taints)}) and "
                "the role tolerates none of them: add a toleration for the node pool's taint",
            )
        ]
    if not role.gpus_per_replica:
        return []
    resource, wanted = role.gpu_resource, role.gpus_per_replica
    offered = [_count(n.allocatable.get(resource)) for n in placed if n not in untolerated]
    if not any(offered):
        where = "the nodes it may use" if selector else "any node"
        return [
            Problem(
                f"{at}.gpuResource",
                f"{where} offer no {resource} (allocatable): the device plugin for it "
                "is missing, or the node pool is scaled to zero (fine only if an autoscaler adds GPU "
                "nodes); kubectl describe nodes lists what each offers under Allocatable",
            )
        ]
    if max(offered) < wanted:
        return [
            Problem(
                f"{at}.gpusPerReplica",
                f"{wanted} {resource} per pod, and the most a node it may use "
                f"offers is {max(offered)}: such a pod fits on no node",
            )
        ]
    return []


def _count(quantity: Any) -> int:
    """A device count from a node's allocatable (a whole number for extended resources); 0 when absent or odd."""
    try:
        return int(str(quantity or 0))
    except ValueError:
        return 0


def _hard_taints(taints: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [t for t in taints if t.get("effect") in ("NoSchedule", "NoExecute")]


def _tolerates(tolerations: Sequence[Mapping[str, Any]], taints: Sequence[Mapping[str, Any]]) -> bool:
    """Every NoSchedule/NoExecute taint tolerated (the scheduler's rule, k8s.io/api/core/v1 Toleration.ToleratesTaint:
    an empty key with Exists matches every taint; an empty effect every effect; Exists any value, Equal the same)."""

    def matches(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
        if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
            return False
        operator = toleration.get("operator") or "Equal"
        if not toleration.get("key"):
            return operator == "Exists"
        if toleration["key"] != taint.get("key"):
            return False
        return operator == "Exists" or (toleration.get("value") or "") == (taint.get("value") or "")

    return all(any(matches(t, taint) for t in tolerations) for taint in _hard_taints(taints))


def _spec_schema(crd: Mapping[str, Any]) -> Mapping[str, Any]:
    versions = (crd.get("spec") or {}).get("versions") or []
    version = next((v for v in versions if v.get("name") == c.VERSION), {})
    return ((version.get("schema") or {}).get("openAPIV3Schema") or {}).get("properties", {}).get("spec") or {}


def _fields_missing(shipped: Mapping[str, Any], installed: Mapping[str, Any], path: str) -> Iterator[str]:
    """The fields of `shipped` (a structural schema) that `installed` does not have, as paths."""
    theirs = installed.get("properties") or {}
    if installed.get("x-kubernetes-preserve-unknown-fields"):
        return
    for name, child in (shipped.get("properties") or {}).items():
        if name not in theirs:
            yield f"{path}.{name}"
        else:
            yield from _fields_missing(child, theirs[name], f"{path}.{name}")


# ---- reading the cluster (the official client) --------------------------------------------------------------


def connect(kubeconfig: str | None, context: str | None) -> ClusterView:
    """A ClusterView read through the `kubernetes` client from the kubeconfig (its current context, or `context`);
    ValueError naming the kubeconfig when it cannot be loaded."""
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config.config_exception import ConfigException

    try:
        api = config.new_client_from_config(config_file=kubeconfig, context=context)
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
    except (ConfigException, OSError) as exc:
        raise ValueError(f"kubeconfig {kubeconfig or '(default: $KUBECONFIG or ~/.kube/config)'}: {exc}") from None
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    extensions, node_api = client.ApiextensionsV1Api(api), client.NodeV1Api(api)

    def listed(read: Callable[[], Any]) -> Any:
        try:
            return read()
        except ApiException as exc:
            if exc.status in (401, 403):
                return None
            raise

    nodes = listed(core.list_node)
    crds = listed(extensions.list_custom_resource_definition)
    operators = listed(
        lambda: apps.list_deployment_for_all_namespaces(label_selector=f"app.kubernetes.io/name={c.OPERATOR_NAME}")
    )
    readers = {
        "PersistentVolumeClaim": core.read_namespaced_persistent_volume_claim,
        "Secret": core.read_namespaced_secret,
        "RuntimeClass": lambda name, _namespace: node_api.read_runtime_class(name),
    }

    def exists(kind: str, namespace: str, name: str) -> bool | str:
        try:
            readers[kind](name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return False
            if exc.status in (401, 403):
                return NOT_ALLOWED
            raise
        return True

    serialize = api.sanitize_for_serialization
    chosen = next((entry for entry in contexts or () if entry.get("name") == context), None) if context else active
    return ClusterView(
        context=context or (active or {}).get("name", "?"),
        namespace=((chosen or {}).get("context") or {}).get("namespace") or "default",
        nodes=None if nodes is None else [_node(serialize(n)) for n in nodes.items],
        crds=None if crds is None else {d.metadata.name: serialize(d) for d in crds.items if d.spec.group == c.GROUP},
        operator_versions=None
        if operators is None
        else [
            (
                f"{d.metadata.namespace}/{d.metadata.name}",
                (d.metadata.labels or {}).get("app.kubernetes.io/version", ""),
            )
            for d in operators.items
        ],
        exists=exists,
    )


def _node(node: Mapping[str, Any]) -> Node:
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    return Node(
        meta.get("name", ""), meta.get("labels") or {}, status.get("allocatable") or {}, spec.get("taints") or []
    )
