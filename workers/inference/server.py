"""The inference server's HTTP API (FastAPI), configured only from the env contract.

Open: GET /health (engine up; liveness and startup probe), GET /ready (engine up and serving the adapter version
the trainer last called current; readiness probe), GET /metrics, GET /v1/adapter.
Token-guarded (`Authorization: Bearer <GRPOLORA_TOKEN>`): everything else, i.e. POST /v1/generate,
GET /v1/sync/state, POST /v1/sync/join, POST /v1/sync/prepare.

A client's mistake is a 4xx with the reason, never a 500: a missing token is refused (401) and a body over
MAX_BODY_BYTES cut off (413) before the body is read; requests are checked against the model (length, vocabulary)
before they reach vLLM, and vLLM's own refusals come back as 400/422 with its message. 500 is for server faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, model_validator

from grpolora.api.contract import WorkerEnv
from grpolora.workers.inference import metrics
from grpolora.workers.inference.adapter_folders import default_adapter_root, remove_stale_adapter_roots
from grpolora.workers.inference.engine import (
    AdapterEngine,
    EngineConfig,
    InvalidRequest,
    SamplingRequest,
    VersionUnavailable,
    config_for,
    cpu_engine_env,
)
from grpolora.workers.sync import wire
from grpolora.workers.sync.control import (
    JOIN_PATH,
    PREPARE_PATH,
    STATE_PATH,
    FingerprintMismatch,
    JoinRequest,
    MemberState,
    PrepareRequest,
    StaleEpoch,
)
from grpolora.workers.sync.receiver import AdapterReceiver, RoundOutcome

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/v1/adapter"})
"""Paths answered without the token; every other path needs it."""
MAX_BODY_BYTES = 32 << 20
"""Largest request body: a rollout request of 1024 prompts of 4096 tokens is about 25 MiB of JSON."""
MAX_PROMPTS = 4096
"""Most prompts in one generate request."""
MAX_STOP_TOKEN_IDS = 256
MAX_SEED = 2**63 - 1
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
SHUTDOWN_GRACE_SECONDS = 3


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
    max_tokens: int = Field(default=256, ge=1)
    # One seed for every prompt, or one per prompt.
    seed: Seed | list[Seed] | None = None
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    adapter_version: int | None = Field(default=None, ge=0)  # None: the live one; N: wait until N is live

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


class PromptResult(BaseModel):
    prompt_token_ids: list[int]
    samples: list[SampleOut]


class GenerateResponse(BaseModel):
    adapter_version: int
    results: list[PromptResult]


def create_app(
    engine: AdapterEngine,
    receiver_factory,
    *,
    token: str,
    version_wait_seconds: float,
    prepare=None,
    on_fatal=None,
) -> FastAPI:
    """The API around an engine. `prepare` (optional coroutine) loads the model and starts the engine in the
    background, so that /health answers (503) while a large model loads."""
    state: dict[str, object] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def boot() -> None:
            try:
                if prepare is not None:
                    await prepare()
                await engine.start()
                state["receiver"] = receiver_factory(engine)
            except Exception as exc:  # the server stops and exits non-zero: Kubernetes or the launcher sees it
                log.exception("inference server failed to start")
                state["error"] = f"{type(exc).__name__}: {exc}"
                if on_fatal is not None:
                    on_fatal()

        task = asyncio.create_task(boot())
        try:
            yield
        finally:
            task.cancel()
            receiver = state.get("receiver")
            if isinstance(receiver, AdapterReceiver):
                await asyncio.to_thread(receiver.close)
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="grpo-lora inference", lifespan=lifespan)
    app.add_middleware(RequestGuard, token=token, max_body_bytes=MAX_BODY_BYTES)

    def receiver() -> AdapterReceiver:
        found = state.get("receiver")
        if not isinstance(found, AdapterReceiver):
            raise HTTPException(status_code=503, detail=str(state.get("error") or "engine is starting"))
        return found

    @app.get("/health")
    async def health() -> Response:
        if "error" in state:
            return Response(f"failed: {state['error']}", status_code=500)
        if not isinstance(state.get("receiver"), AdapterReceiver):
            return Response("starting", status_code=503)
        return Response("ok")

    @app.get("/ready")
    async def ready() -> Response:
        found = state.get("receiver")
        if isinstance(found, AdapterReceiver) and found.ready:
            return Response("ready")
        return Response("not ready: engine starting or waiting for the current adapter", status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/adapter")
    async def adapter() -> dict:
        return {
            "live_version": engine.live_version,
            "live_since": engine.live_since,
            "loaded_versions": engine.loaded_versions(),
        }

    @app.post("/v1/generate", response_model=GenerateResponse)
    async def generate(request: GenerateRequest) -> GenerateResponse:
        receiver()  # 503 while starting
        started = time.perf_counter()
        prompts = request.prompt_token_ids or [await engine.encode(text) for text in request.prompts or []]
        samplings = [
            SamplingRequest(
                n=request.n,
                temperature=request.temperature,
                top_p=request.top_p,
                max_tokens=request.max_tokens,
                seed=request.seed_of(index),
                stop_token_ids=request.stop_token_ids,
            )
            for index in range(len(prompts))
        ]
        try:
            assert engine.limits is not None  # the receiver exists only once the engine has started
            engine.limits.check(prompts, samplings[0])  # the same lengths and stop ids for every prompt
            async with engine.lease(request.adapter_version, version_wait_seconds) as version:
                outputs = await asyncio.gather(
                    *(engine.generate(p, s, version) for p, s in zip(prompts, samplings, strict=True))
                )
        except VersionUnavailable as exc:
            metrics.REQUESTS.labels(status="version_unavailable").inc()
            raise HTTPException(status_code=409, detail=str(exc)) from None
        except InvalidRequest as exc:
            metrics.REQUESTS.labels(status="invalid").inc()
            raise HTTPException(status_code=exc.status, detail=str(exc)) from None
        except Exception:
            metrics.REQUESTS.labels(status="error").inc()
            raise
        metrics.REQUESTS.labels(status="ok").inc()
        metrics.REQUEST_SECONDS.observe(time.perf_counter() - started)
        return GenerateResponse(
            adapter_version=version,
            results=[
                PromptResult(prompt_token_ids=p, samples=[SampleOut(**vars(s)) for s in samples])
                for p, samples in zip(prompts, outputs, strict=True)
            ],
        )

    @app.get(STATE_PATH, response_model=MemberState)
    async def sync_state() -> MemberState:
        return receiver().state()

    @app.post(JOIN_PATH, status_code=202)
    async def sync_join(request: JoinRequest) -> dict:
        try:
            receiver().join(request)
        except FingerprintMismatch as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None
        return {"accepted": True}

    @app.post(PREPARE_PATH, status_code=202)
    async def sync_prepare(request: PrepareRequest) -> dict:
        try:
            receiver().prepare(request)
        except StaleEpoch as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None
        return {"accepted": True}

    return app


class RequestGuard:
    """ASGI middleware that refuses a request before its body is read: without the token (401) on a guarded path,
    or with a body over `max_body_bytes` (413, announced by Content-Length or counted as a chunked body arrives).

    FastAPI reads and parses a body before running a route's dependencies, so a token check there would let anyone
    make the server read (and hold) whatever they send."""

    def __init__(self, app: Any, *, token: str, max_body_bytes: int):
        self.app = app
        self._expected = f"Bearer {token}".encode()
        self._max = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if scope["path"] not in OPEN_PATHS and not hmac.compare_digest(
            headers.get(b"authorization", b""), self._expected
        ):
            await _refuse(scope, receive, send, 401, "missing or wrong bearer token (GRPOLORA_TOKEN)")
            return
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


async def _refuse(scope: dict, receive: Any, send: Any, status: int, detail: str) -> None:
    response = JSONResponse({"detail": detail}, status_code=status, headers={"Connection": "close"})
    await response(scope, receive, send)


def _count_round(outcome: RoundOutcome) -> None:
    if outcome.activated:
        log.info(
            "adapter version %d: %d bytes received in %.3fs, live after %.3fs",
            outcome.version,
            outcome.bytes,
            outcome.receive_seconds,
            outcome.activate_seconds,
        )


def engine_config(env: WorkerEnv, model_dir: str) -> EngineConfig:
    return config_for(env.spec, model_dir)


def serve(env: WorkerEnv) -> int:
    """`grpolora worker inference`: resolve the model, start the engine and the API, receive adapters."""
    import torch
    import uvicorn

    from grpolora.workers.models import fingerprint, resolve_model

    cpu_engine_env(env.spec)
    holder: dict[str, str] = {}

    async def prepare() -> None:
        model_dir = await asyncio.to_thread(resolve_model, env.model, env.spec.model.revision)
        holder["fingerprint"] = await asyncio.to_thread(fingerprint, model_dir)
        engine.config = engine_config(env, str(model_dir))

    def receiver_factory(engine: AdapterEngine) -> AdapterReceiver:
        device = torch.device("cuda", 0) if env.sync_backend == "nccl" else None
        return AdapterReceiver(
            engine,
            replica_index=env.replica_index,
            fingerprint=holder["fingerprint"],
            key=wire.header_key(env.token),
            device=device,
            on_round=_count_round,
            on_error=lambda kind: metrics.SYNC_FAILURES.labels(reason=kind).inc(),
        )

    failed: list[bool] = []

    def stop_on_fatal() -> None:  # closes over `server`, assigned below before it can run
        failed.append(True)
        server.should_exit = True

    for stale in remove_stale_adapter_roots():
        log.info("removed the adapter folder of a server that no longer runs: %s", stale)
    engine = AdapterEngine(engine_config(env, env.model), adapter_root=default_adapter_root(env.job_name))
    app = create_app(
        engine,
        receiver_factory,
        token=env.token,
        version_wait_seconds=env.sync_timeout_seconds,
        prepare=prepare,
        on_fatal=stop_on_fatal,
    )
    port = int(env.own_endpoint.rsplit(":", 1)[1])
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=env.bind_addr,
            port=port,
            log_level="info",
            access_log=False,
            # On SIGTERM, requests in flight get this long; then the engine shuts down (uvicorn would otherwise wait
            # for them without limit, and a client that is gone already cannot end them).
            timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
        )
    )
    server.run()
    return 1 if failed else 0
