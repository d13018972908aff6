"""A POST to one of a job's own HTTP services (a reward service, an environment service), with the rule both keep.

- A timeout, a connection error, a 429 or a 5xx answer is retried `retries` times, after a doubling back-off
  (0.5 s, 1 s, ... at most 8 s); with a `deadline` every attempt and back-off fits before it (an environment's
  `stepTimeoutSeconds` bounds a step, its retries included). Then ServiceUnavailable names the last problem.
- 401 and 403 say the job's credentials (`headersFrom` and its Secret) are refused: a setting to fix, which no
  retry or restart changes, so AuthRefused, not retried; the trainer exits EXIT_INVALID_SPEC with the message.
- Any other answer (2xx, another 4xx) is the caller's to read.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import httpx

BACKOFF_SECONDS = 0.5
BACKOFF_MAX_SECONDS = 8.0
AUTH_STATUSES = (401, 403)


class AuthRefused(Exception):
    """A service refused the job's credentials. The message starts with the spec field to fix."""

    def __init__(self, path: str, message: str):
        self.path, self.message = path, message
        super().__init__(f"{path}: {message}")


class ServiceUnavailable(Exception):
    """Every attempt failed with a retryable problem (the last one is `problem`)."""

    def __init__(self, url: str, attempts: int, problem: str):
        self.url, self.attempts, self.problem = url, attempts, problem
        super().__init__(f"{url} failed {attempts} time(s): {problem}")


def backoff(attempt: int) -> float:
    """Seconds to wait before attempt `attempt` (1 = the first retry)."""
    return min(BACKOFF_SECONDS * 2 ** (attempt - 1), BACKOFF_MAX_SECONDS)


def post(
    client: httpx.Client,
    url: str,
    body: Any,
    *,
    retries: int,
    field: str,
    deadline: float | None = None,
) -> httpx.Response:
    """POST `body` as JSON (values JSON does not know are sent as their str) under the rule of the module
    docstring; `field` is the spec field an AuthRefused names; `deadline` a time.monotonic() bound."""
    content = json.dumps(body, default=str).encode()
    headers = {"content-type": "application/json"}
    problem, attempts = "", 0
    for attempt in range(retries + 1):
        if attempt:
            pause = backoff(attempt)
            if deadline is not None and time.monotonic() + pause >= deadline:
                break
            time.sleep(pause)
        timeout = client.timeout.read
        if deadline is not None:
            timeout = min(timeout or math.inf, deadline - time.monotonic())
            if timeout <= 0:
                break
        attempts += 1
        try:
            response = client.post(url, content=content, headers=headers, timeout=timeout)
        except httpx.TimeoutException:
            problem = f"no answer within {timeout:g} s"
            continue
        except httpx.TransportError as err:
            problem = f"cannot reach it ({type(err).__name__}: {err})"
            continue
        if response.status_code in AUTH_STATUSES:
            raise AuthRefused(
                field,
                f"{url} refused the job's credentials: HTTP {response.status_code}: {response.text[:300]} (check "
                "headersFrom and the keys of its Secret)",
            )
        if response.status_code == 429 or response.status_code >= 500:
            problem = f"HTTP {response.status_code}: {response.text[:300]}"
            continue
        return response
    raise ServiceUnavailable(url, attempts, problem or "no time left for an attempt before the deadline")
