"""kmock's Kubernetes emulator, extended with the API server behaviour the operator relies on.

Shared by the operator tests (tests/operator) and the scale benchmark (bench/operator_scale.py). Added here (not
in the operator): uid, creationTimestamp, resourceVersion on every write and
generation on spec changes; `generateName`; the status subresource (a /status patch changes only status, a main
patch never changes the status of a resource that has the subresource); label and field selectors on lists, and
label selectors on watches (`Emulator._serve_watch`, which also ends watches as the API server does: `end_watches`);
what a real API server refuses (grpolora.testing.kube_apiserver: schema validation of built-in kinds and of
GRPOLoraJobs, a few value rules, OwnerReferencesPermissionEnforcement against the requester's RBAC rules);
deletion as the API server, the garbage collector and the kubelet do it (see `Emulator.collect_garbage` and
`Emulator._begin_deletion`): propagation policies Background and Foreground, finalizers, Terminating pods; the
optimistic-concurrency precondition of a patch that carries `metadata.resourceVersion` (409 Conflict when the
object changed since, as a real server answers); the scale subresource of a CRD that declares one (RolloutPools:
`kubectl scale`); a Secret's stringData stored as data, never read back (`as_stored`); a NetworkPolicy port's
default protocol; mutating admission webhooks that a test installs (`Emulator.webhooks`, e.g. Kueue's Job webhook
in the tests' Kueue double); and a record of every (verb, group, resource) a client other than the test itself
sent, for the RBAC check.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import inspect
import itertools
import json
import math
import secrets
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import attrs
import kmock

from grpolora.api import constants as c
from grpolora.operator import rbac
from grpolora.testing import kube_apiserver

TEST_USER_AGENT = "grpolora-tests"
NAMESPACE = "team-a"  # where the helpers below put and read objects unless told otherwise
CRD_RESOURCE = f"{c.GROUP}/{c.VERSION}/{c.PLURAL}"
POOL_RESOURCE = f"{c.GROUP}/{c.VERSION}/{c.POOL_PLURAL}"
RUNTIME_RESOURCE = f"{c.GROUP}/{c.VERSION}/{c.RUNTIME_PLURAL}"
CLUSTER_RUNTIME_RESOURCE = f"{c.GROUP}/{c.VERSION}/{c.CLUSTER_RUNTIME_PLURAL}"
ALL_VERBS = {"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"}
# What the operator touches, declared for API discovery (Kopf reads it at start-up and serves only watchable ones).
RESOURCES: dict[str, kmock.ResourceInfo] = {
    CRD_RESOURCE: kmock.ResourceInfo(
        kind=c.KIND, namespaced=True, subresources={"status"}, shortnames={"glj"}, verbs=ALL_VERBS
    ),
    POOL_RESOURCE: kmock.ResourceInfo(
        kind=c.POOL_KIND, namespaced=True, subresources={"status", "scale"}, shortnames={"rpool"}, verbs=ALL_VERBS
    ),
    RUNTIME_RESOURCE: kmock.ResourceInfo(kind=c.RUNTIME_KIND, namespaced=True, shortnames={"glrt"}, verbs=ALL_VERBS),
    CLUSTER_RUNTIME_RESOURCE: kmock.ResourceInfo(
        kind=c.CLUSTER_RUNTIME_KIND, namespaced=False, shortnames={"cglrt"}, verbs=ALL_VERBS
    ),
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", namespaced=False),
    "v1/secrets": kmock.ResourceInfo(kind="Secret", namespaced=True),
    # Watchable as the real API serves them (discovery lists list and watch for every built-in kind): the operator
    # follows its kept children by watch.
    "v1/services": kmock.ResourceInfo(kind="Service", namespaced=True, verbs=ALL_VERBS),
    "v1/pods": kmock.ResourceInfo(kind="Pod", namespaced=True, subresources={"status"}),
    "v1/events": kmock.ResourceInfo(kind="Event", namespaced=True),
    "v1/persistentvolumeclaims": kmock.ResourceInfo(kind="PersistentVolumeClaim", namespaced=True),
    "batch/v1/jobs": kmock.ResourceInfo(kind="Job", namespaced=True, subresources={"status"}, verbs=ALL_VERBS),
    "apps/v1/statefulsets": kmock.ResourceInfo(
        kind="StatefulSet", namespaced=True, subresources={"status"}, verbs=ALL_VERBS
    ),
    "networking.k8s.io/v1/networkpolicies": kmock.ResourceInfo(kind="NetworkPolicy", namespaced=True, verbs=ALL_VERBS),
    "policy/v1/poddisruptionbudgets": kmock.ResourceInfo(kind="PodDisruptionBudget", namespaced=True, verbs=ALL_VERBS),
    # Kueue's Workload CRD (installed with Kueue); the tests play Kueue's admission.
    "kueue.x-k8s.io/v1beta1/workloads": kmock.ResourceInfo(
        kind="Workload", namespaced=True, subresources={"status"}, verbs=ALL_VERBS
    ),
    "kueue.x-k8s.io/v1beta1/resourceflavors": kmock.ResourceInfo(kind="ResourceFlavor", namespaced=False),
    "scheduling.k8s.io/v1/priorityclasses": kmock.ResourceInfo(kind="PriorityClass", namespaced=False),
}
PEERING_RESOURCES: dict[str, kmock.ResourceInfo] = {
    "kopf.dev/v1/kopfpeerings": kmock.ResourceInfo(kind="KopfPeering", namespaced=True, verbs=ALL_VERBS),
    "kopf.dev/v1/clusterkopfpeerings": kmock.ResourceInfo(kind="ClusterKopfPeering", namespaced=False, verbs=ALL_VERBS),
}
# metav1.FinalizerDeleteDependents: the API server puts it on an object deleted with propagationPolicy: Foreground; the
# garbage collector removes it once no dependent blocks the owner's deletion (then the API server removes the owner).
FOREGROUND_FINALIZER = "foregroundDeletion"
# The pod's terminationGracePeriodSeconds when unset (the API's default, pkg/apis/core/v1/defaults.go).
DEFAULT_GRACE_SECONDS = 30
_VERBS = {
    kmock.action.LIST: "list",
    kmock.action.WATCH: "watch",
    kmock.action.FETCH: "get",
    kmock.action.CREATE: "create",
    kmock.action.DELETE: "delete",
}


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    calls: set[tuple[str, str, str]] = attrs.field(factory=set, init=False)
    """(verb, API group, resource[/subresource]) of every request not sent by the test itself."""
    log: list[tuple[str, str, str | None]] = attrs.field(factory=list, init=False)
    """(verb, resource[/subresource], name) of every request not sent by the test itself, in order."""
    selectors: list[tuple[str, str, str, str]] = attrs.field(factory=list, init=False)
    """(verb, resource, labelSelector, client) of every list and watch not sent by the test itself, in order ('' for
    no selector; the client is its User-Agent's product, e.g. 'kopf' or 'grpo-lora-operator')."""
    watch_objects: Counter[tuple[str, str]] = attrs.field(factory=Counter, init=False)
    """Objects the watch streams delivered to clients other than the test, by (resource plural, object name): what
    the operator's watches cost it to receive and decode."""
    watch_bytes: Counter[tuple[str, str]] = attrs.field(factory=Counter, init=False)
    """Bytes of those events (as JSON), likewise."""
    created: list[tuple[str, str, str]] = attrs.field(factory=list, init=False)
    """(resource, namespace, name) of every successful create, in order (to spot duplicates)."""
    created_at: dict[tuple[str, str, str], float] = attrs.field(factory=dict, init=False)
    """time.monotonic() of the last successful create of each object (for the benchmark)."""
    authorize: Callable[[str, str, str], bool] | None = None
    """RBAC of the clients other than the test, as (verb, group, resource) -> allowed; None allows everything."""
    validate: bool = True
    """Refuse what a real API server refuses (grpolora.testing.kube_apiserver); the scale benchmark turns it off to
    measure the operator rather than the emulator's schema validation."""
    gc_delay: float = 0.2
    """Seconds between garbage-collector sweeps (a real collector also takes a while)."""
    uninstalled: set[str] = attrs.field(factory=set)
    """Resources of RESOURCES whose CRDs are not installed (yet): left out of discovery, and every request to them
    answers 404 NotFound, as a real API server answers for a resource it does not serve (`Cluster.install`)."""
    webhooks: list[Callable[[kmock.Request, dict[str, Any]], Awaitable[None] | None]] = attrs.field(
        factory=list, init=False
    )
    """Mutating admission webhooks: each is called (and awaited, if it is a coroutine function) with every create
    request and its object, which it may change (before validation, as the API server calls mutating webhooks before
    it validates); one that raises Refused refuses the create, as a webhook's denial does."""
    accounts: dict[str, tuple[str, Callable[[str, str, str], bool]]] = attrs.field(factory=dict, init=False)
    """Service accounts other than the operator's, by bearer token: (user name, its RBAC as (verb, group, resource)
    -> allowed). Their calls are refused 403 where not allowed, as the API server's RBAC authorizer refuses them
    (Cluster.service_account), and are not counted in `calls`."""
    pod_exit_seconds: float | None = 0.1
    """How long a deleted pod's containers take to exit on SIGTERM, after which the kubelet removes the pod; None:
    they ignore SIGTERM (as NCCL workers often do) and the pod stays Terminating for its whole grace period, until
    the kubelet's SIGKILL (`end_grace_periods` brings that forward)."""
    lost_nodes: set[str] = attrs.field(factory=set)
    """Nodes whose kubelet is gone (the node lost, or cut off from the API server): a deleted pod bound to one stays
    Terminating, since only its kubelet removes it (pkg/registry/core/pod/strategy.go CheckGracefulDelete), until the
    test removes it as the node's deletion or an admin's force-delete would; `end_grace_periods` passes it by."""
    pod_logs: dict[tuple[str, str, str], str] = attrs.field(factory=dict, init=False)
    """What the kubelet would serve as each container's log, by (namespace, pod, container); the test writes it.
    GET pods/<name>/log answers it as the API server does (pkg/registry/core/pod/rest/log.go and the kubelet):
    text/plain; `tailLines` keeps the last lines, then `limitBytes` cuts from the front of what is left (the
    PodLogOptions docs: "the number of bytes to read from the server before terminating the log output"); 404 for
    no such pod, 400 for a container the pod does not have or that has not started (no log yet)."""
    _versions: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1), init=False)
    _crd_schemas: dict[str, dict[str, Any]] = attrs.field(
        factory=lambda: {
            c.PLURAL: kube_apiserver.crd_schema(c.KIND),
            c.POOL_PLURAL: kube_apiserver.crd_schema(c.POOL_KIND),
            c.RUNTIME_PLURAL: kube_apiserver.crd_schema(c.RUNTIME_KIND),
            c.CLUSTER_RUNTIME_PLURAL: kube_apiserver.crd_schema(c.CLUSTER_RUNTIME_KIND),
        },
        init=False,
    )
    _scale_paths: dict[str, dict[str, str]] = attrs.field(
        factory=lambda: {
            plural: paths
            for plural, kind in ((c.PLURAL, c.KIND), (c.POOL_PLURAL, c.POOL_KIND))
            if (paths := kube_apiserver.crd_scale_paths(kind)) is not None
        },
        init=False,
    )
    _gc_due: bool = attrs.field(default=False, init=False)
    """Something was deleted, or created with owners, since the last sweep (the collector is event-driven too)."""
    _terminating: dict[Any, float] = attrs.field(factory=dict, init=False)
    """Terminating pods by key: the loop time at which the kubelet removes each."""

    async def _handle(self, request: kmock.Request) -> Any:
        # kmock matches each request against its reactions by scanning its whole request history, which makes a
        # long run quadratic; keep only the current request (the tests read `log` instead).
        del self._requests[:-1]
        if request.resource is not None and request.resource.plural:
            self._authorize_account(request)
            self._record(request)
            served = f"{request.resource.group}/{request.resource.version}/{request.resource.plural}".lstrip("/")
            if served in self.uninstalled:
                raise kube_apiserver.not_served()
            if request.subresource == "log" and str(request.resource.plural) == "pods":
                return self._pod_log(request)
            if request.subresource == "scale" and str(request.resource.plural) in self._scale_paths:
                return await self._scale(request, self._scale_paths[str(request.resource.plural)])
            if _is_secret_write(request):
                _string_data_as_data(request.data)
            if _is_write_of(request, "networking.k8s.io", "networkpolicies"):
                _network_policy_defaults(request.data)
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
                self._on_create(request)
                for webhook in self.webhooks:
                    called = webhook(request, request.data)
                    if inspect.isawaitable(called):
                        await called
                self._admit(request, request.data, created=True)
            elif request.action == kmock.action.UPDATE and isinstance(request.data, dict):
                merged = self._on_patch(request)
                if merged is not None:
                    before = copy.deepcopy(merged.get("spec"))
                    self._admit(request, merged, created=False)
                    if request.subresource != "status" and merged.get("spec") != before:
                        # Stored as admitted (defaulted, as the API server stores it), not as the client sent it.
                        current = self.objects[(request.resource, request.namespace, request.name)].raw
                        request.data["spec"] = _patch_between(current.get("spec") or {}, merged["spec"])
                if (request.resource, request.namespace, request.name) in self._terminating:
                    return await self._patch_terminating(request)
            elif request.action == kmock.action.DELETE and request.name is not None:
                kept = await self._begin_deletion(request)
                if kept is not None:
                    # Answered here: the base class removes any object with a deletionTimestamp and no finalizers
                    # after each write, which would end a pod's grace period at once.
                    return aiohttp.web.json_response(kept)
        response = await super()._handle(request)
        if response.status < 300 and (
            request.action == kmock.action.DELETE
            or (request.action == kmock.action.CREATE and (request.data.get("metadata") or {}).get("ownerReferences"))
        ):
            self._gc_due = True
        if request.action == kmock.action.CREATE and response.status < 300:
            meta = request.data.get("metadata", {})
            key = (str(request.resource.plural), meta.get("namespace"), meta.get("name"))
            self.created.append(key)
            self.created_at[key] = time.monotonic()
        return response

    def _pod_log(self, request: kmock.Request) -> aiohttp.web.Response:
        key = (kmock.resource("v1/pods"), request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise kube_apiserver.Refused(
                status=404, reason="NotFound", message=f'pods "{request.name}" not found', details={}
            )
        pod = self.objects[key].raw
        names = [container["name"] for container in (pod.get("spec") or {}).get("containers") or []]
        container = request.params.get("container") or (names[0] if len(names) == 1 else "")
        if container not in names:
            raise kube_apiserver.bad_request(f"container {container} is not valid for pod {request.name}")
        text = self.pod_logs.get((request.namespace, request.name, container))
        if text is None:
            message = f'container "{container}" in pod "{request.name}" is waiting to start: ContainerCreating'
            raise kube_apiserver.bad_request(message)
        if "tailLines" in request.params:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[len(lines) - int(request.params["tailLines"]) :]) if lines else ""
        data = text.encode()
        if "limitBytes" in request.params:
            data = data[: int(request.params["limitBytes"])]
        return aiohttp.web.Response(body=data, content_type="text/plain", charset="utf-8")

    async def _scale(self, request: kmock.Request, paths: Mapping[str, str]) -> Any:
        """GET or write the autoscaling/v1 Scale of a custom resource, as apiextensions-apiserver serves it: its
        spec.replicas is the object's specReplicasPath, its status.replicas the statusReplicasPath, its
        status.selector the labelSelectorPath (when set and a string there); a write is a
        patch of specReplicasPath alone, admitted like any write of the object (schema, CEL rules)."""
        spec_path = paths["specReplicasPath"].lstrip(".").split(".")
        status_path = paths["statusReplicasPath"].lstrip(".").split(".")
        if request.action == kmock.action.UPDATE and isinstance(request.data, dict):
            replicas = (request.data.get("spec") or {}).get("replicas")
            patch: Any = replicas
            for key in reversed(spec_path):
                patch = {key: patch}
            main = request.url.with_path(request.url.path.removesuffix("/scale"))
            main_patch = attrs.evolve(request, url=main, subresource=None, method=kmock.method.PATCH, data=patch)
            self._requests.append(main_patch)  # kmock matches its reactions against the requests it has seen
            written = await self._handle(main_patch)
            if written.status >= 300:
                return written
        key = (request.resource, request.namespace, request.name)
        found = self.objects[key].raw if key in self.objects and not self.objects[key].deleted else None
        if found is None:
            raise kube_apiserver.Refused(
                status=404,
                reason="NotFound",
                message=f'{request.resource.plural}.{request.resource.group} "{request.name}" not found',
                details={"name": request.name, "kind": str(request.resource.plural)},
            )

        def at(path: list[str]) -> Any:
            value: Any = found
            for part in path:
                value = value.get(part) if isinstance(value, dict) else None
            return value

        meta = found["metadata"]
        # status.selector from labelSelectorPath, where the CRD has one and the object holds a string there.
        selector_path = paths.get("labelSelectorPath")
        label_selector = at(selector_path.lstrip(".").split(".")) if selector_path else None
        selector = {"selector": label_selector} if isinstance(label_selector, str) else {}
        return aiohttp.web.json_response(
            {
                "apiVersion": "autoscaling/v1",
                "kind": "Scale",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion") if k in meta},
                "spec": {"replicas": at(spec_path)},
                "status": {"replicas": at(status_path) or 0, **selector},
            }
        )

    def _admit(self, request: kmock.Request, obj: dict[str, Any], *, created: bool) -> None:
        """Refuse what a real API server refuses (see grpolora.testing.kube_apiserver), before anything is stored."""
        if self.validate:
            strict_fields = (request.params or {}).get("fieldValidation") == "Strict"
            if request.resource.plural in self._crd_schemas and request.resource.group == c.GROUP:
                part = "status" if request.subresource == "status" and not created else "spec"
                key = (request.resource, request.namespace, request.name)
                stored = None if created or key not in self.objects else self.objects[key]
                old = stored.raw if stored is not None and not stored.deleted else None
                schema = self._crd_schemas[str(request.resource.plural)]
                kube_apiserver.validate_custom(obj, schema, strict=strict_fields, part=part, old=old)
            elif request.subresource != "status":
                kube_apiserver.validate_builtin(obj, strict=strict_fields)
        if not created and "ownerReferences" not in (request.data.get("metadata") or {}):
            return
        if self.authorize is None or _from_test(request):
            return
        for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
            if not ref.get("blockOwnerDeletion"):
                continue
            group = str(ref.get("apiVersion", "")).rpartition("/")[0]
            plural = next((str(r).rsplit("/", 1)[-1] for r, i in RESOURCES.items() if i.kind == ref.get("kind")), "")
            check = ("update", group, f"{plural}/finalizers")
            self.calls.add(check)
            if not self.authorize(*check):
                resource = f"{request.resource.plural}.{request.resource.group}".rstrip(".")
                raise kube_apiserver.forbidden(
                    resource,
                    (obj.get("metadata") or {}).get("name", ""),
                    "cannot set blockOwnerDeletion if an ownerReference refers to a resource you can't set "
                    f'finalizers on: cannot update resource "{plural}/finalizers" in API group "{group}"',
                )

    async def collect_garbage_forever(self) -> None:
        """The garbage collector and the kubelet: every `gc_delay` seconds, one sweep of `collect_garbage`."""
        while True:
            await asyncio.sleep(self.gc_delay)
            if self._gc_due or self._terminating:
                self._gc_due = False
                await self.collect_garbage()

    async def collect_garbage(self) -> None:
        """One sweep of the garbage collector (kubernetes pkg/controller/garbagecollector/garbagecollector.go), then
        of the kubelet. Event-driven there, a sweep here; the rules are the collector's:

        - attemptToDeleteItem: an object none of whose owners is "solid" is deleted. An owner is solid while it
          exists and is not waiting for its dependents (deletionTimestamp plus the foregroundDeletion finalizer);
          a dependent that itself has dependents and whose owner waits for them is deleted in the Foreground (so
          a GRPOLoraJob deleted in the foreground waits for its trainer Job's pods too), any other with the policy
          its own finalizers name, else Background. Objects already being deleted are left alone.
        - processDeletingDependentsItem: an owner waiting for its dependents loses the foregroundDeletion finalizer
          once no dependent with `blockOwnerDeletion: true` in its ownerReference to it exists any more; a
          Terminating pod still exists, so its owner waits for the kubelet. The API server then removes the owner
          if no other finalizer is left.
        - The kubelet removes a Terminating pod once its containers have exited (`pod_exit_seconds`), at the latest
          at the end of its grace period (SIGKILL).
        - An owner reference to a namespaced object in another namespace counts as absent (the docs page "Garbage
          Collection": cross-namespace owner references are disallowed by design). The docs page "Use Cascading
          Deletion" shows the same foreground and background behaviour from kubectl's side.
        """
        async with self._lock:
            store = self.objects._objects
            present = {key: obj for key, obj in store.items() if not obj.deleted}
            by_uid = {_meta(obj).get("uid"): (namespace, obj) for (_, namespace, _), obj in present.items()}
            dependents: dict[str, list[tuple[dict[str, Any], Any]]] = {}
            for key, obj in present.items():
                for ref in _meta(obj).get("ownerReferences") or []:
                    dependents.setdefault(ref.get("uid"), []).append((ref, key))
            changed = False
            for key, obj in present.items():
                meta = _meta(obj)
                if meta.get("deletionTimestamp"):
                    continue
                refs = meta.get("ownerReferences") or []
                found = [by_uid.get(ref.get("uid")) for ref in refs]
                owners = [owner for where, owner in filter(None, found) if where in (None, key[1])]
                if not refs or any(not _waits_for_dependents(owner) for owner in owners):
                    continue
                owner_waits = bool(owners)  # none solid: those left wait for their dependents
                if (owner_waits and dependents.get(meta.get("uid"))) or FOREGROUND_FINALIZER in (
                    meta.get("finalizers") or []
                ):
                    policy = "Foreground"
                else:
                    policy = "Background"
                await self._delete(key, policy, grace=None)
                changed = True
            for key, obj in list(present.items()):
                if obj.deleted or not _waits_for_dependents(obj):
                    continue
                blocking = [
                    dep
                    for ref, dep in dependents.get(_meta(obj).get("uid"), [])
                    if ref.get("blockOwnerDeletion") and not store[dep].deleted
                ]
                if not blocking:
                    left = [f for f in _meta(obj).get("finalizers") or [] if f != FOREGROUND_FINALIZER]
                    await self._write(key, {"metadata": {"finalizers": left}})
                    changed = True
            now = asyncio.get_running_loop().time()
            for key, due in list(self._terminating.items()):
                if due <= now:
                    await self._remove(key)
                    changed = True
            self._gc_due = self._gc_due or changed

    async def end_grace_periods(self) -> None:
        """The kubelet's SIGKILL at the end of every Terminating pod's grace period, brought forward (so a test need
        not wait the grace period out): the pods are removed now."""
        async with self._lock:
            for key, due in list(self._terminating.items()):
                if due != math.inf:  # a lost node's kubelet kills nothing
                    await self._remove(key)
            self._gc_due = True

    async def _begin_deletion(self, request: kmock.Request) -> dict[str, Any] | None:
        """A DELETE from a client: mark the object as the API server does when it is not removed at once, and return
        it as kept; None when it is absent or to be removed at once (the base class does both)."""
        options = request.data if isinstance(request.data, dict) else {}
        params = request.params or {}
        policy = options.get("propagationPolicy") or params.get("propagationPolicy") or "Background"
        # Absent: Background, most kinds' default (batch/v1 Jobs default to orphaning their pods: kubectl and the
        # operator always send a policy, so nothing here depends on it).
        if policy not in ("Background", "Foreground"):
            # Orphan (the collector strips the owner references instead) is not played: say so rather than delete.
            raise kube_apiserver.bad_request(f"the emulator does not play propagationPolicy {policy!r}")
        grace = options.get("gracePeriodSeconds", params.get("gracePeriodSeconds"))
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            obj = self.objects._objects.get(key)
            if obj is None or obj.deleted:
                return None
            await self._delete(key, policy, grace=None if grace is None else int(grace), remove=False)
            return obj.raw if _meta(obj).get("deletionTimestamp") else None

    async def _patch_terminating(self, request: kmock.Request) -> Any:
        """A write to a Terminating pod (the kubelet reports its status meanwhile): stored, the pod kept."""
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            obj = self.objects._objects[key]
            obj.patch(request.data)
            await self._buses[key[0]].put({"type": "MODIFIED", "object": obj.raw})
            return aiohttp.web.json_response(obj.raw)

    async def _delete(self, key: Any, policy: str, *, grace: int | None, remove: bool = True) -> None:
        """Delete as the API server does (staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go,
        Delete and deletionFinalizersForGarbageCollection; pkg/registry/core/pod/strategy.go, CheckGracefulDelete):
        Foreground adds the foregroundDeletion finalizer; a pod bound to a node gets a grace period (the request's,
        else its terminationGracePeriodSeconds) and stays Terminating until the kubelet removes it; an object with
        finalizers or a grace period gets a deletionTimestamp and stays, any other is removed (`remove`: here; else
        left to the caller). Caller holds the lock."""
        obj = self.objects._objects[key]
        meta = _meta(obj)
        if meta.get("deletionTimestamp"):
            # Already being deleted: the API server only answers with it, except that the delete's policy sets the
            # GC finalizers again (deletionFinalizersForGarbageCollection): Background drops foregroundDeletion,
            # and the object goes if no finalizer is left.
            if policy == "Background" and FOREGROUND_FINALIZER in (meta.get("finalizers") or []):
                left = [f for f in meta.get("finalizers") or [] if f != FOREGROUND_FINALIZER]
                await self._write(key, {"metadata": {"finalizers": left}})
            return
        finalizers = list(meta.get("finalizers") or [])
        if policy == "Foreground" and FOREGROUND_FINALIZER not in finalizers:
            finalizers.append(FOREGROUND_FINALIZER)
        seconds = 0
        # An unscheduled pod, or one whose containers have all stopped, goes at once.
        spec, status = obj.get("spec") or {}, obj.get("status") or {}
        if key[0].plural == "pods" and spec.get("nodeName") and status.get("phase") not in ("Succeeded", "Failed"):
            pod_grace = spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
            seconds = int(grace if grace is not None else pod_grace)
        if not finalizers and not seconds:
            if remove:
                await self._remove(key)
            return
        when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds)
        marked = {
            "deletionTimestamp": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "deletionGracePeriodSeconds": seconds,
            "finalizers": finalizers,
            "resourceVersion": str(next(self._versions)),
        }
        obj.patch({"metadata": marked})
        await self._buses[key[0]].put({"type": "MODIFIED", "object": obj.raw})
        if seconds:
            exits = seconds if self.pod_exit_seconds is None else min(seconds, self.pod_exit_seconds)
            lost = spec.get("nodeName") in self.lost_nodes
            self._terminating[key] = math.inf if lost else asyncio.get_running_loop().time() + exits
        self._gc_due = True

    async def _write(self, key: Any, patch: dict[str, Any]) -> None:
        """A metadata write by a controller (e.g. a finalizer removed); an object being deleted whose last finalizer
        goes is removed, as the API server does. Caller holds the lock."""
        obj = self.objects._objects[key]
        obj.patch({**patch, "metadata": {**patch.get("metadata", {}), "resourceVersion": str(next(self._versions))}})
        meta = _meta(obj)
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and key not in self._terminating:
            await self._remove(key)
        else:
            await self._buses[key[0]].put({"type": "MODIFIED", "object": obj.raw})

    async def _remove(self, key: Any) -> None:
        """Remove the object from storage (DELETED to the watches). Caller holds the lock."""
        self._terminating.pop(key, None)
        obj = self.objects._objects[key]
        if obj.deleted:
            return
        if _meta(obj).get("finalizers"):
            # The kubelet is done, but another finalizer still holds the pod (its controller removes it).
            await self._buses[key[0]].put({"type": "MODIFIED", "object": obj.raw})
            return
        raw = obj.raw
        obj.delete()
        await self._buses[key[0]].put({"type": "DELETED", "object": raw})
        self._gc_due = True

    def _record(self, request: kmock.Request) -> None:
        if _from_test(request) or _bearer(request) in self.accounts:
            return
        verb, resource = _verb_and_resource(request)
        self.calls.add((verb, str(request.resource.group), resource))
        self.log.append((verb, resource, request.name))
        if verb in ("list", "watch"):
            client = request.headers.get("User-Agent", "").split("/", 1)[0]
            self.selectors.append((verb, resource, (request.params or {}).get("labelSelector") or "", client))

    def _authorize_account(self, request: kmock.Request) -> None:
        """Refuse a service account's call its RBAC does not allow, worded as the API server's RBAC authorizer
        words it (plugin/pkg/auth/authorizer/rbac: `User "..." cannot <verb> resource "..." in API group "..."`)."""
        account = self.accounts.get(_bearer(request) or "")
        if account is None:
            return
        user, authorize = account
        verb, resource = _verb_and_resource(request)
        group = str(request.resource.group)
        if authorize(verb, group, resource):
            return
        where = f' in the namespace "{request.namespace}"' if request.namespace else " at the cluster scope"
        qualified = f"{request.resource.plural}.{group}".rstrip(".")
        raise kube_apiserver.forbidden(
            qualified,
            request.name or "",
            f'User "{user}" cannot {verb} resource "{resource}" in API group "{group}"{where}',
        )

    def _on_create(self, request: kmock.Request) -> None:
        meta = request.data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        if request.namespace and not meta.get("namespace"):
            meta["namespace"] = request.namespace
        key = (request.resource, meta.get("namespace"), meta.get("name"))
        if key in self.objects and not self.objects[key].deleted:
            return  # the base class answers 409; nothing of the request is kept
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["resourceVersion"] = str(next(self._versions))
        meta["generation"] = 1

    def _on_patch(self, request: kmock.Request) -> dict[str, Any] | None:
        """Server-set fields on the patch; returns the object as it will be (None if it does not exist)."""
        data: dict[str, Any] = request.data
        key = (request.resource, request.namespace, request.name)
        current = self.objects[key].raw if key in self.objects and not self.objects[key].deleted else None
        precondition = (data.get("metadata") or {}).get("resourceVersion")
        if current is not None and precondition and precondition != current["metadata"].get("resourceVersion"):
            # A patch that names a resourceVersion applies only to that version (client-go's optimistic lock,
            # controller-runtime's MergeFromWithOptimisticLock); the API server answers 409 Conflict otherwise.
            raise kube_apiserver.conflict(request.resource.plural, request.resource.group, request.name or "")
        if request.subresource == "status":
            for field in [k for k in data if k != "status"]:
                del data[field]
        elif self._has_status_subresource(request.resource):
            data.pop("status", None)
        meta = data.setdefault("metadata", {})
        meta["resourceVersion"] = str(next(self._versions))
        if current is not None and "spec" in data:
            new_spec = _merge(current.get("spec") or {}, data["spec"])
            if new_spec != (current.get("spec") or {}):
                meta["generation"] = int(current.get("metadata", {}).get("generation", 1)) + 1
        return _merge(current, data) if current is not None else None

    def _has_status_subresource(self, resource: kmock.resource) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    def _KubernetesEmulator__get_objs(self, request: kmock.Request, strict: bool) -> list[kmock.Object]:
        """kmock's object lookup, without scanning every object for a named one (the benchmark holds thousands).

        Same result as the base class: exact (resource, namespace, name) when strict or namespaced, else a scan.
        """
        store: dict[Any, kmock.Object] = self.objects._objects
        if request.name is not None and (strict or request.namespace is not None):
            found = store.get((request.resource, request.namespace, request.name))
            return [found] if found is not None else []
        wanted = (request.resource.group, request.resource.version, request.resource.plural)
        return [
            obj
            for (resource, namespace, name), obj in store.items()
            if (resource.group, resource.version, resource.plural) == wanted
            and (request.namespace is None or namespace == request.namespace)
            and (request.name is None or name == request.name)
        ]

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        selector = parse_label_selector((request.params or {}).get("labelSelector") or "")
        if selector:
            result["items"] = [item for item in result["items"] if _labels_match(item, selector)]
        fields = (request.params or {}).get("fieldSelector")
        if fields:
            wanted = dict(term.split("=", 1) for term in fields.split(","))
            result["items"] = [item for item in result["items"] if _fields_match(item, wanted)]
        if not (request.params or {}).get("continue"):
            # The revision the list is served at (etcd's, above every object's): a client compares its cache with it
            # (the List's metadata.resourceVersion; continued pages keep the first page's snapshot in the API).
            result.setdefault("metadata", {})["resourceVersion"] = str(next(self._versions))
        return _page(result, request.params or {})

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        """A watch as the API server serves one from its watch cache, with its label selector applied on the server
        (kmock's own streams every object of the resource): the objects that match now, as ADDED, then each change
        as the selector sees it (staging/src/k8s.io/apiserver/pkg/storage/cacher/cache_watcher.go,
        cacheWatcher.convertToWatchEvent): an object that comes to match is ADDED, one that keeps matching MODIFIED,
        and one that stops matching (a label removed) or is deleted is DELETED, carrying the content the watcher last
        saw; the rest is never sent. `end_watches` ends the open ones. What each stream delivers to a client other
        than the test is counted (`watch_objects`, `watch_bytes`)."""
        selector = parse_label_selector((request.params or {}).get("labelSelector") or "")  # a 400 comes first
        yield b""  # the headers go now, even if nothing comes for a while
        plural = str(request.resource.plural)
        counted = not _from_test(request)
        bus = self._buses[request.resource]
        # Marked before the snapshot, so that no change between the two is lost (one seen twice is harmless).
        mark = await bus.mark()
        try:
            async with self._lock:
                found = self._KubernetesEmulator__get_objs(request, strict=False)
                pending = [{"type": "ADDED", "object": obj.raw} for obj in found if not obj.deleted]
            shown: dict[tuple[str, str], dict[str, Any]] = {}
            async for event in _chain(pending, bus.stream(since=mark)):
                if event.get("type") == _END_OF_WATCH:
                    if event["expired"]:
                        yield {"type": "ERROR", "object": _EXPIRED}
                    return
                delivered = _as_selected(event, selector, shown, request.namespace, request.name)
                if delivered is None:
                    continue
                if counted:
                    key = (plural, str(_meta(delivered["object"]).get("name")))
                    self.watch_objects[key] += 1
                    self.watch_bytes[key] += len(json.dumps(delivered))
                yield delivered
        finally:
            await bus.unmark(mark)

    async def end_watches(self, resource: str, *, expired: bool) -> None:
        """End every open watch of `resource` (e.g. 'batch/v1/jobs'): as the API server's timeout ends one (the
        client watches again from the last resourceVersion it saw), or, `expired`, with the ERROR event a watch gets
        once its resourceVersion is older than the watch cache's window: a Status of code 410, reason Expired (the
        client must list again)."""
        await self._buses[kmock.resource(resource)].put({"type": _END_OF_WATCH, "expired": expired})

    async def remove_unseen(self, resource: str, name: str, namespace: str) -> None:
        """Remove an object without a DELETED to the open watches: a deletion a watch missed (it came while the
        watch was away and the watch cache's window has passed it; only a list shows it)."""
        async with self._lock:
            self.objects._objects[(kmock.resource(resource), namespace, name)].delete()


_END_OF_WATCH = "grpolora-emulator/end-of-watch"
# What a watch from a resourceVersion older than the watch cache's window gets (apimachinery's
# errors.NewResourceExpired, from the cacher's watch cache: "too old resource version"), as an ERROR event.
_EXPIRED = {
    "kind": "Status",
    "apiVersion": "v1",
    "metadata": {},
    "status": "Failure",
    "message": "too old resource version",
    "reason": "Expired",
    "code": 410,
}


async def _chain(first: list[dict[str, Any]], then: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for item in first:
        yield item
    async for item in then:
        yield item


def _as_selected(
    event: Mapping[str, Any],
    selector: list[tuple[str, str, str | None]],
    shown: dict[tuple[str, str], dict[str, Any]],
    namespace: str | None,
    name: str | None,
) -> dict[str, Any] | None:
    """The event a watcher with this label selector gets (None: none), given what it was last shown (`shown`,
    updated): cacheWatcher.convertToWatchEvent's rule, with `shown` standing in for the event's previous object."""
    obj = event.get("object") or {}
    meta = _meta(obj)
    if namespace is not None and meta.get("namespace") != namespace:
        return None
    if name is not None and meta.get("name") != name:
        return None
    key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
    passes = event.get("type") != "DELETED" and _labels_match(obj, selector)
    before = shown.get(key)
    if passes:
        shown[key] = dict(obj)
        return {"type": "MODIFIED" if before is not None else "ADDED", "object": obj}
    if before is None:
        return None
    del shown[key]
    # The content the watcher last saw, at the event's resourceVersion.
    gone = {**before, "metadata": {**_meta(before), "resourceVersion": meta.get("resourceVersion")}}
    return {"type": "DELETED", "object": gone}


def _page(result: dict[str, Any], params: Mapping[str, str]) -> dict[str, Any]:
    """One page of a list, as the API server serves `limit` and `continue`: items in key order (namespace, name),
    at most `limit` of them, and a `continue` token (opaque to clients; here the last key served) while more remain.
    kubernetes.io/docs/reference/using-api/api-concepts ("Retrieving large results sets in chunks")."""
    limit = int(params.get("limit") or 0)
    if not limit:
        return result
    items = sorted(result["items"], key=_list_key)
    after = params.get("continue")
    if after:
        items = [item for item in items if "/".join(_list_key(item)) > after]
    served, more = items[:limit], items[limit:]
    metadata = dict(result.get("metadata") or {})
    if more:
        metadata["continue"] = "/".join(_list_key(served[-1]))
        metadata["remainingItemCount"] = len(more)
    return {**result, "metadata": metadata, "items": served}


def _list_key(item: Mapping[str, Any]) -> tuple[str, str]:
    meta = item.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def _meta(obj: Mapping[str, Any]) -> dict[str, Any]:
    return dict(obj.get("metadata") or {})


def _waits_for_dependents(obj: Mapping[str, Any]) -> bool:
    """Deleted in the foreground and waiting for its dependents (the collector's isDeletingDependents)."""
    meta = _meta(obj)
    return bool(meta.get("deletionTimestamp")) and FOREGROUND_FINALIZER in (meta.get("finalizers") or [])


def _from_test(request: kmock.Request) -> bool:
    return request.headers.get("User-Agent", "").startswith(TEST_USER_AGENT) and _bearer(request) is None


def _bearer(request: kmock.Request) -> str | None:
    """The bearer token a request carries (a service account's, see Emulator.accounts)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token if scheme == "Bearer" and token else None


def _verb_and_resource(request: kmock.Request) -> tuple[str, str]:
    """The RBAC verb and resource[/subresource] of a request, as the API server's authorizer sees them."""
    verb = _VERBS.get(request.action) if request.action else None
    if request.action == kmock.action.UPDATE:
        verb = "patch" if request.method == kmock.method.PATCH else "update"
    if verb is None:
        verb = str(request.method).lower()
    resource = str(request.resource.plural)
    if request.subresource:
        resource += f"/{request.subresource}"
    return verb, resource


def _fields_match(obj: Mapping[str, Any], wanted: Mapping[str, str]) -> bool:
    """Field selectors: equality on dotted paths (e.g. type=Warning, involvedObject.name=x)."""
    for path, value in wanted.items():
        found: Any = obj
        for part in path.split("."):
            found = found.get(part) if isinstance(found, Mapping) else None
        if str(found) != value:
            return False
    return True


def parse_label_selector(text: str) -> list[tuple[str, str, str | None]]:
    """A label selector's requirements as (key, operator, value): the equality-based forms the API accepts
    (`k=v`, `k==v`, `k!=v`) and existence (`k`, `!k`), as apimachinery's labels.Parse reads them
    (staging/src/k8s.io/apimachinery/pkg/labels/selector.go); the set-based forms (`in`, `notin`) are not played
    and answered 400 rather than misread."""
    requirements: list[tuple[str, str, str | None]] = []
    for term in (part.strip() for part in text.split(",") if part.strip()):
        if "(" in term or " in " in term or " notin " in term:
            raise kube_apiserver.bad_request(f"labelSelector {text!r}: set-based requirements are not played here")
        if "!=" in term:
            key, value = term.split("!=", 1)
            requirements.append((key.strip(), "!=", value.strip()))
        elif "=" in term:
            key, value = term.replace("==", "=", 1).split("=", 1)
            requirements.append((key.strip(), "=", value.strip()))
        elif term.startswith("!"):
            requirements.append((term[1:].strip(), "!", None))
        else:
            requirements.append((term, "exists", None))
    return requirements


def _labels_match(obj: Mapping[str, Any], requirements: list[tuple[str, str, str | None]]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for key, operator, value in requirements:
        found = labels.get(key)
        if operator == "=" and found != value:
            return False
        if operator == "!=" and found == value:
            return False
        if operator == "exists" and key not in labels:
            return False
        if operator == "!" and key in labels:
            return False
    return True


def _is_write_of(request: kmock.Request, group: str, plural: str) -> bool:
    return (
        request.action in (kmock.action.CREATE, kmock.action.UPDATE)
        and isinstance(request.data, dict)
        and str(request.resource.group or "") == group
        and str(request.resource.plural) == plural
    )


def _is_secret_write(request: kmock.Request) -> bool:
    return _is_write_of(request, "", "secrets")


def _network_policy_defaults(policy: dict[str, Any]) -> None:
    """A NetworkPolicy (or a patch of one) with the API server's defaults: a port's protocol is TCP when unset
    (pkg/apis/networking/v1/defaults.go SetDefaults_NetworkPolicyPort; Kubernetes 1.33), so a read returns it."""
    for direction in ("ingress", "egress"):
        for rule in (policy.get("spec") or {}).get(direction) or []:
            for port in (rule or {}).get("ports") or []:
                port.setdefault("protocol", "TCP")


def as_stored(obj: Mapping[str, Any]) -> dict[str, Any]:
    """`obj` as the API server stores it: for a Secret, its stringData merged into data (_string_data_as_data)."""
    stored = copy.deepcopy(dict(obj))
    if obj.get("kind") == "Secret" and obj.get("apiVersion") == "v1":
        _string_data_as_data(stored)
    return stored


def _string_data_as_data(secret: dict[str, Any]) -> None:
    """A Secret (or a patch of one) as the API server stores it: stringData is write-only, merged into data (base64),
    its keys winning, when the v1 object is decoded (pkg/apis/core/v1/conversion.go, Convert_v1_Secret_To_core_Secret;
    Kubernetes 1.33), and "never output when reading from the API" (the Secret v1 API reference, stringData). A
    patch's `stringData: null` removes nothing."""
    written = secret.pop("stringData", None)
    if written:
        encoded = {key: base64.b64encode(str(value).encode()).decode() for key, value in written.items()}
        secret["data"] = {**(secret.get("data") or {}), **encoded}


def _patch_between(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch that turns `old` into `new` (null for what `new` leaves out)."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            patch[key] = _patch_between(before, value)
        elif value != before:
            patch[key] = value
    return patch


def _merge(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    result = dict(base)
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = _merge(result[key], value)
        else:
            result[key] = value
    return result


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- the emulator over HTTP, with helpers that play kubectl and the Kubernetes controllers --------------------


class Cluster:
    """The emulator plus helpers that play the parts of kubectl and of the Kubernetes controllers."""

    def __init__(self, emulator: Emulator, url: str, session: aiohttp.ClientSession):
        self.emulator, self.url, self.session = emulator, url, session

    # ---- kubectl --------------------------------------------------------------------------------------

    async def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Create a GRPOLoraJob, a RolloutPool or a runtime (by its kind)."""
        # kubectl's default: unknown fields are refused, not silently dropped.
        return await self._call("POST", _collection(doc) + "?fieldValidation=Strict", doc)

    async def patch_object(self, doc: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
        """`kubectl patch --type=merge` of the object `doc` names (kind, metadata.name and namespace)."""
        return await self._call("PATCH", f"{_collection(doc)}/{doc['metadata']['name']}", patch)

    async def delete_pool(self, name: str, namespace: str = NAMESPACE, *, cascade: str = "Background") -> None:
        """`kubectl delete rpool NAME --cascade=background|foreground`."""
        path = f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{namespace}/{c.POOL_PLURAL}/{name}"
        await self._call("DELETE", path, _delete_options(cascade))

    async def patch_spec(self, name: str, spec: dict[str, Any], namespace: str = NAMESPACE) -> None:
        await self._call(
            "PATCH", f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{namespace}/{c.PLURAL}/{name}", {"spec": spec}
        )

    async def delete_job(self, name: str, namespace: str = NAMESPACE, *, cascade: str = "Background") -> None:
        """`kubectl delete glj NAME --cascade=background|foreground` (Argo CD deletes in the foreground)."""
        path = f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{namespace}/{c.PLURAL}/{name}"
        await self._call("DELETE", path, _delete_options(cascade))

    # ---- the Job, StatefulSet and kubelet controllers ----------------------------------------------------

    async def set_status(self, resource: str, name: str, status: dict[str, Any], namespace: str = NAMESPACE) -> None:
        """Patch a child's status, as its controller would (e.g. resource='batch/v1/jobs')."""
        group_version, plural = resource.rsplit("/", 1)
        root = f"/api/{group_version}" if group_version == "v1" else f"/apis/{group_version}"
        await self._call("PATCH", f"{root}/namespaces/{namespace}/{plural}/{name}/status", {"status": status})

    async def delete_pod(self, name: str, namespace: str = NAMESPACE, *, grace: int | None = None) -> None:
        """DELETE a pod with its own grace period (or `grace`), as the Job controller's deleteActivePods, the taint
        manager's NoExecute eviction (pkg/controller/tainteviction) or a drain do: a pod bound to a node stays
        Terminating until its kubelet removes it (never, on one of `Emulator.lost_nodes`)."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        await self._call("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", body)

    def install(self, *resources: str) -> None:
        """Install CRDs that were left out (`running_cluster(uninstalled=...)`), e.g. Kueue's after the operator."""
        for resource in resources:
            self.emulator.uninstalled.discard(resource)
            self.emulator.resources[resource] = RESOURCES[resource]

    def service_account(self, namespace: str, name: str, authorize: Callable[[str, str, str], bool]) -> dict[str, str]:
        """Request headers of a client acting as this service account: every call it makes is checked against
        `authorize` (the RBAC rules bound to it) and refused 403 where not allowed (Emulator.accounts)."""
        token = secrets.token_hex(16)
        self.emulator.accounts[token] = (f"system:serviceaccount:{namespace}:{name}", authorize)
        return {"Authorization": f"Bearer {token}", "User-Agent": name}

    async def add_pod(self, pod: dict[str, Any], namespace: str = NAMESPACE) -> None:
        await self._call("POST", f"/api/v1/namespaces/{namespace}/pods", pod)

    async def run_pod_of(
        self, resource: str, name: str, index: int = 0, *, node: str = "gpu-node-0", namespace: str = NAMESPACE
    ) -> str:
        """A running pod of a Job or StatefulSet (e.g. resource='batch/v1/jobs'), as its controller creates it and
        the scheduler binds it: the template's labels and terminationGracePeriodSeconds, an ownerReference with
        controller and blockOwnerDeletion true (metav1.NewControllerRef, which the Job and StatefulSet controllers
        use), spec.nodeName. Returns the pod's name."""
        owner = self.get(resource, name, namespace)
        assert owner is not None, f"{resource} {namespace}/{name} does not exist"
        template = owner["spec"]["template"]
        pod_name = f"{name}-{index}" if owner["kind"] == "StatefulSet" else f"{name}-{index}-{secrets.token_hex(3)}"
        ref = {
            "apiVersion": owner["apiVersion"],
            "kind": owner["kind"],
            "name": name,
            "uid": owner["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
        spec = {"nodeName": node, "containers": [{"name": "main", "image": "x"}]}
        if "terminationGracePeriodSeconds" in template.get("spec", {}):
            spec["terminationGracePeriodSeconds"] = template["spec"]["terminationGracePeriodSeconds"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name,
                "namespace": namespace,
                "labels": dict(template.get("metadata", {}).get("labels") or {}),
                "ownerReferences": [ref],
            },
            "spec": spec,
            "status": {"phase": "Running"},
        }
        await self.add_pod(pod, namespace)
        return pod_name

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        async with self.session.request(method, self.url + path, json=body) as response:
            payload = await response.json(content_type=None)
            assert response.status < 300, f"{method} {path}: {response.status} {payload}"
            return payload

    # ---- reading ------------------------------------------------------------------------------------------

    def get(self, resource: str, name: str, namespace: str = NAMESPACE) -> dict[str, Any] | None:
        key = (kmock.resource(resource), namespace, name)
        if key not in self.emulator.objects or self.emulator.objects[key].deleted:
            return None
        return self.emulator.objects[key].raw

    def secret_data(self, name: str, namespace: str = NAMESPACE) -> dict[str, str]:
        """A Secret's keys as a client reads them from the API server: its `data`, decoded ({} when absent)."""
        secret = self.get("v1/secrets", name, namespace) or {}
        return {key: base64.b64decode(value).decode() for key, value in (secret.get("data") or {}).items()}

    def job(self, name: str, namespace: str = NAMESPACE) -> dict[str, Any]:
        found = self.get(CRD_RESOURCE, name, namespace)
        assert found is not None, f"GRPOLoraJob {namespace}/{name} is gone"
        return found

    def status(self, name: str, namespace: str = NAMESPACE) -> dict[str, Any]:
        return self.job(name, namespace).get("status") or {}

    def pool_status(self, name: str, namespace: str = NAMESPACE) -> dict[str, Any]:
        found = self.get(POOL_RESOURCE, name, namespace)
        assert found is not None, f"RolloutPool {namespace}/{name} is gone"
        return found.get("status") or {}

    def condition(self, name: str, type_: str, namespace: str = NAMESPACE) -> dict[str, Any]:
        for condition in self.status(name, namespace).get("conditions") or []:
            if condition["type"] == type_:
                return condition
        return {}

    def objects(self, resource: str, namespace: str = NAMESPACE) -> dict[str, dict[str, Any]]:
        return {
            name: obj.raw
            for (res, ns, name), obj in self.emulator.objects.items()
            if res == resource and ns == namespace and not obj.deleted
        }

    def events(self, name: str, namespace: str = NAMESPACE) -> list[tuple[str, str, str]]:
        """(type, reason, message) of the events about a job, oldest first."""
        found = [
            obj.raw
            for (res, ns, _), obj in self.emulator.objects.items()
            if res == "v1/events" and ns == namespace and not obj.deleted
        ]
        found = [e for e in found if e["involvedObject"]["name"] == name]
        found.sort(key=lambda e: int(e["metadata"]["resourceVersion"]))
        return [(e["type"], e["reason"], e["message"]) for e in found]


_PLURALS = {
    c.KIND: c.PLURAL,
    c.POOL_KIND: c.POOL_PLURAL,
    c.RUNTIME_KIND: c.RUNTIME_PLURAL,
    c.CLUSTER_RUNTIME_KIND: c.CLUSTER_RUNTIME_PLURAL,
}


def _collection(doc: dict[str, Any]) -> str:
    """The API path of the collection of a document of ours (a cluster-scoped kind has no namespace)."""
    plural = _PLURALS[doc.get("kind", c.KIND)]
    if doc.get("kind") == c.CLUSTER_RUNTIME_KIND:
        return f"/apis/{c.GROUP}/{c.VERSION}/{plural}"
    namespace = doc["metadata"].setdefault("namespace", NAMESPACE)
    return f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{namespace}/{plural}"


def _delete_options(cascade: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": cascade}


@contextlib.asynccontextmanager
async def running_cluster(
    *,
    peering: bool = False,
    authorize: Callable[[str, str, str], bool] | None = rbac.allowed,
    validate: bool = True,
    uninstalled: tuple[str, ...] = (),
) -> AsyncIterator[Cluster]:
    """The emulator over HTTP; `authorize` is the operator's RBAC (by default what the chart grants it);
    `uninstalled`: resources of RESOURCES not served until `Cluster.install`."""
    emulator = Emulator(authorize=authorize, validate=validate, uninstalled=set(uninstalled))
    async with emulator, kmock.Server(emulator) as server:
        for resource, info in RESOURCES.items():
            if resource not in uninstalled:
                emulator.resources[resource] = info
        if peering:
            for resource, info in PEERING_RESOURCES.items():
                emulator.resources[resource] = info
        url = str(server.url).rstrip("/")
        collector = asyncio.create_task(emulator.collect_garbage_forever(), name="garbage collector")
        try:
            async with aiohttp.ClientSession(headers={"User-Agent": TEST_USER_AGENT}) as session:
                yield Cluster(emulator, url, session)
        finally:
            collector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collector
