"""Polls trainer rank 0's `GET /status` (unauthenticated JSON, grpolora.api.status.TrainerStatus), and the open
`GET /v1/adapter` of a RolloutPool's servers (the adapter versions they serve, per job).

Workers hold no Kubernetes credentials: progress reaches the cluster only through this poll. While the pods start,
DNS names and ports do not answer yet; that is reported back as a short reason, not raised.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from pydantic import ValidationError

from grpolora.api.plan import JobPlan
from grpolora.api.status import TrainerStatus


def status_url(job_plan: JobPlan) -> str:
    return f"http://{job_plan.master_addr}:{job_plan.job.spec.trainer.status_port}/status"


class TrainerUnavailable(Exception):
    """Trainer rank 0 did not answer with a valid status (not up yet, restarting, or broken)."""


class TrainerStatusClient:
    def __init__(self, *, timeout: float = 3.0):
        self._timeout = aiohttp.ClientTimeout(total=timeout)
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
                payload = await response.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None
        return payload if isinstance(payload, dict) else None

    async def fetch(self, url: str) -> TrainerStatus:
        try:
            async with self._client().get(url) as response:
                if response.status != 200:
                    raise TrainerUnavailable(f"GET {url}: HTTP {response.status}")
                payload = await response.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
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
