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

spec.environment.server: the same protocol, served by the job's own environment server, several processes or pods
(GRPOLORA_ENVIRONMENT_URL names each, docs/contract.md). An episode's state lives in the one server that reset it,
so each episode is pinned to one URL for its reset, steps and close (a load-balancing Service in between would send
its steps elsewhere); new episodes go to the server holding the fewest open ones (round-robin among equals),
avoiding for a while one that just failed a call while others have not. Every call carries the environment token
as a bearer token: derived from the job's (grpolora.api.pool.environment_token), which the server never holds, since
it runs model-driven code and the job's token opens the replicas' generate and control endpoints.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from grpolora.api import contract
from grpolora.api.pool import environment_token
from grpolora.workers import remote_service
from grpolora.workers.environments.base import EnvironmentFault, EnvironmentUnavailable, Message, Opening, Reply
from grpolora.workers.tasks.base import Prompt

FIELD = "spec.environment.url"
SERVER_FIELD = "spec.environment.server"
AVOID_SECONDS = 10.0
"""How long new episodes avoid a server whose call just failed (refused, timed out, 5xx, an episode it lost), while
another has not failed: a pod being replaced, a process restarting."""


class EnvironmentService:
    """The factory of a remote environment: one RemoteEnvironment (one episode id) per call, pinned to one of `urls`
    (see the module docstring), one HTTP client for all of them. `field` is the spec field a refused credential
    names."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout_seconds: float,
        retries: int,
        headers: dict[str, str] | None = None,
        field: str = FIELD,
    ):
        listed = [urls] if isinstance(urls, str) else list(urls)
        if not listed:
            raise ValueError("an environment service needs at least one URL")
        self.urls = tuple(url.rstrip("/") for url in listed)
        self.timeout_seconds, self.retries, self.field = timeout_seconds, retries, field
        # As many connections as episodes run at once (the runner's threads); kept alive between turns.
        self._client = httpx.Client(timeout=timeout_seconds, headers=headers or {}, limits=httpx.Limits(
            max_connections=64, max_keepalive_connections=64))  # fmt: skip
        self._lock = threading.Lock()  # episodes are made, and closed, on several threads
        self._open = dict.fromkeys(self.urls, 0)  # episodes pinned to each URL and not closed yet
        self._failed_at: dict[str, float] = {}  # URL -> time.monotonic() of its last failed call
        self._next = 0  # where the round-robin among equally loaded URLs starts

    def __call__(self) -> RemoteEnvironment:
        return RemoteEnvironment(self, self._pin())

    def _pin(self) -> str:
        """The URL a new episode stays on: the least loaded, in round-robin order, of those that have not failed in
        the last AVOID_SECONDS (of all, when every one has)."""
        with self._lock:
            now, count = time.monotonic(), len(self.urls)
            order = [self.urls[(self._next + i) % count] for i in range(count)]
            fine = [url for url in order if now - self._failed_at.get(url, -AVOID_SECONDS) >= AVOID_SECONDS]
            url = min(fine or order, key=self._open.__getitem__)
            self._next = (self.urls.index(url) + 1) % count
            self._open[url] += 1
            return url

    def _release(self, url: str) -> None:
        with self._lock:
            self._open[url] = max(self._open[url] - 1, 0)

    def open_episodes(self) -> dict[str, int]:
        """Episodes pinned to each URL and not closed yet."""
        with self._lock:
            return dict(self._open)

    def call(
        self,
        route: str,
        body: dict[str, Any],
        *,
        url: str,
        retries: int | None = None,
        timeout_seconds: float | None = None,
    ) -> dict[str, Any]:
        """POST `body` to <url>/<route> (`url` one of self.urls: the episode's) within stepTimeoutSeconds (or
        `timeout_seconds`); the answer's JSON object, or EnvironmentFault (AuthRefused for refused credentials)."""
        try:
            return self._call(f"{url}/{route}", route, body, retries, timeout_seconds)
        except EnvironmentUnavailable:
            with self._lock:
                self._failed_at[url] = time.monotonic()
            raise

    def _call(
        self, url: str, route: str, body: dict[str, Any], retries: int | None, timeout_seconds: float | None
    ) -> dict[str, Any]:
        deadline = time.monotonic() + (self.timeout_seconds if timeout_seconds is None else timeout_seconds)
        attempts = self.retries if retries is None else retries
        try:
            response = remote_service.post(
                self._client, url, body, retries=attempts, field=self.field, deadline=deadline
            )
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


def server_urls(environ: Mapping[str, str] | None = None) -> list[str]:
    """The environment server's URLs from GRPOLORA_ENVIRONMENT_URL (comma-separated, in pod order), which the
    operator and `grpolora run` set for a job with spec.environment.server; ValueError saying so when it is unset."""
    raw = (os.environ if environ is None else environ).get(contract.ENVIRONMENT_URL, "")
    urls = [url.strip() for url in raw.split(",") if url.strip()]
    if not urls:
        raise ValueError(
            f"{contract.ENVIRONMENT_URL} is not set: it names the environment server's URLs, which the operator and "
            "`grpolora run` set for the job's trainer (docs/contract.md); to run a trainer by hand, start the "
            "server and set it, comma-separated"
        )
    return urls


def server_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The environment token, which every call to the job's environment server carries, derived from the job's
    token as the trainer holds it (GRPOLORA_TOKEN_FILE's file in a pod, else GRPOLORA_TOKEN); None when neither is
    set. Not GRPOLORA_ENVIRONMENT_TOKEN(_FILE): those are the server's own."""
    env = os.environ if environ is None else environ
    token = env.get(contract.TOKEN) or None
    if env.get(contract.TOKEN_FILE):
        token = Path(env[contract.TOKEN_FILE]).read_text(encoding="utf-8").strip() or None
    return None if token is None else environment_token(token)


class RemoteEnvironment:
    """One episode of an environment service, on the one server `url` that holds it."""

    CLOSE_SECONDS = 2.0

    def __init__(self, service: EnvironmentService, url: str):
        self._service, self.url = service, url  # pinned by the service, which counts it there until close()
        self.episode = uuid.uuid4().hex
        self._turn = 0
        self._closed = False

    def reset(self, prompt: Prompt) -> Opening:
        data = self._service.call("reset", {"episode": self.episode, "prompt": asdict(prompt)}, url=self.url)
        return Opening(data.get("messages"), data.get("tools"))  # checked by the runner (checked_opening)

    def step(self, message: Message) -> Reply:
        self._turn += 1
        body = {"episode": self.episode, "turn": self._turn, "message": message}
        data = self._service.call("step", body, url=self.url)
        return Reply(data.get("messages") or [], data.get("done"), data.get("reward"))  # checked: checked_reply

    def close(self) -> None:
        """The episode is over (done, cut off or failed): the service may free what it holds for it."""
        if self._closed:
            return
        self._closed = True
        # Short and not retried: the episodes of a step are closed in turn on one thread, and a service that
        # does not answer a close frees the episode anyway once more than its bound are open.
        try:
            self._service.call("close", {"episode": self.episode}, url=self.url, retries=0, timeout_seconds=min(
                self.CLOSE_SECONDS, self._service.timeout_seconds))  # fmt: skip
        finally:
            self._service._release(self.url)
