"""`grpolora validate --cluster`: what a job needs from the cluster it is about to run on, checked from a kubeconfig
(docs/operator.md, *Before the first job*).

The checks are pure functions over a `ClusterView` (what was read), so that they are tested on their own; `connect`
reads it through the official `kubernetes` client, which handles kubeconfig contexts and exec auth plugins as kubectl
does. Nothing is written to the cluster. A check the kubeconfig's user may not make (403) is reported as not checked,
not as a problem. A cluster that cannot be checked at all (unreachable, too slow, credentials refused, not an API
server) is ClusterUnavailable: one message naming the server and what to fix. Every request has the client's own
connect and read timeouts (`_request_timeout`) and is tried once (urllib3 would retry a refused connection three
times).

Errors are what makes the job fail or wait for ever (a missing CRD, namespace, PersistentVolumeClaim, Secret,
RuntimeClass, runtime or RolloutPool; a namespace no operator serves);
warnings are what may be fine on an autoscaled cluster (no node offers the GPU resource or matches the node selector
now: a node pool scaled to zero has no nodes until a pod asks for one).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from pydantic import BaseModel

from grpolora import __version__
from grpolora.api import constants as c
from grpolora.api.load import Problem
from grpolora.api.quantity import QuantityError, parse
from grpolora.api.spec import GRPOLoraJob, PvcRef, RoleSpec, RolloutPool, pod_secret_references

NOT_ALLOWED: Final = "not allowed"
"""What a lookup answers when the kubeconfig's user may not read it (403)."""
REQUEST_TIMEOUT: Final = 15.0
"""Seconds a request may take (read timeout; the connect timeout is at most 5 s), unless --request-timeout says."""
CONNECT_TIMEOUT: Final = 5.0
Provided = Collection[tuple[str, str, str]]
"""(kind, namespace, name) of the objects the files given create beside the jobs (a claim, a Secret, a Namespace)."""


class ClusterUnavailable(Exception):
    """The cluster cannot be checked at all; the message names the server (or kubeconfig) and what to fix."""


@dataclasses.dataclass(frozen=True)
class Node:
    name: str
    labels: Mapping[str, str]
    allocatable: Mapping[str, str]
    taints: Sequence[Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class Operator:
    """An operator Deployment, and the namespaces its arguments make it serve (the chart's `--all-namespaces`, or a
    `--namespace NS` per watch.namespaces entry: exact names, grpolora.operator.main)."""

    where: str  # namespace/name
    version: str  # its app.kubernetes.io/version label
    namespaces: tuple[str, ...] | None  # None: every namespace
    args_known: bool = True  # False: its arguments name no scope (not the chart's Deployment), so not known

    def serves(self, namespace: str) -> bool:
        return self.namespaces is None or namespace in self.namespaces


@dataclasses.dataclass(frozen=True)
class ClusterView:
    """What `validate --cluster` read: lists as found (None where not allowed), and a lookup for named objects."""

    context: str
    # The context's namespace (else `default`): where kubectl apply puts an object without metadata.namespace.
    namespace: str
    nodes: Sequence[Node] | None
    crds: Mapping[str, Mapping[str, Any]] | None  # installed CRDs of our group, by name
    operators: Sequence[Operator] | None
    # (kind, namespace, name) -> the object as read, None when it does not exist, or NOT_ALLOWED.
    get: Callable[[str, str, str], Mapping[str, Any] | str | None]
    server: str = ""

    def exists(self, kind: str, namespace: str, name: str) -> bool | str:
        found = self.get(kind, namespace, name)
        return found if found == NOT_ALLOWED else found is not None


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
    if view.operators is None:
        found.not_checked.append(Problem("", "the operator (listing deployments in all namespaces is not allowed)"))
    elif not view.operators:
        found.warnings.append(
            Problem(
                "",
                f"no operator Deployment (label app.kubernetes.io/name={c.OPERATOR_NAME}) "
                "in any namespace: jobs would be accepted but never run",
            )
        )
    else:
        for operator in view.operators:
            if operator.version != __version__:
                found.warnings.append(
                    Problem(
                        "",
                        f"the operator {operator.where} is version {operator.version or 'unknown'}, this "
                        f"grpolora {__version__}: fields one knows the other may not",
                    )
                )
    return found


def check_namespace(namespace: str, view: ClusterView, provided: Provided = ()) -> Findings:
    """The namespace exists (or the files create it), and an operator serves it: a job or pool in a namespace no
    operator watches is accepted by the API server and never run."""
    found = Findings()
    if ("Namespace", "", namespace) not in provided:
        answer = view.exists("Namespace", "", namespace)
        if answer == NOT_ALLOWED:
            unread = f"Namespace {namespace} (reading it is not allowed)"
            found.not_checked.append(Problem("metadata.namespace", unread))
        elif not answer:
            found.errors.append(
                Problem(
                    "metadata.namespace",
                    f"Namespace {namespace} does not exist in the cluster (context {view.context}): kubectl create "
                    f"namespace {namespace}",
                )
            )
    if not view.operators:  # not allowed, or none at all: check_cluster says so
        return found
    if any(o.args_known and o.serves(namespace) for o in view.operators):
        return found
    if not all(o.args_known for o in view.operators):
        unknown = ", ".join(o.where for o in view.operators if not o.args_known)
        why = f"whether the operator serves {namespace} ({unknown}: no --namespace or --all-namespaces in its args)"
        found.not_checked.append(Problem("metadata.namespace", why))
        return found
    for operator in view.operators:
        watched = ", ".join(operator.namespaces or ())
        found.errors.append(
            Problem(
                "metadata.namespace",
                f"the operator {operator.where} watches namespaces {watched}, not {namespace}: it would never run "
                f"the job; add {namespace} to the chart's watch.namespaces (helm upgrade), or apply it in a watched "
                "namespace",
            )
        )
    return found


def check_job(job: GRPOLoraJob, view: ClusterView, provided: Provided = ()) -> Findings:
    """What `job` (resolved on its runtime, where it names one) needs from the cluster, at its fields' paths;
    `provided`: what the files given create beside it, which kubectl apply creates too."""
    spec = job.spec
    named = [("PersistentVolumeClaim", path, claim) for path, claim in claim_references(spec)]
    named += [("Secret", path, secret) for path, secret in spec.secret_references()]
    roles = [(c.ROLE_TRAINER, spec.trainer)]
    if spec.inference.pool_ref is None:  # a pool's servers are the pool's
        roles.append((c.ROLE_INFERENCE, spec.inference))
    return _check_pods(job.namespace, named, roles, view, provided)


def check_pool(pool: RolloutPool, view: ClusterView, provided: Provided = ()) -> Findings:
    """What a RolloutPool's servers need from the cluster: its Secrets, claims, RuntimeClass, nodes."""
    spec = pool.spec
    named = [("PersistentVolumeClaim", f"{path}.claimName", ref.claim_name) for path, ref in _pvc_refs(spec, "")]
    named += [("PersistentVolumeClaim", path, claim) for path, claim in _template_claims("", spec)]
    if spec.model.token_from is not None:
        named.append(("Secret", "model.tokenFrom.secretName", spec.model.token_from.secret_name))
    named += [("Secret", path, name) for path, name in pod_secret_references(spec.env, spec.pod_template)]
    return _check_pods(pool.namespace, named, [("", spec)], view, provided)


def _check_pods(
    namespace: str,
    named: list[tuple[str, str, str]],
    roles: Sequence[tuple[str, RoleSpec]],
    view: ClusterView,
    provided: Provided,
) -> Findings:
    found = check_namespace(namespace, view, provided)
    for role, role_spec in roles:
        runtime_class = (role_spec.pod_template.get("spec") or {}).get("runtimeClassName")
        if runtime_class:
            named.append(("RuntimeClass", _at(role, "podTemplate.spec.runtimeClassName"), runtime_class))
    for kind, path, name in named:
        scope = "" if kind == "RuntimeClass" else namespace
        if (kind, scope, name) in provided:
            continue
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
        found.warnings += _placement_warnings(f"spec.{role}".rstrip("."), role_spec, view.nodes)
    return found


def _at(role: str, path: str) -> str:
    return f"{role}.{path}" if role else path


def claim_references(spec: BaseModel) -> list[tuple[str, str]]:
    """(field path, claim name) of every PersistentVolumeClaim the spec names: its `pvc` fields, wherever they
    are, and the volumes of its pod template overlays."""
    found = [(f"{path}.claimName", ref.claim_name) for path, ref in _pvc_refs(spec, "")]
    for role in (c.ROLE_TRAINER, c.ROLE_INFERENCE):
        role_spec = getattr(spec, role, None)
        if isinstance(role_spec, RoleSpec):
            found += _template_claims(role, role_spec)
    return found


def _template_claims(role: str, role_spec: RoleSpec) -> list[tuple[str, str]]:
    found = []
    for i, volume in enumerate((role_spec.pod_template.get("spec") or {}).get("volumes") or []):
        claim = ((volume or {}).get("persistentVolumeClaim") or {}).get("claimName")
        if claim:
            found.append((_at(role, f"podTemplate.spec.volumes[{i}].persistentVolumeClaim.claimName"), str(claim)))
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
        return [
            Problem(
                f"{at}.tolerations",
                f"every node the role may use is tainted ({_taints(placed)}) and "
                "the role tolerates none of them: add a toleration for the node pool's taint",
            )
        ]
    if not role.gpus_per_replica:
        return []
    resource, wanted = role.gpu_resource, role.gpus_per_replica
    offered = [_count(n.allocatable.get(resource)) for n in placed if n not in untolerated]
    if not any(offered) and any(_count(n.allocatable.get(resource)) for n in untolerated):
        # The scheduler would say "untolerated taint", not "insufficient": the GPUs are there, behind a taint.
        with_gpus = [n for n in untolerated if _count(n.allocatable.get(resource))]
        return [
            Problem(
                f"{at}.tolerations",
                f"the nodes that offer {resource} are tainted ({_taints(with_gpus)}) and the role tolerates none "
                "of them: add a toleration for the GPU node pool's taint",
            )
        ]
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


def _taints(nodes: Sequence[Node]) -> str:
    shown = {f"{t.get('key')}={t.get('value', '')}:{t.get('effect')}" for n in nodes for t in _hard_taints(n.taints)}
    return ", ".join(sorted(shown))


def _count(quantity: Any) -> int:
    """A device count from a node's allocatable (a quantity; whole for extended resources); 0 when absent or odd."""
    try:
        return int(parse(quantity if quantity is not None else 0))
    except QuantityError:
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


def connect(kubeconfig: str | None, context: str | None, *, timeout: float = REQUEST_TIMEOUT) -> ClusterView:
    """A ClusterView read through the `kubernetes` client from the kubeconfig (its current context, or `context`);
    ClusterUnavailable naming the kubeconfig when it cannot be loaded, or the server when it cannot be used."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    configuration = client.Configuration()
    if kubeconfig and not Path(kubeconfig).expanduser().exists():
        raise ClusterUnavailable(f"kubeconfig {kubeconfig}: no such file (give --kubeconfig, or set $KUBECONFIG)")
    try:
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
    except (ConfigException, OSError) as exc:
        raise ClusterUnavailable(
            f"kubeconfig {kubeconfig or '(default: $KUBECONFIG or ~/.kube/config)'}: {exc}"
        ) from None
    configuration.retries = False  # one try: urllib3's default retries a refused or silent server three times
    api = client.ApiClient(configuration)
    name = context or (active or {}).get("name", "?")
    chosen = next((entry for entry in contexts or () if entry.get("name") == context), None) if context else active
    server = _Server(configuration.host, name, (min(CONNECT_TIMEOUT, timeout), timeout))
    core, apps, custom = client.CoreV1Api(api), client.AppsV1Api(api), client.CustomObjectsApi(api)
    extensions, node_api = client.ApiextensionsV1Api(api), client.NodeV1Api(api)
    server.probe(client.VersionApi(api).get_code)

    nodes = server.read(core.list_node)
    crds = server.read(extensions.list_custom_resource_definition)
    operators = server.read(
        apps.list_deployment_for_all_namespaces, label_selector=f"app.kubernetes.io/name={c.OPERATOR_NAME}"
    )
    readers: dict[str, Callable[[str, str], Any]] = {
        "PersistentVolumeClaim": lambda n, ns: server.read(core.read_namespaced_persistent_volume_claim, n, ns),
        "Secret": lambda n, ns: server.read(core.read_namespaced_secret, n, ns),
        "RuntimeClass": lambda n, _: server.read(node_api.read_runtime_class, n),
        "Namespace": lambda n, _: server.read(core.read_namespace, n),
        c.RUNTIME_KIND: lambda n, ns: server.read(
            custom.get_namespaced_custom_object, c.GROUP, c.VERSION, ns, c.RUNTIME_PLURAL, n
        ),
        c.CLUSTER_RUNTIME_KIND: lambda n, _: server.read(
            custom.get_cluster_custom_object, c.GROUP, c.VERSION, c.CLUSTER_RUNTIME_PLURAL, n
        ),
        c.POOL_KIND: lambda n, ns: server.read(
            custom.get_namespaced_custom_object, c.GROUP, c.VERSION, ns, c.POOL_PLURAL, n
        ),
    }
    read: dict[tuple[str, str, str], Any] = {}
    serialize = api.sanitize_for_serialization

    def get(kind: str, namespace: str, name: str) -> Mapping[str, Any] | str | None:
        key = (kind, namespace, name)
        if key not in read:
            found = readers[kind](name, namespace)
            read[key] = found if found in (None, NOT_ALLOWED) else serialize(found)
        return read[key]

    return ClusterView(
        context=name,
        namespace=((chosen or {}).get("context") or {}).get("namespace") or "default",
        nodes=None if _unread(nodes) else [_node(serialize(n)) for n in nodes.items],
        crds=None if _unread(crds) else {d.metadata.name: serialize(d) for d in crds.items if d.spec.group == c.GROUP},
        operators=None if _unread(operators) else [_operator(serialize(d)) for d in operators.items],
        get=get,
        server=configuration.host,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Server:
    """Calls through the official client with its own timeouts, its errors turned into what to do about them: 403
    is NOT_ALLOWED (that read is not checked), 404 None (it does not exist), and anything that says the cluster
    cannot be used (no connection, no answer in time, credentials refused, not an API server) ClusterUnavailable."""

    host: str
    context: str
    timeout: tuple[float, float]  # (connect, read) seconds: urllib3's, through the client's _request_timeout

    def probe(self, call: Callable[..., Any]) -> None:
        """The first request, GET /version (every user may read it, even an anonymous one: the
        system:public-info-viewer ClusterRole): a 403 or 404 there says the server cannot be used at all."""
        from kubernetes.client.exceptions import ApiException

        try:
            self._call(call)
        except ApiException as exc:
            if exc.status == 403:
                raise ClusterUnavailable(
                    f"the API server at {self.host} refused every request of context {self.context} (403 Forbidden: "
                    f"{_status_message(exc)}): ask the cluster's admin for access (kubectl auth can-i --list)"
                ) from None
            if exc.status == 404:
                raise ClusterUnavailable(
                    f"the API server at {self.host} answered 404 Not Found to /version: not a Kubernetes API "
                    f"server; check the server URL of context {self.context} (kubectl config view --minify)"
                ) from None
            raise self._unavailable(exc) from None

    def read(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._call(call, *args, **kwargs)
        except ApiException as exc:
            if exc.status == 403:
                return NOT_ALLOWED
            if exc.status == 404:
                return None
            raise self._unavailable(exc) from None

    def _call(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        import urllib3

        try:
            return call(*args, _request_timeout=self.timeout, **kwargs)
        except urllib3.exceptions.HTTPError as exc:
            raise self._unreachable(exc) from None

    def _unavailable(self, exc: Any) -> ClusterUnavailable:
        if exc.status == 401:
            return ClusterUnavailable(
                f"the API server at {self.host} refused the credentials of context {self.context} (401 "
                "Unauthorized): the token or client certificate is expired or wrong; log in again (refresh the "
                "cloud CLI's credentials, or kubectl config view --minify to see the user)"
            )
        return ClusterUnavailable(
            f"the API server at {self.host} (context {self.context}) answered {exc.status} {exc.reason}: "
            f"{_status_message(exc)}"
        )

    def _unreachable(self, exc: Exception) -> ClusterUnavailable:
        import urllib3

        reason = getattr(exc, "reason", None) if isinstance(exc, urllib3.exceptions.MaxRetryError) else exc
        if isinstance(reason, urllib3.exceptions.ReadTimeoutError):
            seconds = f"{self.timeout[1]:g}"
            return ClusterUnavailable(
                f"the API server at {self.host} (context {self.context}) did not answer within {seconds} s "
                "(--request-timeout); it may be overloaded, or the address is not an API server"
            )
        if isinstance(reason, urllib3.exceptions.ConnectTimeoutError) and not isinstance(
            reason, urllib3.exceptions.NewConnectionError  # its subclass, for a refused connection or a DNS failure
        ):
            why = f"no connection within {self.timeout[0]:g} s (a private endpoint without its VPN or bastion?)"
        else:  # urllib3 words it "HTTPSConnection(host=..., port=...): Failed to ...: [Errno 111] Connection refused"
            why = re.sub(r"^\w+\(host=[^)]*\): ", "", str(reason or exc))
            why = re.sub(r"\[Errno -?\d+\] ", "", why.removeprefix("Failed to establish a new connection: "))
            why = why[:1].lower() + why[1:]
        return ClusterUnavailable(
            f"cannot reach the API server at {self.host} (context {self.context}): {why}; check the kubeconfig's "
            "server and your network (kubectl cluster-info)"
        )


def _unread(listed: Any) -> bool:
    """A list the user may not read (NOT_ALLOWED), or that the server does not serve (None: 404)."""
    return listed is None or isinstance(listed, str)


def _status_message(exc: Any) -> str:
    """The message of the API server's Status body, else the body as it came."""
    try:
        return str(json.loads(exc.body).get("message") or exc.body)
    except (TypeError, ValueError, AttributeError):
        return str(exc.body or exc.reason).strip()


def _operator(deployment: Mapping[str, Any]) -> Operator:
    """The namespaces an operator Deployment serves, from its container's arguments as the chart writes them."""
    meta = deployment.get("metadata") or {}
    containers = ((((deployment.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers")) or []
    words = [str(w) for container in containers for w in [*(container.get("command") or []),
                                                          *(container.get("args") or [])]]  # fmt: skip
    namespaces = [after for before, after in itertools.pairwise(words) if before == "--namespace"]
    namespaces += [w.split("=", 1)[1] for w in words if w.startswith("--namespace=")]
    every = "--all-namespaces" in words
    return Operator(
        where=f"{meta.get('namespace')}/{meta.get('name')}",
        version=(meta.get("labels") or {}).get("app.kubernetes.io/version", ""),
        namespaces=None if every else tuple(namespaces),
        args_known=every or bool(namespaces),
    )


def _node(node: Mapping[str, Any]) -> Node:
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    return Node(
        meta.get("name", ""), meta.get("labels") or {}, status.get("allocatable") or {}, spec.get("taints") or []
    )
