"""kmock's Kubernetes emulator, extended with the API server behaviour the operator relies on.

Shared by the operator tests (tests/operator) and the scale benchmark (bench/operator_scale.py). Added here (not
in the operator): uid, creationTimestamp, resourceVersion on every write and
generation on spec changes; `generateName`; the status subresource (a /status patch changes only status, a main
patch never changes the status of a resource that has the subresource); label and field selectors on lists;
what a real API server refuses (grpolora.testing.kube_apiserver: schema validation of built-in kinds and of
GRPOLoraJobs, a few value rules, OwnerReferencesPermissionEnforcement against the requester's RBAC rules);
garbage collection that takes time, as the real collector does (objects whose owners are all gone are removed
by a sweep every `gc_delay` seconds, not at once); the optimistic-concurrency precondition of a patch that carries
`metadata.resourceVersion` (409 Conflict when the object changed since, as a real server answers); mutating
admission webhooks that a test installs (`Emulator.webhooks`, e.g. Kueue's Job webhook in the tests' Kueue double);
and a record of every (verb, group, resource) a client other than the test itself sent, for the RBAC check.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
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
ALL_VERBS = {"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"}
# What the operator touches, declared for API discovery (Kopf reads it at start-up and serves only watchable ones).
RESOURCES: dict[str, kmock.ResourceInfo] = {
    CRD_RESOURCE: kmock.ResourceInfo(
        kind=c.KIND, namespaced=True, subresources={"status"}, shortnames={"glj"}, verbs=ALL_VERBS
    ),
    POOL_RESOURCE: kmock.ResourceInfo(
        kind=c.POOL_KIND, namespaced=True, subresources={"status"}, shortnames={"rpool"}, verbs=ALL_VERBS
    ),
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", namespaced=False),
    "v1/secrets": kmock.ResourceInfo(kind="Secret", namespaced=True),
    "v1/services": kmock.ResourceInfo(kind="Service", namespaced=True),
    "v1/pods": kmock.ResourceInfo(kind="Pod", namespaced=True, subresources={"status"}),
    "v1/events": kmock.ResourceInfo(kind="Event", namespaced=True),
    "v1/persistentvolumeclaims": kmock.ResourceInfo(kind="PersistentVolumeClaim", namespaced=True),
    "batch/v1/jobs": kmock.ResourceInfo(kind="Job", namespaced=True, subresources={"status"}, verbs=ALL_VERBS),
    "apps/v1/statefulsets": kmock.ResourceInfo(
        kind="StatefulSet", namespaced=True, subresources={"status"}, verbs=ALL_VERBS
    ),
    "networking.k8s.io/v1/networkpolicies": kmock.ResourceInfo(kind="NetworkPolicy", namespaced=True),
    "policy/v1/poddisruptionbudgets": kmock.ResourceInfo(kind="PodDisruptionBudget", namespaced=True),
    # Kueue's Workload CRD (installed with Kueue); the tests play Kueue's admission.
    "kueue.x-k8s.io/v1beta1/workloads": kmock.ResourceInfo(
        kind="Workload", namespaced=True, subresources={"status"}, verbs=ALL_VERBS
    ),
    "kueue.x-k8s.io/v1beta1/resourceflavors": kmock.ResourceInfo(kind="ResourceFlavor", namespaced=False),
}
PEERING_RESOURCES: dict[str, kmock.ResourceInfo] = {
    "kopf.dev/v1/kopfpeerings": kmock.ResourceInfo(kind="KopfPeering", namespaced=True, verbs=ALL_VERBS),
    "kopf.dev/v1/clusterkopfpeerings": kmock.ResourceInfo(kind="ClusterKopfPeering", namespaced=False, verbs=ALL_VERBS),
}
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
    webhooks: list[Callable[[kmock.Request, dict[str, Any]], None]] = attrs.field(factory=list, init=False)
    """Mutating admission webhooks: each is called with every create request and its object, which it may change
    (before validation, as the API server calls mutating webhooks before it validates)."""
    _versions: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1), init=False)
    _crd_schemas: dict[str, dict[str, Any]] = attrs.field(
        factory=lambda: {
            c.PLURAL: kube_apiserver.crd_schema(c.KIND),
            c.POOL_PLURAL: kube_apiserver.crd_schema(c.POOL_KIND),
        },
        init=False,
    )
    _gc_due: bool = attrs.field(default=False, init=False)
    """Something was deleted, or created with owners, since the last sweep (the collector is event-driven too)."""

    async def _handle(self, request: kmock.Request) -> Any:
        # kmock matches each request against its reactions by scanning its whole request history, which makes a
        # long run quadratic; keep only the current request (the tests read `log` instead).
        del self._requests[:-1]
        if request.resource is not None and request.resource.plural:
            self._record(request)
            served = f"{request.resource.group}/{request.resource.version}/{request.resource.plural}".lstrip("/")
            if served in self.uninstalled:
                raise kube_apiserver.not_served()
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
                self._on_create(request)
                for webhook in self.webhooks:
                    webhook(request, request.data)
                self._admit(request, request.data, created=True)
            elif request.action == kmock.action.UPDATE and isinstance(request.data, dict):
                merged = self._on_patch(request)
                if merged is not None:
                    self._admit(request, merged, created=False)
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
        """The garbage collector: every `gc_delay` seconds, remove the objects whose owners are all gone."""
        while True:
            await asyncio.sleep(self.gc_delay)
            if self._gc_due:
                self._gc_due = False
                await self.collect_garbage()

    async def collect_garbage(self) -> None:
        async with self._lock:
            live = {obj.get("metadata", {}).get("uid") for obj in self.objects._objects.values() if not obj.deleted}
            orphans = [
                (resource, obj)
                for (resource, _, _), obj in self.objects._objects.items()
                if not obj.deleted
                and (refs := obj.get("metadata", {}).get("ownerReferences") or [])
                and not any(ref.get("uid") in live for ref in refs)
            ]
            for resource, obj in orphans:
                raw = obj.raw
                obj.delete()
                await self._buses[resource].put({"type": "DELETED", "object": raw})

    def _record(self, request: kmock.Request) -> None:
        if _from_test(request):
            return
        verb = _VERBS.get(request.action) if request.action else None
        if request.action == kmock.action.UPDATE:
            verb = "patch" if request.method == kmock.method.PATCH else "update"
        if verb is None:
            verb = str(request.method).lower()
        resource = str(request.resource.plural)
        if request.subresource:
            resource += f"/{request.subresource}"
        self.calls.add((verb, str(request.resource.group), resource))
        self.log.append((verb, resource, request.name))

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
        selector = (request.params or {}).get("labelSelector")
        if selector:
            wanted = dict(term.split("=", 1) for term in selector.split(","))
            result["items"] = [item for item in result["items"] if _labels_match(item, wanted)]
        fields = (request.params or {}).get("fieldSelector")
        if fields:
            wanted = dict(term.split("=", 1) for term in fields.split(","))
            result["items"] = [item for item in result["items"] if _fields_match(item, wanted)]
        return result


def _from_test(request: kmock.Request) -> bool:
    return request.headers.get("User-Agent", "").startswith(TEST_USER_AGENT)


def _fields_match(obj: Mapping[str, Any], wanted: Mapping[str, str]) -> bool:
    """Field selectors: equality on dotted paths (e.g. type=Warning, involvedObject.name=x)."""
    for path, value in wanted.items():
        found: Any = obj
        for part in path.split("."):
            found = found.get(part) if isinstance(found, Mapping) else None
        if str(found) != value:
            return False
    return True


def _labels_match(obj: Mapping[str, Any], wanted: Mapping[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(key) == value for key, value in wanted.items())


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
        """Create a GRPOLoraJob or a RolloutPool (by its kind)."""
        namespace = doc["metadata"].setdefault("namespace", NAMESPACE)
        plural = c.POOL_PLURAL if doc.get("kind") == c.POOL_KIND else c.PLURAL
        # kubectl's default: unknown fields are refused, not silently dropped.
        path = f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{namespace}/{plural}?fieldValidation=Strict"
        return await self._call("POST", path, doc)

    async def delete_pool(self, name: str, namespace: str = NAMESPACE) -> None:
        await self._call("DELETE", f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{namespace}/{c.POOL_PLURAL}/{name}")

    async def patch_spec(self, name: str, spec: dict[str, Any], namespace: str = NAMESPACE) -> None:
        await self._call(
            "PATCH", f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{namespace}/{c.PLURAL}/{name}", {"spec": spec}
        )

    async def delete_job(self, name: str, namespace: str = NAMESPACE) -> None:
        await self._call("DELETE", f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{namespace}/{c.PLURAL}/{name}")

    # ---- the Job, StatefulSet and kubelet controllers ----------------------------------------------------

    async def set_status(self, resource: str, name: str, status: dict[str, Any], namespace: str = NAMESPACE) -> None:
        """Patch a child's status, as its controller would (e.g. resource='batch/v1/jobs')."""
        group_version, plural = resource.rsplit("/", 1)
        root = f"/api/{group_version}" if group_version == "v1" else f"/apis/{group_version}"
        await self._call("PATCH", f"{root}/namespaces/{namespace}/{plural}/{name}/status", {"status": status})

    def install(self, *resources: str) -> None:
        """Install CRDs that were left out (`running_cluster(uninstalled=...)`), e.g. Kueue's after the operator."""
        for resource in resources:
            self.emulator.uninstalled.discard(resource)
            self.emulator.resources[resource] = RESOURCES[resource]

    async def add_pod(self, pod: dict[str, Any], namespace: str = NAMESPACE) -> None:
        await self._call("POST", f"/api/v1/namespaces/{namespace}/pods", pod)

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
