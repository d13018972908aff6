"""The inference servers' liveness probe as `grpolora run` plays it (in the launcher's own process): what the
kubelet does with the livenessProbe of an inference pod (operator/builders.py), with the same numbers
(LIVENESS_* in grpolora.api.constants), so that a hung server is replaced on one machine as in a cluster.

A server's GET /health fails when its engine died or does not answer a bounded round trip (workers/inference/app.py,
EngineProbe): a hung engine (a wedged GPU, a deadlock, an EngineCore stopped with SIGSTOP) lives on and answers
nothing, so no exit code ever says it. The kubelet's rules (pkg/kubelet/prober, Kubernetes 1.31): one probe at a time,
every periodSeconds; a probe fails on a status outside 200-399, a refused connection or no answer within
timeoutSeconds; failureThreshold failures in a row restart the container, and a success resets the count.
"""

from __future__ import annotations

import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import httpx

from grpolora.api import constants as c
from grpolora.api import contract

LIVENESS_PERIOD_SECONDS = c.LIVENESS_PERIOD_SECONDS
LIVENESS_TIMEOUT_SECONDS = c.LIVENESS_TIMEOUT_SECONDS
LIVENESS_FAILURES = c.LIVENESS_FAILURES


def health_url(env: dict[str, str]) -> str:
    """The /health URL of the inference server started with `env` (a job's own server or a pool's), on loopback."""
    read = contract.PoolEnv if contract.is_pool_server(env) else contract.WorkerEnv
    return f"http://127.0.0.1:{read.from_environ(env).port}/health"


def probe(url: str) -> str | None:
    """One probe: None when the server answered 2xx or 3xx in time, else why not."""
    try:
        response = httpx.get(url, timeout=LIVENESS_TIMEOUT_SECONDS)
    except httpx.HTTPError as exc:
        return f"GET /health: {type(exc).__name__}: {exc or 'no answer'}"
    if 200 <= response.status_code < 400:
        return None
    return f"GET /health answered {response.status_code}: {response.text[:400]}"


@dataclass
class Liveness:
    """One server's probe. Failures count only once it has answered well once: before that the server is starting
    (it answers 503 while the engine loads; the pod's startupProbe covers that part, and a server that fails to
    start exits, which the launcher sees)."""

    url: str
    started: bool = False
    failures: int = 0  # in a row
    _due: float = 0.0
    _pending: Future[str | None] | None = field(default=None, repr=False)

    def check(self, probes: Executor, now: float | None = None) -> str | None:
        """Take the result of the probe that finished, start the next one when due; the last probe's fault once
        LIVENESS_FAILURES probes in a row failed (the server is to be replaced), else None."""
        now = time.monotonic() if now is None else now
        verdict = None
        if self._pending is not None and self._pending.done():
            fault, self._pending = self._pending.result(), None
            if fault is None:
                self.started, self.failures = True, 0
            elif self.started:
                self.failures += 1
                if self.failures >= LIVENESS_FAILURES:
                    verdict = fault
        if self._pending is None and now >= self._due:
            self._due = now + LIVENESS_PERIOD_SECONDS
            self._pending = probes.submit(probe, self.url)
        return verdict
