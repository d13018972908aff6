"""The inference server's HTTP API (FastAPI): its routes and its request guard, around the vLLM engine and the
jobs it serves. The process around it (env, engine, uvicorn) is workers/inference/server.py.

One code serves a job's own replicas and a RolloutPool's: the server holds tenants (workers/inference/tenants.py),
one per job it serves: the job itself on a job's own server (WorkerEnv, GRPOLORA_TOKEN), the jobs of the
attachment list on a pool's (PoolEnv, GRPOLORA_POOL_JOBS_FILE, followed as it changes). A request's bearer token
selects its job, and everything it does acts on that job alone: its adapter versions (each a LoRA id and folder of
its own on the one shared vLLM engine), its sync receiver (its own group with its own trainer), its in-flight cap.

Open: GET /started (the engine started and the jobs are served: startup probe), GET /health (besides, the engine
answers a round trip within ENGINE_PROBE_SECONDS: EngineProbe; no job's sync member lost for good:
tenants.Tenant.member; liveness probe), GET /ready (engine up and every job
served is current: the rule and why are in tenants.py; readiness probe), GET /metrics (labelled by job),
GET /v1/adapter (per job: live and loaded versions; at the top level the caller's job, named by its token, or the
job of a job's own server).
Token-guarded (`Authorization: Bearer <a served job's token>`): everything else, i.e. POST /v1/generate,
the OpenAI-compatible chat sessions under /sessions/<id>/ (workers/inference/sessions.py), GET /v1/sync/state,
GET /v1/sync/pool (a pool's replicas now), POST /v1/sync/join, POST /v1/sync/prepare.

A client's mistake is a 4xx with the reason, never a 500: a missing or unknown token is refused (401) and a body
over MAX_BODY_BYTES cut off (413) before the body is read, and the client still writing it reads that answer
(LingeringSend); requests are checked against the model (length,
vocabulary) before they reach vLLM, and vLLM's own refusals come back as 400/422 with its message. 500 is for
server faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, model_validator

from grpolora.api import constants as c
from grpolora.api.pool import PoolReplicas, auth_digest
from grpolora.workers.environments.episode import ChatDelta
from grpolora.workers.inference import metrics
from grpolora.workers.inference.adapter_book import OwnEngineBook, VersionUnavailable
from grpolora.workers.inference.sessions import SessionChat, add_session_routes
from grpolora.workers.inference.tenants import (
    AttachmentList,
    FairGate,
    SyncMember,
    Tenant,
    Tenants,
    in_flight_gauges,
)
from grpolora.workers.inference.vllm_engine import (
    InvalidRequest,
    Sample,
    SamplingRequest,
    VllmEngine,
)
from grpolora.workers.sync.control import (
    JOIN_PATH,
    POOL_PATH,
    PREPARE_PATH,
    REFUSAL_HEADER,
    STATE_PATH,
    FingerprintMismatch,
    JoinRequest,
    MemberState,
    PrepareRequest,
    StaleEpoch,
    StaleIncarnation,
    SyncError,
)

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/started", "/health", "/ready", "/metrics", "/v1/adapter"})
"""Paths answered without the token; every other path needs it."""
MAX_BODY_BYTES = 32 << 20
"""Largest request body: a rollout request of 1024 prompts of 4096 tokens is about 25 MiB of JSON."""
LINGER_BYTES = 4 * MAX_BODY_BYTES
LINGER_SECONDS = 10.0
"""After answering a request without reading its body, the server reads and drops at most this much of the rest,
for at most this long, before it closes the connection (LingeringSend); a larger announced body is not waited for."""
ENGINE_WATCH_SECONDS = 1.0
"""How often the server looks whether vLLM's engine died (a flag read: vLLM's own server looks every 5 s)."""
ENGINE_DIED = "vLLM's engine died (its EngineCore or a worker process is gone)"
ENGINE_PROBE_SECONDS = c.ENGINE_PROBE_SECONDS
"""How long /health waits for the engine's round trip (EngineProbe) before it fails."""
MAX_PROMPTS = 4096
"""Most prompts in one generate request."""
MAX_STOP_TOKEN_IDS = 256
MAX_STOP_STRINGS = c.MAX_STOP_STRINGS
MAX_SEED = 2**63 - 1
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    prompt_token_ids: (
        Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(max_length=MAX_PROMPTS)] | None
    ) = Field(default=None, min_length=1)
    prompts: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_PROMPTS)] | None = Field(
        default=None, min_length=1
    )  # tokenized as is (apply a chat template before sending)
    n: int = Field(default=1, ge=1)  # vLLM's cap (VLLM_MAX_N_SEQUENCES) is vLLM's to say
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)  # 0: off
    max_tokens: int = Field(default=256, ge=1)
    # One seed for every prompt, or one per prompt.
    seed: Seed | list[Seed] | None = None
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    adapter_version: int | None = Field(default=None, ge=0)  # None: the live one; N: wait until N is live
    # The asking trainer's (JoinRequest.incarnation): fences its leases (AdapterBook.lease). None: no trainer.
    incarnation: int | None = Field(default=None, ge=0)
    # Also each sample's logprobs under the base model, untempered: the KL reference (grpo.referenceFrom: inference).
    reference_logprobs: bool = False

    @model_validator(mode="after")
    def _one_kind_of_prompt(self) -> GenerateRequest:
        if (self.prompt_token_ids is None) == (self.prompts is None):
            raise ValueError("give exactly one of prompt_token_ids or prompts")
        count = len(self.prompt_token_ids or self.prompts or [])
        if isinstance(self.seed, list) and len(self.seed) != count:
            raise ValueError(f"seed: a list needs one seed per prompt ({count}), got {len(self.seed)}")
        return self

    def seed_of(self, prompt: int) -> int | None:
        return self.seed[prompt] if isinstance(self.seed, list) else self.seed


class SampleOut(BaseModel):
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    reference_logprobs: list[float] | None = None


class PromptResult(BaseModel):
    prompt_token_ids: list[int]
    samples: list[SampleOut]


class GenerateResponse(BaseModel):
    adapter_version: int
    results: list[PromptResult]


def create_app(
    engine: OwnEngineBook,
    receiver_factory: Callable[[OwnEngineBook], SyncMember],
    *,
    token: str,
    version_wait_seconds: float,
    job: str = "local",
    prepare: Callable[[], Awaitable[None]] | None = None,
    on_fatal: Callable[[], None] | None = None,
    chat: Callable[[], SessionChat] | None = None,
) -> FastAPI:
    """A job's own server: one tenant, the job itself (`job`, its metrics' label), with its own engine; `chat`: how
    its chat sessions render (None: the model's own template)."""
    tenants = Tenants(join_grace_seconds=None, default_job=job)

    async def serve_tenants() -> None:
        member = functools.partial(receiver_factory, engine)  # its first sync member, and any that replaces it
        tenants.attach(
            Tenant(
                job=job,
                auth=auth_digest(token),
                book=engine,
                receiver=member(),
                gate=FairGate(None, on_change=in_flight_gauges(job)),
                remake=member,
            )
        )

    return build_app(
        engine,
        tenants,
        serve_tenants,
        version_wait_seconds=version_wait_seconds,
        prepare=prepare,
        on_fatal=on_fatal,
        cleanup=engine.shutdown,
        chat=chat,
    )


def create_pool_app(
    engine: VllmEngine,
    attachments: AttachmentList,
    *,
    version_wait_seconds: float,
    prepare: Callable[[], Awaitable[None]] | None = None,
    on_fatal: Callable[[], None] | None = None,
) -> FastAPI:
    """A RolloutPool's server: the tenants its attachment list names, on one shared engine."""

    async def serve_tenants() -> None:
        await attachments.refresh()
        watcher = asyncio.create_task(attachments.watch())
        watchers.append(watcher)

    def cleanup() -> None:
        for watcher in watchers:
            watcher.cancel()
        engine.shutdown()

    watchers: list[asyncio.Task] = []
    return build_app(
        engine,
        attachments.tenants,
        serve_tenants,
        version_wait_seconds=version_wait_seconds,
        prepare=prepare,
        on_fatal=on_fatal,
        cleanup=cleanup,
        status=lambda: {"attachment_error": attachments.error},
        pool_replicas=lambda: attachments.replicas,
    )


class EngineProbe:
    """The engine's part of /health: a round trip through vLLM's engine to every worker (VllmEngine.round_trip),
    bounded by `bound` seconds. A hung engine (alive, answering nothing: a wedged GPU, a deadlock, a stopped
    process) is thereby found, which `dead` (its processes are gone) never says; the kubelet's liveness probe and
    `grpolora run` then replace the server (LIVENESS_* in grpolora.api.constants).

    One round trip at a time, shared by every /health call while it runs (the kubelet, `grpolora run`, anyone
    probing at once start no queue of calls in the engine), and never cancelled: an engine that has not answered the
    one sent `bound` seconds ago fails each later probe at once, without sending another."""

    def __init__(self, round_trip: Callable[[], Awaitable[None]], bound: float):
        self._round_trip = round_trip
        self.bound = bound
        self._pending: asyncio.Task[None] | None = None
        self._sent = 0.0

    async def fault(self) -> str | None:
        """None when the engine answered within the bound; otherwise what went wrong."""
        now = time.monotonic()
        if self._pending is None or self._pending.done():
            self._pending, self._sent = asyncio.create_task(self._round_trip()), now
            self._pending.add_done_callback(_retrieved)
        pending, sent = self._pending, self._sent
        try:
            await asyncio.wait_for(asyncio.shield(pending), timeout=max(0.0, sent + self.bound - now))
        except TimeoutError:
            return (
                f"vLLM's engine has not answered a round trip sent {time.monotonic() - sent:.1f}s ago "
                f"(bound {self.bound:g}s): it is hung"
            )
        except Exception as exc:
            return f"vLLM's engine failed a round trip: {type(exc).__name__}: {exc}"
        return None


def _retrieved(task: asyncio.Task) -> None:
    """A round trip that failed after its waiters gave up is not logged as an exception never retrieved."""
    if not task.cancelled():
        task.exception()


def build_app(
    engine: OwnEngineBook | VllmEngine,
    tenants: Tenants,
    serve_tenants: Callable[[], Awaitable[None]],
    *,
    version_wait_seconds: float,
    prepare: Callable[[], Awaitable[None]] | None,
    on_fatal: Callable[[], None] | None,
    cleanup: Callable[[], None],
    status: Callable[[], dict] = dict,
    pool_replicas: Callable[[], PoolReplicas | None] = lambda: None,
    chat: Callable[[], SessionChat] | None = None,
) -> FastAPI:
    """The API around an engine and the jobs it serves (one for a job's own server, several for a pool's: the same
    routes, each request acting for the job its token names). `prepare` (optional coroutine) loads the model and
    starts the engine in the background, so that /health answers (503) while a large model loads."""
    state: dict[str, object] = {}
    probe = EngineProbe(engine.round_trip, ENGINE_PROBE_SECONDS)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def boot() -> None:
            try:
                if prepare is not None:
                    await prepare()
                await engine.start()
                await serve_tenants()
                tenants.started = True
            except Exception as exc:  # the server stops and exits non-zero: Kubernetes or the launcher sees it
                log.exception("inference server failed to start")
                fail(f"{type(exc).__name__}: {exc}")
                return
            await watch_engine()

        def fail(error: str) -> None:
            state["error"] = error
            if on_fatal is not None:
                on_fatal()

        async def watch_engine() -> None:
            """An engine that dies ends the server (exit 1): the kubelet or `grpolora run` then starts a new one,
            and the trainer re-forms its group around it, as for a lost pod. Left alive, the HTTP process would
            answer (NotReady, never restarted) for good while the pool had one replica less. vLLM's own server
            watches its engine the same way (vllm/entrypoints/launchers/launcher.py, watchdog_loop)."""
            while not engine.dead:
                await asyncio.sleep(ENGINE_WATCH_SECONDS)
            log.error("vLLM's engine died (its EngineCore or a worker process is gone); stopping the server")
            fail(ENGINE_DIED)

        task = asyncio.create_task(boot())
        try:
            yield
        finally:
            task.cancel()
            tenants.started = False
            for tenant in tenants:
                await asyncio.to_thread(tenant.receiver.close)
            await asyncio.to_thread(cleanup)

    app = FastAPI(title="grpo-lora inference", lifespan=lifespan)
    app.add_middleware(RequestGuard, tenants=tenants, max_body_bytes=MAX_BODY_BYTES)

    def caller(http: Request) -> Tenant:
        """The job whose token the request carries (RequestGuard found it before the body was read)."""
        return http.scope[TENANT_SCOPE_KEY]

    @app.get("/started")
    async def started() -> Response:
        """The startup probe's: whether the server got through its start (a large model loads for minutes), not
        whether its engine answers now. On /health instead, an engine hung between the server's start and the
        startup probe's next look would fail every startup probe (for up to its 30 minutes) and never reach the
        liveness probe, which replaces a hung engine within LIVENESS_FAILURES periods."""
        if "error" in state:
            return Response(f"failed: {state['error']}", status_code=500)
        if not tenants.started:
            return Response("starting", status_code=503)
        return Response("started")

    @app.get("/health")
    async def health() -> Response:
        if "error" in state or engine.dead:  # the engine's death at once, not at the watchdog's next look
            return Response(f"failed: {state.get('error', ENGINE_DIED)}", status_code=500)
        if not tenants.started:
            return Response("starting", status_code=503)
        fault = "; ".join(tenants.lost) or await probe.fault()
        if fault is not None:
            log.error("health: %s", fault)
            return Response(f"failed: {fault}", status_code=500)
        return Response("ok")

    @app.get("/ready")
    async def ready() -> Response:
        # Off the event loop, as every call that reaches a job's sync member: with the member in vLLM's worker it is
        # a socket round trip (up to member_messages.CONTROL_TIMEOUT_SECONDS), which would stall every generation.
        if await asyncio.to_thread(lambda: tenants.ready):
            return Response("ready")
        return Response("not ready: engine starting or waiting for the current adapter of a job", status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/adapter")
    async def adapter(http: Request) -> dict:
        """Per job: the live version and the loaded ones (and their LoRA ids); at the top level, the same for the
        job the caller's token names (or the job of a job's own server); `engine_lora_ids`: what vLLM holds."""
        jobs = {
            t.job: {
                "live_version": t.book.live_version,
                "live_since": t.book.live_since,
                "loaded_versions": t.book.loaded_versions(),
                "lora_ids": t.book.lora_ids(),
            }
            for t in tenants
        }
        own = http.scope.get(TENANT_SCOPE_KEY) or tenants.get(tenants.default_job or "")
        body: dict[str, Any] = {}
        if own is not None and own.job in jobs:
            body |= {k: v for k, v in jobs[own.job].items() if k != "lora_ids"}
        engine_ids = await engine.list_loras() if tenants.started and engine.started else []
        rate = round(metrics.TOKEN_RATE.per_second(), 1)
        return body | {"jobs": jobs, "engine_lora_ids": engine_ids, "tokens_per_second": rate} | status()

    @app.post("/v1/generate", response_model=GenerateResponse)
    async def generate(request: GenerateRequest, http: Request) -> GenerateResponse:
        tenant = caller(http)
        book, labels = tenant.book, {"job": tenant.job}
        started = time.perf_counter()
        prompts = request.prompt_token_ids or [await engine.encode(text) for text in request.prompts or []]
        samplings = [
            SamplingRequest(
                n=request.n,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k,
                max_tokens=request.max_tokens,
                seed=request.seed_of(index),
                stop_token_ids=request.stop_token_ids,
                stop=request.stop,
                reference_logprobs=request.reference_logprobs,
            )
            for index in range(len(prompts))
        ]

        async def one(prompt: list[int], sampling: SamplingRequest, version: int) -> list[Sample]:
            async with tenant.gate.admit(sampling.n):  # the job's cap on sequences in vLLM, in arrival order
                return await book.generate(prompt, sampling, version)

        try:
            assert engine.limits is not None  # tenants are served only once the engine has started
            engine.limits.check(prompts, samplings[0])  # the same lengths and stop ids for every prompt
            async with book.lease(
                request.adapter_version, version_wait_seconds, incarnation=request.incarnation
            ) as version:
                outputs = await asyncio.gather(*(one(p, s, version) for p, s in zip(prompts, samplings, strict=True)))
        except StaleIncarnation as exc:
            metrics.REQUESTS.labels(**labels, status="stale_incarnation").inc()
            raise refused(exc) from None
        except VersionUnavailable as exc:
            metrics.REQUESTS.labels(**labels, status="version_unavailable").inc()
            raise HTTPException(status_code=409, detail=str(exc)) from None
        except InvalidRequest as exc:
            metrics.REQUESTS.labels(**labels, status="invalid").inc()
            raise HTTPException(status_code=exc.status, detail=str(exc)) from None
        except Exception:
            metrics.REQUESTS.labels(**labels, status="error").inc()
            raise
        metrics.REQUESTS.labels(**labels, status="ok").inc()
        metrics.REQUEST_SECONDS.labels(**labels).observe(time.perf_counter() - started)
        tokens = sum(len(sample.token_ids) for samples in outputs for sample in samples)
        metrics.GENERATED_TOKENS.labels(**labels).inc(tokens)
        metrics.TOKEN_RATE.add(tokens)
        return GenerateResponse(
            adapter_version=version,
            results=[
                PromptResult(prompt_token_ids=p, samples=[SampleOut(**vars(s)) for s in samples])
                for p, samples in zip(prompts, outputs, strict=True)
            ],
        )

    sessions = add_session_routes(
        app,
        engine,
        caller,
        chat or (lambda: SessionChat(ChatDelta(engine.tokenizer()))),  # the model's own template
        version_wait_seconds=version_wait_seconds,
    )
    # A detached job's sessions go with it: its token is refused, its versions unloaded, and a job attached again
    # under its name (a new trainer) must not find them.
    tenants.on_detach.append(sessions.forget_job)

    @app.get(STATE_PATH, response_model=MemberState)
    async def sync_state(http: Request) -> MemberState:
        return await asyncio.to_thread(caller(http).receiver.state)

    @app.get(POOL_PATH, response_model=PoolReplicas)
    async def sync_pool(http: Request) -> PoolReplicas:
        """A pool's replicas as its servers are told them now: where an attached job's trainer finds the replicas a
        scale-up added (token-guarded: only attached jobs learn them). 404 on a job's own server."""
        caller(http)
        replicas = pool_replicas()
        if replicas is None:
            raise HTTPException(status_code=404, detail="not a RolloutPool's server, or it has no list of replicas")
        return replicas

    @app.post(JOIN_PATH, status_code=202)
    async def sync_join(request: JoinRequest, http: Request) -> dict:
        tenant = caller(http)
        try:
            await asyncio.to_thread(lambda: tenant.member().join(request))
        except (FingerprintMismatch, StaleIncarnation) as exc:
            raise refused(exc) from None
        # The member took it: from now on the book refuses rollouts of older incarnations too (the member may be
        # in vLLM's worker; every join passes here, in the book's process, before it is answered).
        tenant.book.follow(request.incarnation)
        return {"accepted": True}

    @app.post(PREPARE_PATH, status_code=202)
    async def sync_prepare(request: PrepareRequest, http: Request) -> dict:
        try:
            await asyncio.to_thread(caller(http).receiver.prepare, request)
        except (StaleEpoch, StaleIncarnation) as exc:
            raise refused(exc) from None
        return {"accepted": True}

    return app


def refused(exc: SyncError) -> HTTPException:
    """A trainer's request refused (409), the refusal named for its client (control.refusal_named)."""
    return HTTPException(status_code=409, detail=str(exc), headers={REFUSAL_HEADER: type(exc).__name__})


TENANT_SCOPE_KEY = "grpolora.tenant"
"""Where RequestGuard leaves the caller's tenant in the ASGI scope."""


class RequestGuard:
    """ASGI middleware that refuses a request before its body is read: without a served job's token (401) on a
    guarded path, or with a body over `max_body_bytes` (413, announced by Content-Length or counted as a chunked
    body arrives). The token also selects the job the request acts for (its tenant, left in the scope).

    FastAPI reads and parses a body before running a route's dependencies, so a token check there would let anyone
    make the server read (and hold) whatever they send."""

    def __init__(self, app: Any, *, tenants: Tenants, max_body_bytes: int):
        self.app = app
        self._tenants = tenants
        self._max = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        body = LingeringSend(headers, receive, send)
        receive, send = body.receive, body.send
        authorization = headers.get(b"authorization", b"")
        tenant = self._tenants.find(authorization) if authorization else None
        if scope["path"] not in OPEN_PATHS:
            if not self._tenants.started:
                await _refuse(scope, receive, send, 503, "engine is starting")
                return
            if tenant is None:
                await _refuse(scope, receive, send, 401, "missing or wrong bearer token (GRPOLORA_TOKEN)")
                return
        if tenant is not None:
            scope[TENANT_SCOPE_KEY] = tenant
        length = headers.get(b"content-length")
        too_large = f"request body over {self._max} bytes"
        if length is not None and (not length.isdigit() or int(length) > self._max):
            await _refuse(scope, receive, send, 413, too_large)
            return
        received = 0

        async def counted() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self._max:
                raise HTTPException(status_code=413, detail=too_large)  # FastAPI passes it through as is
            return message

        await self.app(scope, counted, send)


class LingeringSend:
    """The `receive` and `send` of one request, so that an answer given before its body was read reaches a client
    still writing that body.

    RequestGuard refuses requests before reading their body, and a route may answer without reading it (a 404).
    uvicorn ends such a connection as the answer ends (uvicorn/protocols/http/httptools_impl.py: `send` closes the
    transport when a `Connection: close` response completes, and `receive` returns `http.disconnect` from then
    on) while the body is still arriving: the kernel answers the unread bytes with a reset, and a client that
    writes its whole body before it reads (httpx's AsyncClient, http.client) gets a ReadError or BrokenPipeError
    instead of the answer. RFC 9112 section 9.6 names the risk and the cure, a staged close: here the answer goes
    out whole but its last message is held back, the rest of the body is read and dropped (at most LINGER_BYTES,
    for at most LINGER_SECONDS), then the answer ends and the connection closes, with nothing left unread.

    Not for a client that asked for `100 Continue` (it sends no body before it, and uvicorn would send that
    interim response on the next `receive`, after the final one), nor for a body announced larger than
    LINGER_BYTES: those close at once, as before."""

    def __init__(self, headers: dict[bytes, bytes], receive: Any, send: Any):
        length = headers.get(b"content-length")
        announced = int(length) if length is not None and length.isdigit() else None
        self._unread = bool(announced) or headers.get(b"transfer-encoding", b"").lower() == b"chunked"
        self._linger = headers.get(b"expect", b"").lower() != b"100-continue" and (announced or 0) <= LINGER_BYTES
        self._receive, self._send = receive, send

    async def receive(self) -> dict:
        message = await self._receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            self._unread = False
        return message

    async def send(self, message: dict) -> None:
        if self._unread and message["type"] == "http.response.start":
            # What is left of the body is not read in full: the connection cannot carry another request.
            headers = list(message.get("headers", []))
            if not any(name.lower() == b"connection" for name, _ in headers):
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
        elif self._unread and self._linger and message["type"] == "http.response.body" and not message.get("more_body"):
            await self._send({**message, "more_body": True})
            await self._drain()
            message = {"type": "http.response.body", "body": b"", "more_body": False}
        await self._send(message)

    async def _drain(self) -> None:
        drained = 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LINGER_SECONDS):
                while self._unread and drained <= LINGER_BYTES:
                    drained += len((await self.receive()).get("body", b""))


async def _refuse(scope: dict, receive: Any, send: Any, status: int, detail: str) -> None:
    response = JSONResponse({"detail": detail}, status_code=status, headers={"Connection": "close"})
    await response(scope, receive, send)
