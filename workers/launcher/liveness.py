"""The inference servers' liveness probe as `grpolora run` plays it (in the launcher's own process): what the
kubelet does with the livenessProbe of an inference pod (operator/pod_spec.py), with the same numbers
(LIVENESS_* in grpolora.api.constants), so that a hung server is replaced on one machine as in a cluster.

A server's GET /health fails when its engine died or does not answer a bounded round trip (workers/inference/app.py,
EngineProbe): a hung engine (a wedged GPU, a deadlock, an EngineCore stopped with SIGSTOP) lives on and answers
nothing, so no exit code ever says it. The kubelet's rules: one probe at a time, on a ticker of periodSeconds (a
probe slower than the period is followed by the next at once: pkg/kubelet/prober/worker.go, run and doProbe); a
probe fails on a status outside 200-399 (pkg/probe/http/http.go), a refused connection or no answer within
timeoutSeconds; failureThreshold failures in a row restart the container, a success resets the count; liveness is
not probed before the startup probe succeeded.
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


STARTING = 503
"""What /health answers while the server starts (app.py): no other answer comes before its start is through."""


def probe(url: str) -> tuple[int | None, str | None]:
    """One probe: the status the server answered (None: no answer), and None when it was 2xx or 3xx in time, else
    why not."""
    try:
        response = httpx.get(url, timeout=LIVENESS_TIMEOUT_SECONDS)
    except httpx.HTTPError as exc:
        return None, f"GET /health: {type(exc).__name__}: {exc or 'no answer'}"
    if 200 <= response.status_code < 400:
        return response.status_code, None
    return response.status_code, f"GET /health answered {response.status_code}: {response.text[:400]}"


@dataclass
class Liveness:
    """One server's probe. Failures count once the server is through its start, i.e. from its first answer other
    than 503 (a 500 as well: an engine hung right after the start fails every probe from the first): the pod's
    startupProbe (app.py's /started) covers the start, and a server that fails to start exits, which the launcher
    sees."""

    url: str
    started: bool = False
    failures: int = 0  # in a row
    _due: float = 0.0
    _pending: Future[tuple[int | None, str | None]] | None = field(default=None, repr=False)

    def check(self, probes: Executor, now: float | None = None) -> str | None:
        """Take the result of the probe that finished, start the next one when due; the last probe's fault once
        LIVENESS_FAILURES probes in a row failed (the server is to be replaced), else None."""
        now = time.monotonic() if now is None else now
        verdict = None
        if self._pending is not None and self._pending.done():
            (status, fault), self._pending = self._pending.result(), None
            self.started = self.started or (status is not None and status != STARTING)
            if fault is None:
                self.failures = 0
            elif self.started:
                self.failures += 1
                if self.failures >= LIVENESS_FAILURES:
                    verdict = fault
        if self._pending is None and now >= self._due:
            self._due = now + LIVENESS_PERIOD_SECONDS
            self._pending = probes.submit(probe, self.url)
        return verdict
