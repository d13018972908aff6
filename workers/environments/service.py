"""Serve an environment (a built-in or a plugin `package.module:factory`) as the service spec.environment.url
speaks to (remote.py, docs/tasks.md), so that it runs where its sandbox, browser or database is:

    python -m grpolora.workers.environments.service --environment calculator --port 8000
    python -m grpolora.workers.environments.service --environment my_envs.sandbox:make --token-file /run/token

One environment object per episode id (the factory makes it at /reset), each behind a lock of its own. A step
keeps its turn number and answer: the same turn asked again (a retry after a lost answer) gets that answer without
stepping again, a turn out of order gets 409. An environment that raises or answers what it may not is 422 with the
reason (not retried: the episode ends with it). With a token (--token-file, else GRPOLORA_ENVIRONMENT_TOKEN_FILE's
file, else GRPOLORA_ENVIRONMENT_TOKEN, as the operator and `grpolora run` give a job's server) every call but GET
/health needs `Authorization: Bearer <token>` (else 401, which fails the job as a spec error). --port defaults to
GRPOLORA_ENVIRONMENT_PORT. GET /health answers 200 once it serves: the readiness both launchers wait for. The
client closes each episode when it ends; past `max_episodes` open at once the oldest is dropped (a trainer that died
never closes its own), and a step of it gets 404.

An environment that raises EnvironmentUnavailable (what it needs is gone: an adapter's own server) gets 503 instead:
retried, then the episode is played again, as from the trainer's own environment processes.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from grpolora.api import contract
from grpolora.workers.environments.base import (
    Environment,
    EnvironmentFactory,
    EnvironmentUnavailable,
    InvalidAction,
    Reply,
    checked_messages,
    checked_opening,
    checked_reply,
    close_environment,
    fault_reason,
)
from grpolora.workers.tasks.base import Prompt

log = logging.getLogger(__name__)

MAX_EPISODES = 4096
TOKEN_ENV = contract.ENVIRONMENT_TOKEN
TOKEN_FILE_ENV = contract.ENVIRONMENT_TOKEN_FILE  # in the server's pods (the operator's)
PORT_ENV = contract.ENVIRONMENT_PORT


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # a newer client's fields do not break an older service


class PromptBody(_Body):
    text: str
    answer: str | None = None
    messages: list[dict[str, str]] | None = None
    system: str | None = None
    meta: dict[str, Any] = {}


class ResetBody(_Body):
    episode: str
    prompt: PromptBody


class StepBody(_Body):
    episode: str
    turn: int
    message: dict[str, Any]


class CloseBody(_Body):
    episode: str


def _step(env: Any, message: dict[str, Any]) -> Reply:
    """The environment's step, checked; an InvalidAction it raises is the tool's error answer, as runner.py answers
    one from an environment in the trainer's processes."""
    try:
        return checked_reply(env.step(message))
    except InvalidAction as exc:
        return exc.reply()


@dataclass
class _Served:
    env: Environment
    opening: dict[str, Any]
    lock: threading.Lock = field(default_factory=threading.Lock)
    turn: int = 0
    answer: dict[str, Any] | None = None


def build_app(factory: EnvironmentFactory, *, token: str | None = None, max_episodes: int = MAX_EPISODES) -> FastAPI:
    """The service's ASGI app. Its routes are plain functions: FastAPI runs them on its worker threads, so an
    environment may block (a sandbox's command) without holding the others up."""
    app = FastAPI(title="grpolora environment service")
    episodes: OrderedDict[str, _Served] = OrderedDict()
    opening_lock = threading.Lock()  # guards `episodes` itself; each episode's calls hold its own lock

    @app.middleware("http")
    async def authorise(request: Request, call_next):
        if token is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401)
        return await call_next(request)

    def environment_call(fn, *args):
        try:
            return fn(*args)
        except EnvironmentUnavailable as exc:  # what the environment needs is gone (an adapter's own server): the
            raise HTTPException(503, str(exc)) from None  # client retries, then plays the episode again
        except Exception as exc:  # the environment's own failure: the episode's, reported to the client
            raise HTTPException(422, fault_reason(exc)) from None

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"episodes": len(episodes)}

    @app.post("/reset")
    def reset(body: ResetBody) -> dict[str, Any]:
        with opening_lock:
            served = episodes.get(body.episode)
            if served is not None:  # a retried reset: the opening it already has
                return served.opening
        prompt_fields = body.prompt.model_dump()
        messages = prompt_fields.pop("messages")
        prompt = Prompt(**prompt_fields, messages=tuple(messages) if messages is not None else None)
        env = environment_call(factory)
        opening = environment_call(lambda: checked_opening(env.reset(prompt)))
        answer = {"messages": opening.messages, "tools": opening.tools}
        dropped = []
        with opening_lock:
            served = episodes.setdefault(body.episode, _Served(env, answer))
            while len(episodes) > max_episodes:
                dropped.append(episodes.popitem(last=False))
        for episode, old in dropped:
            log.warning("episode %s dropped: more than %d open (its client never closed it?)", episode, max_episodes)
            close_environment(old.env)
        return served.opening

    @app.post("/step")
    def step(body: StepBody) -> dict[str, Any]:
        served = episodes.get(body.episode)
        if served is None:
            raise HTTPException(404, f"no open episode {body.episode!r} (closed, or never reset)")
        with served.lock:
            if body.turn == served.turn and served.answer is not None:
                return served.answer  # the same turn again: its answer was lost on the way
            if body.turn != served.turn + 1:
                raise HTTPException(409, f"turn {body.turn} of episode {body.episode!r}; expected {served.turn + 1}")
            [message] = environment_call(checked_messages, [body.message], "message")
            reply = environment_call(lambda: _step(served.env, message))
            served.turn, served.answer = body.turn, {
                "messages": reply.messages, "done": reply.done, "reward": reply.reward,
            }  # fmt: skip
            return served.answer

    @app.post("/close")
    def close(body: CloseBody) -> dict[str, Any]:
        with opening_lock:
            served = episodes.pop(body.episode, None)
        if served is not None:
            close_environment(served.env)
        return {"closed": served is not None}

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from grpolora.api.spec import EnvironmentSpec
    from grpolora.workers.environments import load_environment

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--environment", required=True, help="a built-in name or a plugin package.module:factory")
    parser.add_argument("--host", default="0.0.0.0")  # in a pod: on the pod's IP, for its Service
    port = os.environ.get(PORT_ENV)
    parser.add_argument("--port", type=int, default=int(port) if port else 8000, help=f"default: ${PORT_ENV}, or 8000")
    parser.add_argument("--token-file", type=Path, help=f"the file holding the bearer token clients must send "
                        f"(default: ${TOKEN_FILE_ENV}'s file, or ${TOKEN_ENV} itself)")  # fmt: skip
    parser.add_argument("--max-episodes", type=int, default=MAX_EPISODES)
    args = parser.parse_args(argv)
    kind = "plugin" if ":" in args.environment else "builtin"
    factory = load_environment(EnvironmentSpec.model_validate({kind: args.environment}), Path.cwd())
    token_file = args.token_file or (Path(os.environ[TOKEN_FILE_ENV]) if os.environ.get(TOKEN_FILE_ENV) else None)
    token = token_file.read_text().strip() if token_file else os.environ.get(TOKEN_ENV)
    app = build_app(factory, token=token or None, max_episodes=args.max_episodes)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
