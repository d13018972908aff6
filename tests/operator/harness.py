"""Run the real operator (Kopf and all) against the emulator over HTTP, plus a fake trainer rank 0.

The operator runs in its own thread and event loop, as `grpolora operator` would in its own process: Kopf treats
every task of its loop as its own at shutdown, and the emulator and fake trainer must keep serving from the test's
loop meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import kmock
import kopf
from aiohttp import web

from grpolora.api import constants as c
from grpolora.operator import rbac
from grpolora.operator.controller import Controller
from grpolora.operator.main import OperatorOptions, serve
from tests.operator.emulator import CRD_RESOURCE, RESOURCES, TEST_USER_AGENT, Emulator

NAMESPACE = "team-a"
FAST_INTERVAL = 0.1  # seconds between monitor passes in tests


class OperatorThread:
    """`grpolora operator --namespace ... --standalone` in a thread, logged in to the emulator."""

    def __init__(self, server: str, options: OperatorOptions):
        self.server, self.options = server, options
        self.stop_flag, self.ready_flag = threading.Event(), threading.Event()
        self.controller: Controller | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="operator", daemon=True)

    def _run(self) -> None:
        def remember(controller: Controller) -> None:
            self.controller = controller

        try:
            asyncio.run(
                serve(
                    self.options,
                    login=lambda: kopf.ConnectionInfo(server=self.server),
                    stop_flag=self.stop_flag,
                    ready_flag=self.ready_flag,
                    on_controller=remember,
                )
            )
        except BaseException as exc:  # reported by stop(); a thread cannot raise into the test
            self.error = exc

    async def start(self) -> OperatorThread:
        self._thread.start()
        await wait_for(lambda: self.ready_flag.is_set() or not self._thread.is_alive(), "operator start", timeout=20)
        if self.error is not None:
            raise self.error
        return self

    async def stop(self) -> None:
        self.stop_flag.set()
        await asyncio.to_thread(self._thread.join, 20)
        assert not self._thread.is_alive(), "the operator did not stop within 20 s"
        if self.error is not None:
            raise self.error


def operator_options(**overrides: Any) -> OperatorOptions:
    values: dict[str, Any] = {
        "namespaces": (NAMESPACE,),
        "metrics_port": 0,
        "health_port": 0,
        "peering": None,
        "status_interval": FAST_INTERVAL,
        "bind": "127.0.0.1",
        # Most passes read the workloads from the watch; drift repair of the kept children still comes within 1 s.
        "resync_interval": 10 * FAST_INTERVAL,
    }
    return OperatorOptions(**{**values, **overrides})


class FakeTrainer:
    """Trainer rank 0's /status, scripted by the test (None answers 503, as while loading)."""

    def __init__(self) -> None:
        self.report: dict[str, Any] | None = None
        self.polls = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _status(self, _: web.Request) -> web.Response:
        self.polls += 1
        if self.report is None:
            return web.Response(status=503, text="loading")
        return web.json_response(self.report)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/status", self._status)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class Cluster:
    """The emulator plus helpers that play the parts of kubectl and of the Kubernetes controllers."""

    def __init__(self, emulator: Emulator, url: str, session: aiohttp.ClientSession):
        self.emulator, self.url, self.session = emulator, url, session

    # ---- kubectl --------------------------------------------------------------------------------------

    async def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
        namespace = doc["metadata"].setdefault("namespace", NAMESPACE)
        # kubectl's default: unknown fields are refused, not silently dropped.
        path = f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{namespace}/{c.PLURAL}?fieldValidation=Strict"
        return await self._call("POST", path, doc)

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
    *, peering: bool = False, authorize: Callable[[str, str, str], bool] | None = rbac.allowed, validate: bool = True
) -> AsyncIterator[Cluster]:
    """The emulator over HTTP; `authorize` is the operator's RBAC (by default what the chart grants it)."""
    async with Emulator(authorize=authorize, validate=validate) as emulator, kmock.Server(emulator) as server:
        for resource, info in RESOURCES.items():
            emulator.resources[resource] = info
        if peering:
            from tests.operator.emulator import PEERING_RESOURCES

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


@contextlib.asynccontextmanager
async def fake_trainer() -> AsyncIterator[FakeTrainer]:
    """A trainer /status server that every `*.svc` name resolves to (in this process, for aiohttp)."""
    trainer = FakeTrainer()
    await trainer.start()
    try:
        async with kmock.AiohttpInterceptor("127.0.0.1", trainer.port, extra=re.compile(r".+\.svc")):
            yield trainer
    finally:
        await trainer.stop()


async def wait_for(check: Callable[[], Any] | Callable[[], Awaitable[Any]], what: str, *, timeout: float = 10.0) -> Any:
    """Poll until `check()` is truthy; fail naming `what` (and the last value) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last value: {last!r}")
