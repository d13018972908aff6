"""OpenAI-compatible chat sessions on an inference server (issue 48), run in the inference server's process (a job's
own replica or a RolloutPool's, the same app: workers/inference/app.py mounts these routes).

An agent written against the OpenAI client talks to `POST /sessions/<id>/v1/chat/completions` (the client's
`base_url` is `<replica>/sessions/<id>/v1`, its `api_key` the job's token). A session binds its calls to:
- one job: the job whose bearer token opened it (RequestGuard checks the token before the body is read, as for
  /v1/generate); another job's token does not find it;
- one adapter version, pinned for the session's life as an episode's is: the version named by the first call's
  `X-Grpolora-Adapter-Version` header, or the version live at the first call; every later call leases that version
  (AdapterBook.lease) and is refused (409) once this replica no longer serves it;
- one replica: the session's tokens live in this process (the trainer keeps each session on the replica it opened).

Token in, token out: the first call's messages are rendered once (ChatDelta.opening); each later call whose messages
extend what the session holds (the previous call's messages and the assistant message it answered, exactly) appends
only the new messages, rendered as a suffix after the assistant's turn (ChatDelta.environment_turn, the episodes'
own rendering), to the session's ids; the conversation is never tokenised again, so the ids and the logprobs vLLM
returned stay those of the sequence trained on. A call whose messages rewrite earlier history (edited, dropped or
reordered messages, other tools) opens a new segment, rendered afresh and recorded as such, never merged.

An agent the trainer plays (spec.environment.agent, workers/environments/agent.py) gets a session the trainer
opened first (`POST /sessions/<id>` with SessionBounds): pinned to the episode's adapter version, bounded by the
episode's limits (spec.environment.maxTurns calls, maxEpisodeTokens ids per segment, grpo.maxNewTokens per call),
and sampled with the job's temperature, top-p and top-k whatever the agent asks (the trainer's logprobs are of that
distribution) and a seed per call. A call past the limits is refused (400, naming the limit) and recorded, so that
the trainer truncates the episode; the agent cannot pass them.

`GET /sessions/<id>` returns the record: per segment its prompt ids, the ids after them with their behaviour logprobs
(0 where not generated) and a mask that is 1 on generated ids only, so a segment becomes one sample with the loss on
generated tokens alone, exactly as an episode (episode.EpisodeTokens); per call its prompt and completion ids and
logprobs. `POST /sessions/<id>/close` returns the same record and forgets the session.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from grpolora.api.spec import GRPOLoraJobSpec
from grpolora.workers.environments.base import EnvironmentFault, Message, Opening
from grpolora.workers.environments.episode import ChatDelta, EpisodeTokens
from grpolora.workers.inference import metrics
from grpolora.workers.inference.adapter_book import VersionUnavailable
from grpolora.workers.inference.tenants import Tenant
from grpolora.workers.inference.vllm_engine import InvalidRequest, SamplingRequest
from grpolora.workers.sync.control import REFUSAL_HEADER, StaleIncarnation

SESSIONS_PATH = "/sessions"
VERSION_HEADER = "x-grpolora-adapter-version"
"""The header that pins a session to an adapter version at its first call (later calls may repeat it, not change
it)."""
MAX_SESSIONS = 4096
"""Sessions one server holds at once (all jobs together); the oldest idle one goes first when more open."""
SESSION_IDLE_SECONDS = 3600.0
"""A session not called, read or closed for this long is forgotten when a new one needs room."""
MAX_STOP_STRINGS = 16
SessionId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]
CHAT_PATH = "/v1/chat/completions"


class Refused(HTTPException):
    """A chat call refused for a reason its metrics name (metrics.SESSION_CALL_STATUSES); a plain HTTPException
    counts as `invalid` (4xx) or `error` (5xx)."""

    def __init__(self, status_code: int, detail: str, reason: str):
        assert reason in metrics.SESSION_CALL_STATUSES, reason
        super().__init__(status_code=status_code, detail=detail)
        self.reason = reason


def call_status(exc: Exception) -> str:
    """The status a chat call that raised counts under (metrics.SESSION_CALLS)."""
    if isinstance(exc, Refused):
        return exc.reason
    if isinstance(exc, HTTPException) and exc.status_code < 500:
        return "invalid"
    return "error"


class SessionBounds(BaseModel):
    """What the trainer opens an agent's session with (`POST /sessions/<id>`) before the agent runs."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    adapter_version: int | None = Field(default=None, ge=0)
    """The episode's round version (None: the live one)."""
    incarnation: int | None = Field(default=None, ge=0)
    """The trainer's (AdapterSender.incarnation): a replica that follows a newer one refuses it, as /v1/generate."""
    max_calls: int = Field(ge=1)
    """spec.environment.maxTurns: chat calls of the session at most."""
    max_tokens: int = Field(ge=2)
    """maxEpisodeTokens (within the model's length): ids of a segment at most, its prompt included."""
    max_new_tokens: int = Field(ge=1)
    """grpo.maxNewTokens: each call's generation at most (a call's own max_tokens may ask for fewer)."""
    temperature: float = Field(ge=0)
    top_p: float = Field(gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, le=2**62)
    """Call i of the session samples with seed + i (a call's own seed is ignored, as is its temperature)."""


class ChatRequest(BaseModel):
    """The body of an OpenAI chat completion, as far as a session serves it (an unknown field is refused, 422, rather
    than silently ignored)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    messages: list[dict[str, Any]] = Field(min_length=1)
    model: str | None = None  # the session's adapter decides; kept as the answer's `model`
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | dict[str, Any] | None = None
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = Field(default=None)
    n: Literal[1] = 1
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: Literal[False] = False
    parallel_tool_calls: bool | None = None
    user: str | None = None


@dataclass
class SessionChat:
    """What a session renders and parses with (built once the engine's tokenizer is there)."""

    delta: ChatDelta
    tool_message: Callable[[list[int], str, list[dict[str, Any]] | None], Message] | None = None
    """The assistant message of generated ids with its parsed `tool_calls` (spec.environment.toolParser); None: the
    text alone."""


def job_session_chat(tokenizer: Any, spec: GRPOLoraJobSpec) -> SessionChat:
    """A job's sessions render as its episodes do: spec.task's chat template (chatTemplate, or chatTemplateFrom's
    mounted file), chatTemplateArgs and systemPrompt, and spec.environment.toolParser's calls."""
    from grpolora.workers.environments.templates import job_chat_template
    from grpolora.workers.environments.tools import ToolCallParser

    task = spec.task
    delta = ChatDelta(tokenizer, task.chat_template_args, task.system_prompt, job_chat_template(task))
    name = spec.environment.tool_parser if spec.environment is not None else None
    if name is None:
        return SessionChat(delta)
    parser = ToolCallParser(name, tokenizer)

    def tool_message(generated: list[int], text: str, tools: list[dict[str, Any]] | None) -> Message:
        message, _ = parser.message(generated, text, tools, delta.closing_ids(tools))
        return message  # an unreadable call stays the assistant's text: the agent sees what the model wrote

    return SessionChat(delta, tool_message)


@dataclass
class Segment:
    tokens: EpisodeTokens
    messages: list[Message]
    """The conversation as the segment holds it: the messages sent and each assistant message answered."""
    tools: list[dict[str, Any]] | None
    generated: list[int] = field(default_factory=list)  # the last assistant turn's ids
    calls: int = 0


@dataclass
class Session:
    id: str
    job: str
    version: int
    segments: list[Segment] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one call of a session at a time, in arrival order
    pending: int = 0  # calls under way
    counted: bool = False  # in the open sessions' figures (Sessions.answered)
    bounds: SessionBounds | None = None  # a session the trainer opened for an agent
    refused: str | None = None  # why a call past the bounds was refused (the episode is truncated)

    def record(self, closed: bool = False) -> dict[str, Any]:
        return {
            "session": self.id,
            "job": self.job,
            "adapter_version": self.version,
            "replica": socket.gethostname(),
            "closed": closed,
            "segments": [
                {
                    "prompt_token_ids": s.tokens.opening,
                    "token_ids": s.tokens.tokens,
                    "logprobs": s.tokens.logprobs,
                    "mask": s.tokens.mask,
                    "calls": s.calls,
                    "messages": s.messages,
                    "finish_reasons": [c["finish_reason"] for c in self.calls if c["segment"] == index],
                }
                for index, s in enumerate(self.segments)
            ],
            "calls": self.calls,
            "refused": self.refused,
        }


def normal(message: dict[str, Any]) -> Message:
    """A message as sessions compare and render it: OpenAI's fields that change what the template renders, without
    the ones a client echoes back empty (`refusal: null`, `audio: null`); text parts joined."""
    role = message.get("role")
    if role not in {"system", "developer", "user", "assistant", "tool"}:
        raise InvalidRequest(f"messages: unknown role {role!r} (system, user, assistant or tool)", status=422)
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = message.get("content")
    if isinstance(content, list):
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise InvalidRequest("messages: only text content parts are served", status=422)
        content = "".join(p.get("text", "") for p in content)
    out["content"] = content or ""
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]},
            }
            for call in message["tool_calls"]
        ]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


class Sessions:
    """The sessions of one server, keyed by job and session id."""

    def __init__(self, max_sessions: int = MAX_SESSIONS, idle_seconds: float = SESSION_IDLE_SECONDS):
        self._sessions: dict[tuple[str, str], Session] = {}
        self.max_sessions = max_sessions
        self.idle_seconds = idle_seconds

    def get(self, job: str, sid: str) -> Session | None:
        session = self._sessions.get((job, sid))
        if session is not None:
            session.used = time.monotonic()
        return session

    def open(self, job: str, sid: str, version: int) -> Session:
        if len(self._sessions) >= self.max_sessions:
            now = time.monotonic()
            oldest = min(
                ((s.used, key) for key, s in self._sessions.items() if now - s.used > self.idle_seconds), default=None
            )
            if oldest is None:
                raise Refused(429, f"this server holds {self.max_sessions} open sessions", "full")
            _left(self._sessions.pop(oldest[1]), "idle")
        session = self._sessions[(job, sid)] = Session(sid, job, version)
        return session

    def pop(self, job: str, sid: str) -> Session | None:
        session = self._sessions.pop((job, sid), None)
        if session is not None:
            _left(session, "closed")
        return session

    def answered(self, session: Session) -> None:
        """A call of `session` was answered: the first counts it as opened, if it is still held."""
        if not session.counted and self._sessions.get((session.job, session.id)) is session:
            session.counted = True
            metrics.session_opened(session.job)

    def forget_job(self, job: str) -> None:
        """Forget every session of a job (detached from this server)."""
        for key in [key for key in self._sessions if key[0] == job]:
            _left(self._sessions.pop(key), "detached")

    def discard(self, session: Session) -> None:
        if self._sessions.get((session.job, session.id)) is session:
            del self._sessions[(session.job, session.id)]

    def __len__(self) -> int:
        return len(self._sessions)


def _left(session: Session, reason: str) -> None:
    """Count a session that leaves, if it counted as opened (Sessions.answered)."""
    if session.counted:
        metrics.session_left(
            session.job,
            reason,
            calls=len(session.calls),
            tokens=sum(len(s.tokens.opening) + len(s.tokens.tokens) for s in session.segments),
            generated=sum(sum(s.tokens.mask) for s in session.segments),
        )


def _pinned(http: Request) -> int | None:
    value = http.headers.get(VERSION_HEADER)
    if value is None:
        return None
    if not value.isdigit():
        raise HTTPException(status_code=422, detail=f"{VERSION_HEADER}: {value!r} is no adapter version (0, 1, ...)")
    return int(value)


def add_session_routes(
    app: FastAPI,
    engine: Any,
    caller: Callable[[Request], Tenant],
    chat: Callable[[], SessionChat],
    *,
    version_wait_seconds: float,
) -> Sessions:
    """Mount the session routes on `app` (engine: the server's OwnEngineBook or VllmEngine, for its limits; `chat`:
    the rendering of the model, built at the first call)."""
    sessions = Sessions()
    built: list[SessionChat] = []

    def renderer() -> SessionChat:
        if not built:
            try:
                built.append(chat())
            except Exception as exc:  # the job's template cannot be read or its tool parser built: the server's fault
                raise HTTPException(status_code=500, detail=f"sessions cannot render for this job: {exc}") from None
        return built[0]

    def held(http: Request, sid: str) -> Session:
        session = sessions.get(caller(http).job, sid)
        if session is None:
            raise HTTPException(status_code=404, detail=f"no session {sid!r} of this job on this replica")
        return session

    def counted(route: Callable[..., Any]) -> Callable[..., Any]:
        """A chat call's figures: its outcome (metrics.SESSION_CALLS and REQUESTS), an answered call's latency."""

        @functools.wraps(route)
        async def call(*, http: Request, **kwargs: Any) -> Any:
            job, started = caller(http).job, time.perf_counter()
            try:
                answer = await route(http=http, **kwargs)
            except Exception as exc:
                metrics.session_call(job, call_status(exc))
                raise
            metrics.session_call(job, "ok", time.perf_counter() - started)
            return answer

        return call

    async def refused_body(http: Request, exc: Exception) -> Response:
        """A chat call whose body FastAPI refuses (422 before the route runs: streaming, n > 1, an unknown field)
        counts as `invalid`; every refused body is answered as FastAPI's own handler does."""
        path = http.url.path
        if path.startswith(SESSIONS_PATH + "/") and path.endswith(CHAT_PATH):  # a guarded path: its caller is known
            metrics.session_call(caller(http).job, "invalid")
        assert isinstance(exc, RequestValidationError)
        return await request_validation_exception_handler(http, exc)

    app.add_exception_handler(RequestValidationError, refused_body)

    async def openai_error(http: Request, exc: Exception) -> Response:
        """A session's refusal as OpenAI's clients read one (`error.message`, which they put in the exception's text:
        an agent's log says why, not only the status), beside FastAPI's `detail`; elsewhere FastAPI's own answer."""
        assert isinstance(exc, StarletteHTTPException)
        if not http.url.path.startswith(SESSIONS_PATH + "/"):
            return await http_exception_handler(http, exc)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = {"message": str(exc.detail), "type": kind, "code": exc.status_code}
        return JSONResponse({"detail": exc.detail, "error": error}, status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(StarletteHTTPException, openai_error)

    @app.post(SESSIONS_PATH + "/{sid}" + CHAT_PATH)
    @counted
    async def chat_completions(sid: SessionId, request: ChatRequest, http: Request) -> dict:
        tenant = caller(http)
        labels = {"job": tenant.job}
        if isinstance(request.tool_choice, dict):
            raise HTTPException(status_code=422, detail="tool_choice: 'auto' or 'none' (no guided decoding of a call)")
        pinned = _pinned(http)
        session = sessions.get(tenant.job, sid)
        if session is not None and pinned is not None and pinned != session.version:
            raise Refused(
                409, f"session {sid!r} is pinned to adapter version {session.version}, not {pinned}", "pinned"
            )
        try:
            messages = [normal(m) for m in request.messages]
            rendering = renderer()
            assert engine.limits is not None  # tenants are served only once the engine has started
            stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
            if len(stop) > MAX_STOP_STRINGS:
                raise InvalidRequest(f"stop: at most {MAX_STOP_STRINGS} strings", status=422)
            version_asked = pinned if session is None else session.version
            async with tenant.book.lease(version_asked, version_wait_seconds) as version:
                if session is None:
                    session = sessions.get(tenant.job, sid) or sessions.open(tenant.job, sid, version)
                session.pending += 1
                try:
                    async with session.lock:
                        if version != session.version:  # another first call opened it meanwhile, on another version
                            raise Refused(409, f"session {sid!r} is pinned to version {session.version}", "pinned")
                        segment, turn, prompt = _prompt(session, messages, request.tools, rendering.delta)
                        sampling = _sampling(session, request, prompt, stop, engine.limits.max_model_len)
                        engine.limits.check([prompt], sampling)
                        async with tenant.gate.admit(1):
                            (sample,) = await tenant.book.generate(prompt, sampling, version)
                        if request.tool_choice != "none" and rendering.tool_message is not None and request.tools:
                            message = rendering.tool_message(list(sample.token_ids), sample.text, request.tools)
                        else:
                            message = {"role": "assistant", "content": sample.text}
                        _answered(session, segment, turn, prompt, sample)
                        sessions.answered(session)
                        segment.messages = [*messages, normal(message)]
                finally:
                    session.pending -= 1
                    if not session.calls and not session.pending and session.bounds is None:
                        # a refused first call leaves no session (one the trainer opened stays: it reads the record)
                        sessions.discard(session)
        except VersionUnavailable as exc:
            raise Refused(409, str(exc), "version_unavailable") from None
        except (InvalidRequest, EnvironmentFault) as exc:
            raise HTTPException(status_code=getattr(exc, "status", 400), detail=str(exc)) from None
        metrics.GENERATED_TOKENS.labels(**labels).inc(len(sample.token_ids))
        metrics.TOKEN_RATE.add(len(sample.token_ids))
        finish = "tool_calls" if message.get("tool_calls") else sample.finish_reason or "stop"
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model or tenant.job,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(sample.token_ids),
                "total_tokens": len(prompt) + len(sample.token_ids),
            },
            "adapter_version": version,
        }

    @app.post(SESSIONS_PATH + "/{sid}")
    async def session_open(sid: SessionId, bounds: SessionBounds, http: Request) -> dict:
        """The trainer opens an agent's session: pinned to the episode's version now, bounded before any call."""
        tenant = caller(http)
        if sessions.get(tenant.job, sid) is not None:
            raise HTTPException(status_code=409, detail=f"session {sid!r} is already open")
        try:
            lease = tenant.book.lease(bounds.adapter_version, version_wait_seconds, incarnation=bounds.incarnation)
            async with lease as version:
                session = sessions.open(tenant.job, sid, version)
        except StaleIncarnation as exc:  # a newer trainer of this job took over: this one must stop
            named = {REFUSAL_HEADER: type(exc).__name__}
            raise HTTPException(status_code=409, detail=str(exc), headers=named) from None
        except VersionUnavailable as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None
        session.bounds = bounds
        return session.record()

    @app.get(SESSIONS_PATH + "/{sid}")
    async def session_record(sid: SessionId, http: Request) -> dict:
        return held(http, sid).record()

    @app.post(SESSIONS_PATH + "/{sid}/close")
    async def session_close(sid: SessionId, http: Request) -> dict:
        session = held(http, sid)
        async with session.lock:  # a call under way ends first, and is in the record
            sessions.pop(session.job, sid)
            return session.record(closed=True)

    return sessions


def _sampling(
    session: Session, request: ChatRequest, prompt: list[int], stop: list[str], model_length: int
) -> SamplingRequest:
    """How a call samples: as it asks; in a session the trainer bounded, with the job's sampling, a seed per call and
    at most grpo.maxNewTokens and what is left of maxEpisodeTokens, or refused (recorded) past maxTurns or with no
    room left."""
    asked = request.max_completion_tokens or request.max_tokens
    bounds = session.bounds
    if bounds is None:
        return SamplingRequest(n=1, temperature=request.temperature, top_p=request.top_p, seed=request.seed, stop=stop,
                               max_tokens=asked or max(1, model_length - len(prompt) - 1))  # fmt: skip
    calls, room = len(session.calls), bounds.max_tokens - len(prompt)
    if calls >= bounds.max_calls:
        session.refused = (f"spec.environment.maxTurns: this session has made its {bounds.max_calls} calls; no more "
                           "are served (the episode is truncated)")  # fmt: skip
    elif room < 1:
        session.refused = (f"spec.environment.maxEpisodeTokens: the conversation's {len(prompt)} tokens leave no room "
                           f"in the {bounds.max_tokens} an episode may hold (the episode is truncated)")  # fmt: skip
    if session.refused is not None:
        raise Refused(400, session.refused, "limit")
    return SamplingRequest(
        n=1,
        temperature=bounds.temperature,
        top_p=bounds.top_p,
        top_k=bounds.top_k,
        max_tokens=min(asked or bounds.max_new_tokens, bounds.max_new_tokens, room),
        seed=None if bounds.seed is None else bounds.seed + calls,
        stop=stop,
    )


def _prompt(
    session: Session, messages: list[Message], tools: list[dict[str, Any]] | None, delta: ChatDelta
) -> tuple[Segment, list[int] | None, list[int]]:
    """The segment a call continues, the ids of its new messages (None: a new segment) and its prompt ids: the
    session's last segment with only the new messages rendered after it, where `messages` extend what it holds; else
    a new segment of `messages` rendered afresh. Nothing is changed until the call is answered (_answered)."""
    last = session.segments[-1] if session.segments else None
    if (
        last is not None
        and tools == last.tools
        and len(messages) > len(last.messages)
        and messages[: len(last.messages)] == last.messages
    ):
        turn = delta.environment_turn(last.generated, messages[len(last.messages) :], tools)
        return last, turn, last.tokens.ids + turn
    try:
        opening = delta.opening(Opening(list(messages), tools))
    except Exception as exc:  # the template refused the conversation (jinja's error, its own raise_exception)
        raise InvalidRequest(f"messages: the chat template cannot render them: {exc}", status=422) from None
    return Segment(EpisodeTokens(list(opening)), list(messages), tools), None, list(opening)


def _answered(session: Session, segment: Segment, turn: list[int] | None, prompt: list[int], sample: Any) -> None:
    """Record an answered call: its new messages' ids (or its new segment), then the generated ids."""
    if turn is None:
        session.segments.append(segment)
    else:
        segment.tokens.add_environment(turn)
    ids, logprobs = list(sample.token_ids), list(sample.logprobs)
    segment.tokens.add_assistant(ids, logprobs, None)
    segment.generated = ids
    segment.calls += 1
    session.calls.append(
        {
            "segment": len(session.segments) - 1,
            "prompt_token_ids": prompt,
            "completion_token_ids": ids,
            "logprobs": logprobs,
            "finish_reason": sample.finish_reason,
        }
    )
