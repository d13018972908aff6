"""A real reward service on loopback for the tests: the contract of docs/tasks.md, served by uvicorn in a thread.

Routes: /score (1.0 when the answer is in the completion, else 0.0; needs `Authorization: Bearer s3cret` when
`auth` is on), /flaky (503 for the first `fail_first` requests of each batch size, then like /score), /slow
(sleeps past any test timeout), /short (one score too few), /refuse (400). Every request is recorded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Self

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from grpolora.testing.servers import free_port

TOKEN = "Bearer s3cret"


@dataclass
class Record:
    requests: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    flaky_seen: Counter = field(default_factory=Counter)


def make_app(record: Record, *, fail_first: int = 2, slow_seconds: float = 30.0) -> FastAPI:
    app = FastAPI()

    def scores(body: dict) -> list[float]:
        return [1.0 if item["answer"] and item["answer"] in item["completion"] else 0.0 for item in body["items"]]

    @app.middleware("http")
    async def count(request: Request, call_next):
        record.in_flight += 1
        record.most_in_flight = max(record.most_in_flight, record.in_flight)
        try:
            await asyncio.sleep(0.05)  # long enough for concurrent requests to overlap
            return await call_next(request)
        finally:
            record.in_flight -= 1

    @app.post("/score")
    async def score(request: Request):
        body = await request.json()
        record.requests.append(body)
        record.headers.append(dict(request.headers))
        if getattr(app.state, "auth", False) and request.headers.get("authorization") != TOKEN:
            return JSONResponse({"detail": "unauthorized"}, status_code=401)
        return {"scores": scores(body)}

    @app.post("/flaky")
    async def flaky(request: Request):
        body = await request.json()
        key = len(body["items"])
        record.flaky_seen[key] += 1
        if record.flaky_seen[key] <= fail_first:
            return JSONResponse({"detail": "warming up"}, status_code=503)
        return {"scores": scores(body)}

    @app.post("/slow")
    async def slow(request: Request):
        await asyncio.sleep(slow_seconds)
        return {"scores": scores(await request.json())}

    @app.post("/short")
    async def short(request: Request):
        return {"scores": scores(await request.json())[:-1]}

    @app.post("/refuse")
    async def refuse():
        return JSONResponse({"detail": "bad items"}, status_code=400)

    return app


class AppServer:
    """uvicorn serving an ASGI app on 127.0.0.1 in a daemon thread; `stop()` ends it."""

    def __init__(self, app: FastAPI):
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> Self:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"{type(self).__name__} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


class RewardServer(AppServer):
    """The reward service of `make_app`."""

    def __init__(self, **app_options):
        self.record = Record()
        super().__init__(make_app(self.record, **app_options))
