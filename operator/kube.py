"""The one module that talks to the Kubernetes API: a thin async client over aiohttp.

Why aiohttp with Kopf's credentials rather than kubernetes_asyncio: Kopf already runs on aiohttp and logs in to a
`kopf.ConnectionInfo` (service account in a pod, kubeconfig outside); this client builds its session from that same
object (its SSL context and Authorization header), so the operator has one login path, one HTTP stack and no
generated client of several megabytes. It speaks plain JSON to a handful of endpoints (create, get, list, merge
patch, delete, events), which is all the operator needs, and works unchanged against the kmock emulator in tests.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import kopf

from grpolora.api import constants as c

logger = logging.getLogger(__name__)
K8sObject = dict[str, Any]
EVENT_MESSAGE_MAX: Final = 1024  # the API server rejects longer event messages
STRICT: Final = {"fieldValidation": "Strict"}
LIST_PAGE: Final = 500
"""Objects per list request: client-go's pager's default page size (k8s.io/client-go/tools/pager)."""


def format_selector(pairs: Mapping[str, str]) -> str:
    """Equality requirements as a label or field selector says them (`a=1,b=2`, sorted: the form
    metav1.FormatLabelSelector gives matchLabels, so that equal selectors are equal strings)."""
    return ",".join(f"{key}={value}" for key, value in sorted(pairs.items()))


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        root = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        path = f"{root}/namespaces/{namespace}/{self.plural}" if self.namespaced else f"{root}/{self.plural}"
        if name is not None:
            path += f"/{name}"
            if subresource is not None:
                path += f"/{subresource}"
        return path


SECRET: Final = Kind("", "v1", "secrets", "Secret")
SERVICE: Final = Kind("", "v1", "services", "Service")
POD: Final = Kind("", "v1", "pods", "Pod")
EVENT: Final = Kind("", "v1", "events", "Event")
PVC: Final = Kind("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim")
NETWORK_POLICY: Final = Kind("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy")
JOB: Final = Kind("batch", "v1", "jobs", "Job")
POD_DISRUPTION_BUDGET: Final = Kind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
KUEUE_WORKLOAD: Final = Kind("kueue.x-k8s.io", "v1beta1", "workloads", "Workload")
KUEUE_RESOURCE_FLAVOR: Final = Kind("kueue.x-k8s.io", "v1beta1", "resourceflavors", "ResourceFlavor", namespaced=False)
STATEFULSET: Final = Kind("apps", "v1", "statefulsets", "StatefulSet")
PRIORITY_CLASS: Final = Kind("scheduling.k8s.io", "v1", "priorityclasses", "PriorityClass", namespaced=False)
GRPOLORAJOB: Final = Kind(c.GROUP, c.VERSION, c.PLURAL, c.KIND)
ROLLOUTPOOL: Final = Kind(c.GROUP, c.VERSION, c.POOL_PLURAL, c.POOL_KIND)
GRPOLORA_RUNTIME: Final = Kind(c.GROUP, c.VERSION, c.RUNTIME_PLURAL, c.RUNTIME_KIND)
CLUSTER_GRPOLORA_RUNTIME: Final = Kind(
    c.GROUP, c.VERSION, c.CLUSTER_RUNTIME_PLURAL, c.CLUSTER_RUNTIME_KIND, namespaced=False
)
# Kopf's peering objects (read by grpolora.operator.peering; written by Kopf itself).
KOPF_PEERING: Final = Kind("kopf.dev", "v1", "kopfpeerings", "KopfPeering")
CLUSTER_KOPF_PEERING: Final = Kind("kopf.dev", "v1", "clusterkopfpeerings", "ClusterKopfPeering", namespaced=False)
KINDS: Final = {
    k.kind: k
    for k in (
        SECRET,
        SERVICE,
        POD,
        EVENT,
        NETWORK_POLICY,
        POD_DISRUPTION_BUDGET,
        KUEUE_WORKLOAD,
        KUEUE_RESOURCE_FLAVOR,
        PRIORITY_CLASS,
        JOB,
        STATEFULSET,
        GRPOLORAJOB,
        ROLLOUTPOOL,
        GRPOLORA_RUNTIME,
        CLUSTER_GRPOLORA_RUNTIME,
        PVC,
        KOPF_PEERING,
        CLUSTER_KOPF_PEERING,
    )
}


def kind_of(obj: Mapping[str, Any]) -> Kind:
    kind = KINDS.get(obj.get("kind", ""))
    if kind is None or kind.api_version != obj.get("apiVersion"):
        raise ValueError(f"no API endpoint known for {obj.get('apiVersion')} {obj.get('kind')}")
    return kind


class ApiError(Exception):
    """A failed API call. `status` is the HTTP status, 0 when the server could not be reached."""

    def __init__(self, status: int, reason: str, message: str, *, method: str, path: str):
        self.status, self.reason, self.message = status, reason, message
        super().__init__(f"{method} {path}: {status} {reason}: {message}")

    @property
    def transient(self) -> bool:
        """Worth retrying as is: unreachable, throttled or a server-side failure."""
        return self.status == 0 or self.status == 429 or self.status >= 500


Login = Callable[[], kopf.ConnectionInfo | None]


class RateLimiter:
    """A token bucket, as client-go's: up to `burst` requests at once, then `qps` per second. It bounds what a
    burst of new jobs (or a resync of many) asks of the API server; Kopf's own watches are not counted."""

    def __init__(
        self,
        qps: float,
        burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self.qps, self.burst = qps, burst
        self._clock, self._sleep = clock, sleep
        self._tokens = float(burst)
        self._stamp = clock()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self._lock:  # waiters are served in order
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.qps)
            self._stamp = now
            if self._tokens >= 1:
                self._tokens -= 1
                return
            wait = (1 - self._tokens) / self.qps
            await self._sleep(wait)
            self._tokens, self._stamp = 0.0, now + wait


class KubeClient:
    """Create, get, list, merge-patch and delete namespaced objects; post events.

    `login` returns the credentials (the same callable Kopf's login handler uses); it is called again once when
    the server answers 401, because service-account tokens are rotated on disk.
    """

    def __init__(
        self,
        login: Login,
        *,
        timeout: float = 15.0,
        instance: str = c.OPERATOR_NAME,
        rate_limit: RateLimiter | None = None,
    ):
        self._login = login
        self._rate_limit = rate_limit
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._instance = instance
        self._info: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None
        self._retired: list[aiohttp.ClientSession] = []

    def use(self, info: kopf.ConnectionInfo) -> None:
        """Switch to new credentials (requests in flight finish on the old session, closed at the end)."""
        if self._session is not None:
            self._retired.append(self._session)
        self._info, self._session = info, None

    async def close(self) -> None:
        for session in [*self._retired, *([self._session] if self._session else [])]:
            await session.close()
        self._retired, self._session = [], None

    def _current(self) -> tuple[kopf.ConnectionInfo, aiohttp.ClientSession]:
        if self._info is None:
            info = self._login()
            if info is None:
                raise ApiError(0, "NoCredentials", "no Kubernetes credentials found", method="", path="")
            self.use(info)
        assert self._info is not None
        if self._session is None:
            headers = {**self._info.as_http_headers(), "User-Agent": f"{c.OPERATOR_NAME}/{self._instance}"}
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._info.as_ssl_context(), limit=0),
                headers=headers,
                timeout=self._timeout,
            )
        return self._info, self._session

    async def _call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        if self._rate_limit is not None:
            await self._rate_limit.acquire()
        for attempt in (1, 2):
            info, session = self._current()
            try:
                async with session.request(
                    method,
                    info.server.rstrip("/") + path,
                    params=params,
                    json=body,
                    headers={"Content-Type": content_type} if body is not None else None,
                ) as response:
                    if response.status == 401 and attempt == 1:
                        fresh = self._login()
                        if fresh is not None:
                            self.use(fresh)
                            continue
                    if response.status >= 400:
                        raise await _api_error(response, method, path)
                    if response.content_type == "text/plain":  # a pod's log
                        return await response.text()
                    return await response.json(content_type=None) if response.content_length != 0 else None
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise ApiError(0, type(exc).__name__, str(exc) or "unreachable", method=method, path=path) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    # ---- verbs -------------------------------------------------------------------------------------------

    async def create(self, obj: Mapping[str, Any]) -> bool:
        """Create if absent: True if created, False if an object of that name already exists (never replaced).

        With strict field validation: an unknown field is refused (400) rather than dropped without a word.
        """
        meta = obj["metadata"]
        try:
            await self._call("POST", kind_of(obj).path(meta.get("namespace")), params=STRICT, body=obj)
        except ApiError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def get(self, kind: Kind, namespace: str | None, name: str) -> K8sObject | None:
        try:
            return await self._call("GET", kind.path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def served(self, kind: Kind) -> bool:
        """Whether the API server serves this kind now (API discovery: e.g. Kueue's Workloads once its CRDs exist)."""
        root = f"/apis/{kind.group}/{kind.version}" if kind.group else f"/api/{kind.version}"
        try:
            found = await self._call("GET", root)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("name") == kind.plural for r in (found or {}).get("resources") or [])

    async def list(
        self,
        kind: Kind,
        namespace: str,
        labels: Mapping[str, str],
        *,
        fields: Mapping[str, str] | None = None,
        page: int = LIST_PAGE,
        keep: Callable[[K8sObject], K8sObject | None] | None = None,
    ) -> list[K8sObject]:
        """Every matching object (list_at, without the list's resourceVersion)."""
        found, _ = await self.list_at(kind, namespace, labels, fields=fields, page=page, keep=keep)
        return found

    async def list_at(
        self,
        kind: Kind,
        namespace: str,
        labels: Mapping[str, str],
        *,
        fields: Mapping[str, str] | None = None,
        page: int = LIST_PAGE,
        keep: Callable[[K8sObject], K8sObject | None] | None = None,
    ) -> tuple[list[K8sObject], int]:
        """(every matching object, the list's resourceVersion: the revision its first page was served at, 0 when the
        server gives none). The objects come `page` at a time (`limit`/`continue`, as client-go's pager lists): the
        server never builds one response of the whole collection, nor does this process hold it. `keep` maps each
        item as its page arrives (None drops it), so that what is kept of a large list is only what the caller reads.

        A `continue` token expires (410 Gone, after about 5 minutes of etcd compaction); the list then starts over
        once, as the API's docs say a client must ("Retrieving large results sets in chunks",
        kubernetes.io/docs/reference/using-api/api-concepts)."""
        params = {"limit": str(page)}
        if labels:
            params["labelSelector"] = format_selector(labels)
        if fields:
            params["fieldSelector"] = format_selector(fields)
        for attempt in (1, 2):
            found: list[K8sObject] = []
            token = ""
            version: int | None = None
            try:
                while True:
                    asked = {**params, "continue": token} if token else params
                    result = await self._call("GET", kind.path(namespace), params=asked)
                    for item in (result or {}).get("items") or []:
                        kept = item if keep is None else keep(item)
                        if kept is not None:
                            found.append(kept)
                    meta = (result or {}).get("metadata") or {}
                    if version is None:
                        served_at = str(meta.get("resourceVersion") or "")
                        version = int(served_at) if served_at.isdigit() else 0
                    token = meta.get("continue") or ""
                    if not token:
                        return found, version
            except ApiError as exc:
                if exc.status != 410 or not token or attempt == 2:
                    raise
                logger.info("listing %s: the continue token expired; listing again", kind.plural)
        raise AssertionError("unreachable")  # pragma: no cover

    async def patch(
        self,
        kind: Kind,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        *,
        subresource: str | None = None,
    ) -> K8sObject | None:
        """JSON merge patch; None if the object is gone."""
        try:
            return await self._call(
                "PATCH",
                kind.path(namespace, name, subresource),
                body=patch,
                content_type="application/merge-patch+json",
            )
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def delete(self, kind: Kind, namespace: str, name: str, *, propagation: str = "Background") -> bool:
        """Delete (dependents go by ownerReferences in the background); False if it was already gone."""
        options = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation}
        try:
            await self._call("DELETE", kind.path(namespace, name), body=options)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def pod_log(
        self, namespace: str, name: str, *, container: str, tail_lines: int, limit_bytes: int
    ) -> str | None:
        """The last `tail_lines` lines of a container's log, at most `limit_bytes` (pods/log; None: no such pod)."""
        params = {"container": container, "tailLines": str(tail_lines), "limitBytes": str(limit_bytes)}
        try:
            return await self._call("GET", POD.path(namespace, name, "log"), params=params)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def post_event(
        self, involved: Mapping[str, Any], type_: str, reason: str, message: str, *, now: datetime.datetime
    ) -> None:
        await self._call(
            "POST",
            EVENT.path(involved["namespace"]),
            body=event_body(involved, type_, reason, message, now=now, instance=self._instance),
        )


def event_body(
    involved: Mapping[str, Any], type_: str, reason: str, message: str, *, now: datetime.datetime, instance: str
) -> K8sObject:
    """A core/v1 Event about a GRPOLoraJob (`kubectl describe glj` lists these), or a RolloutPool (`kind` in
    `involved`)."""
    stamp = now.astimezone(datetime.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")
    if len(message) > EVENT_MESSAGE_MAX:
        message = message[: EVENT_MESSAGE_MAX - 1] + "…"
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{involved['name']}.", "namespace": involved["namespace"]},
        "involvedObject": {
            "apiVersion": c.API_VERSION,
            "kind": involved.get("kind", c.KIND),
            "name": involved["name"],
            "namespace": involved["namespace"],
            "uid": involved.get("uid", ""),
        },
        "type": type_,
        "reason": reason,
        "message": message,
        "source": {"component": c.OPERATOR_NAME},
        "reportingComponent": c.OPERATOR_NAME,
        "reportingInstance": instance,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


async def _api_error(response: aiohttp.ClientResponse, method: str, path: str) -> ApiError:
    try:
        payload = await response.json(content_type=None)
    except (ValueError, aiohttp.ClientError):
        payload = None
    if isinstance(payload, dict):
        return ApiError(
            response.status,
            str(payload.get("reason") or response.reason),
            str(payload.get("message") or ""),
            method=method,
            path=path,
        )
    return ApiError(response.status, str(response.reason), "", method=method, path=path)
