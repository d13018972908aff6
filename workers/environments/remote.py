"""spec.environment.url: an environment that runs as a service of its own (a sandbox, a browser, a database), spoken
to over HTTP (docs/tasks.md has the contract; service.py serves any environment so):

    POST <url>/reset  {"episode": id, "prompt": {text, answer, messages, system, meta}} -> {"messages", "tools"}
    POST <url>/step   {"episode": id, "turn": n, "message": {role, content}}           -> {"messages", "done", "reward"}
    POST <url>/close  {"episode": id}                                                    (best effort, not retried)

Each call follows workers/remote_service.py's rule within stepTimeoutSeconds: a timeout, a connection error, a 429
or a 5xx is retried, the same body again. A step is not idempotent (a sandbox ran the command), so it carries its
turn number and the service answers a turn it has already taken with the answer it gave: a retry after a lost
answer does not step twice. A 401 or 403 is AuthRefused (the run fails as a spec error, exit 78); a service out of
reach after those retries (or answering 5xx) is EnvironmentUnavailable: the episode is played again on a fresh
environment (runner.py), not held against the model; any other failure ends the episode as a plugin's exception does.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict
from typing import Any

import httpx

from grpolora.workers import remote_service
from grpolora.workers.environments.base import EnvironmentFault, EnvironmentUnavailable, Message, Opening, Reply
from grpolora.workers.tasks.base import Prompt

FIELD = "spec.environment.url"


class EnvironmentService:
    """The factory of a remote environment: one RemoteEnvironment (one episode id) per call, one HTTP client for
    all of them."""

    def __init__(self, url: str, *, timeout_seconds: float, retries: int, headers: dict[str, str] | None = None):
        self.url, self.timeout_seconds, self.retries = url.rstrip("/"), timeout_seconds, retries
        # As many connections as episodes run at once (the runner's threads); kept alive between turns.
        self._client = httpx.Client(timeout=timeout_seconds, headers=headers or {}, limits=httpx.Limits(
            max_connections=64, max_keepalive_connections=64))  # fmt: skip

    def __call__(self) -> RemoteEnvironment:
        return RemoteEnvironment(self)

    def call(
        self, route: str, body: dict[str, Any], *, retries: int | None = None, timeout_seconds: float | None = None
    ) -> dict[str, Any]:
        """POST `body` to <url>/<route> within stepTimeoutSeconds (or `timeout_seconds`); the answer's JSON object,
        or EnvironmentFault (AuthRefused for refused credentials)."""
        url = f"{self.url}/{route}"
        deadline = time.monotonic() + (self.timeout_seconds if timeout_seconds is None else timeout_seconds)
        attempts = self.retries if retries is None else retries
        try:
            response = remote_service.post(self._client, url, body, retries=attempts, field=FIELD, deadline=deadline)
        except remote_service.ServiceUnavailable as err:  # refused, timed out, 429 or 5xx past its retries
            raise EnvironmentUnavailable(f"{route}(): {err}") from None
        if response.status_code >= 400:
            # 422: the environment raised at the model's message (service.py); anything else is the service's.
            said = f"{route}(): {url} answered HTTP {response.status_code}: {response.text[:300]}"
            raise (EnvironmentFault if response.status_code == 422 else EnvironmentUnavailable)(said)
        try:
            data = response.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise EnvironmentFault(f"{route}(): {url} answered {response.text[:200]!r}; expected a JSON object")
        return data

    def close(self) -> None:
        self._client.close()


class RemoteEnvironment:
    """One episode of an environment service."""

    CLOSE_SECONDS = 2.0

    def __init__(self, service: EnvironmentService):
        self._service = service
        self.episode = uuid.uuid4().hex
        self._turn = 0

    def reset(self, prompt: Prompt) -> Opening:
        data = self._service.call("reset", {"episode": self.episode, "prompt": asdict(prompt)})
        return Opening(data.get("messages"), data.get("tools"))  # checked by the runner (checked_opening)

    def step(self, message: Message) -> Reply:
        self._turn += 1
        data = self._service.call("step", {"episode": self.episode, "turn": self._turn, "message": message})
        return Reply(data.get("messages") or [], data.get("done"), data.get("reward"))  # checked: checked_reply

    def close(self) -> None:
        """The episode is over (done, cut off or failed): the service may free what it holds for it."""
        # Short and not retried: the episodes of a step are closed in turn on one thread, and a service that
        # does not answer a close frees the episode anyway once more than its bound are open.
        self._service.call("close", {"episode": self.episode}, retries=0, timeout_seconds=min(self.CLOSE_SECONDS,
                           self._service.timeout_seconds))  # fmt: skip
