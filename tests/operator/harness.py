"""Run the real operator (Kopf and all) against the emulator over HTTP (grpolora.testing.kube_emulator, shared with
the scale benchmark), plus a fake trainer rank 0.

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

import kmock
import kopf
from aiohttp import web

from grpolora.operator.controller import Controller
from grpolora.operator.main import OperatorOptions, serve
from grpolora.testing.kube_emulator import NAMESPACE, Cluster

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

    def passes(self) -> int:
        """Job passes the operator has run so far (its reconcile and monitor handlers, from its own metrics)."""
        assert self.controller is not None
        registry = self.controller.metrics.registry
        name = "grpolora_reconcile_duration_seconds_count"
        return int(sum(registry.get_sample_value(name, {"handler": h}) or 0 for h in ("reconcile", "monitor")))

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
    """Trainer rank 0's /status, scripted by the test (None answers 503, as while loading); also a pool server's
    open GET /v1/adapter (`adapters`, None: 503), since every `*.svc` name resolves here."""

    def __init__(self) -> None:
        self.report: dict[str, Any] | None = None
        self.adapters: dict[str, Any] | None = None
        self.polls = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _status(self, _: web.Request) -> web.Response:
        self.polls += 1
        if self.report is None:
            return web.Response(status=503, text="loading")
        return web.json_response(self.report)

    async def _adapters(self, _: web.Request) -> web.Response:
        if self.adapters is None:
            return web.Response(status=503, text="loading")
        return web.json_response(self.adapters)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/status", self._status)
        app.router.add_get("/v1/adapter", self._adapters)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


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


async def a_pass(cluster: Cluster, operator: OperatorThread) -> None:
    """Wake a pass of the job demo, as a write of its StatefulSet by the StatefulSet controller does, and wait for it
    to run."""
    before = operator.passes()
    sts = cluster.get("apps/v1/statefulsets", "demo-inference")
    assert sts is not None
    ready = int((sts.get("status") or {}).get("observedGeneration") or 0) + 1
    await cluster.set_status("apps/v1/statefulsets", "demo-inference", {"observedGeneration": ready})
    await wait_for(lambda: operator.passes() > before, "a pass of the operator")
