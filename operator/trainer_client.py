"""Polls trainer rank 0's `GET /status` (unauthenticated JSON, grpolora.api.status.TrainerStatus), and the open
`GET /v1/adapter` of a RolloutPool's servers (the adapter versions they serve, per job).

Workers hold no Kubernetes credentials: progress reaches the cluster only through this poll. While the pods start,
DNS names and ports do not answer yet; that is reported back as a short reason, not raised.

A trainer runs its job author's code, and one operator polls every tenant's: each answer is read up to
MAX_STATUS_BYTES (a larger one is refused, not buffered; one nested deeper than the JSON parser recurses is refused
too) within `timeout` seconds all told, and what is refused is
counted (grpolora_trainer_status_refused_total, by reason), so that one trainer cannot hold the operator's memory or
its passes.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Final

import aiohttp
from pydantic import ValidationError

from grpolora.api.plan import JobPlan
from grpolora.api.status import TrainerStatus

if TYPE_CHECKING:
    from grpolora.operator.metrics import Metrics

MAX_STATUS_BYTES: Final = 64 * 1024
"""The largest /status (or /v1/adapter) body read: a trainer's report is a few hundred bytes, a pool's adapter
report a few per job."""


def status_url(job_plan: JobPlan) -> str:
    return f"http://{job_plan.master_addr}:{job_plan.job.spec.trainer.status_port}/status"


class TrainerUnavailable(Exception):
    """Trainer rank 0 did not answer with a valid status (not up yet, restarting, or broken)."""


class _TooLarge(ValueError):
    pass


class _TooDeep(ValueError):
    """JSON nested deeper than the parser recurses (json.loads raises RecursionError, not a ValueError)."""


class TrainerStatusClient:
    def __init__(self, *, timeout: float = 3.0, max_bytes: int = MAX_STATUS_BYTES, metrics: Metrics | None = None):
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._max_bytes = max_bytes
        self._metrics = metrics
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            # Made lazily so that it belongs to the operator's event loop.
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def json(self, url: str) -> dict[str, Any] | None:
        """GET a JSON object; None when the server does not answer with one (starting, gone, not reachable): a
        report that is missing is not an error."""
        try:
            async with self._client().get(url) as response:
                if response.status != 200:
                    return None
                payload = await self._read(response)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            self._refused(exc)
            return None
        return payload if isinstance(payload, dict) else None

    async def _read(self, response: aiohttp.ClientResponse) -> Any:
        """The JSON body, read up to the cap (a declared Content-Length over it is refused before reading)."""
        if response.content_length is not None and response.content_length > self._max_bytes:
            raise _TooLarge(f"body over {self._max_bytes} bytes ({response.content_length})")
        # StreamReader.read(n) returns what is buffered (up to n bytes), not the body to its end: read piece by piece.
        body = bytearray()
        async for piece in response.content.iter_any():
            body += piece
            if len(body) > self._max_bytes:
                raise _TooLarge(f"body over {self._max_bytes} bytes")
        try:
            return json.loads(body)
        except RecursionError:
            raise _TooDeep(f"JSON nested too deep ({len(body)} bytes)") from None

    def _refused(self, exc: BaseException) -> None:
        if self._metrics is None:
            return
        if isinstance(exc, _TooLarge):
            self._metrics.trainer_status_refused.labels(reason="too_large").inc()
        elif isinstance(exc, _TooDeep):
            self._metrics.trainer_status_refused.labels(reason="too_deep").inc()
        elif isinstance(exc, TimeoutError):
            self._metrics.trainer_status_refused.labels(reason="timeout").inc()

    async def fetch(self, url: str) -> TrainerStatus:
        try:
            async with self._client().get(url) as response:
                if response.status != 200:
                    raise TrainerUnavailable(f"GET {url}: HTTP {response.status}")
                payload = await self._read(response)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            self._refused(exc)
            raise TrainerUnavailable(f"GET {url}: {type(exc).__name__}: {exc}".rstrip(": ")) from exc
        try:
            return TrainerStatus.model_validate(payload)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise TrainerUnavailable(f"GET {url}: not a trainer status ({problems})") from exc

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
