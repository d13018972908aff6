"""`grpolora worker inference`: the inference server's process, configured only from the env contract.

It reads the env (WorkerEnv for a job's own server, PoolEnv for a RolloutPool's), sets what a CPU engine needs,
builds the vLLM engine and the adapter books of the jobs it serves, each with its sync member in vLLM's first worker
(this process relays the member's control calls and activates what it verified; it holds no collective and never
initialises CUDA: `sync_member_factory`), and serves the HTTP API (workers/inference/app.py) with uvicorn until
SIGTERM, or until the engine fails to start (exit 1; EXIT_INVALID_SPEC when the model does not exist or the token
cannot read it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI

from grpolora.api.contract import EXIT_INVALID_SPEC, PoolEnv, WorkerEnv, write_termination_message
from grpolora.api.pool import job_key
from grpolora.workers.inference import metrics
from grpolora.workers.inference.adapter_book import AdapterBook, OwnEngineBook
from grpolora.workers.inference.app import create_app, create_pool_app
from grpolora.workers.inference.member_link import MemberLink, RemoteMember
from grpolora.workers.inference.sessions import job_session_chat
from grpolora.workers.inference.tenants import pool_tenants
from grpolora.workers.inference.vllm_engine import EngineConfig, VllmEngine, config_for, cpu_engine_env
from grpolora.workers.sync import wire
from grpolora.workers.sync.receiver import RoundOutcome

log = logging.getLogger(__name__)

DRAIN_SECONDS = 25
"""On SIGTERM (a pool scaled down, a node drained, a pod replaced) the server stops accepting at once and gives the
generations in flight this long to finish: within the pod's terminationGracePeriodSeconds (Kubernetes' default of
30 s, pkg/apis/core/v1/defaults.go; the operator leaves it unset), with time left for the engine to stop. A
rollout request of a CPU or GPU replica takes seconds; one cut off is retried by the trainer on the other replicas."""


def _round_logger(job: str) -> Callable[[RoundOutcome], None]:
    def count(outcome: RoundOutcome) -> None:
        if outcome.activated:
            log.info(
                "%s: adapter version %d: %d bytes received in %.3fs, live after %.3fs",
                job,
                outcome.version,
                outcome.bytes,
                outcome.receive_seconds,
                outcome.activate_seconds,
            )

    return count


def _failure_counter(job: str) -> Callable[[str], None]:
    return lambda kind: metrics.SYNC_FAILURES.labels(job=job, reason=kind).inc()


def engine_config(env: WorkerEnv, model_dir: str) -> EngineConfig:
    return config_for(env.spec, model_dir)


def sync_member_factory(
    members: Callable[[], MemberLink], *, replica_index: int, fingerprint: Callable[[], str]
) -> Callable[[AdapterBook, bytes, str], RemoteMember]:
    """How this process gets a job's sync member: it is never here. The member (its group, its buffers, with
    `sync.backend: nccl` its CUDA context and stream) lives in vLLM's first worker; this process holds a
    RemoteMember, the control plane (join, prepare, state, readiness) and the job's book, which activates each
    verified round with one collective_rpc (workers/inference/member_link.py). `members`: the engine's link, once it
    has started."""

    def member(book: AdapterBook, key: bytes, job: str) -> RemoteMember:
        return members().attach(
            book,
            key=key,
            replica_index=replica_index,
            fingerprint=fingerprint(),
            name=job,
            on_round=_round_logger(job),
            on_error=_failure_counter(job),
        )

    return member


def serve(env: WorkerEnv | PoolEnv) -> int:
    """`grpolora worker inference`: resolve the model, start the engine and the API, receive adapters; for one job
    (its own server, WorkerEnv) or for the jobs attached to a RolloutPool (PoolEnv)."""
    from grpolora.workers.models import ModelUnavailable, fingerprint, resolve_model

    spec = env.spec
    cpu_engine_env(spec)
    holder: dict[str, str] = {}

    def link() -> MemberLink:
        assert engine.members is not None, "engine not started"
        return engine.members

    receiver = sync_member_factory(link, replica_index=env.replica_index, fingerprint=lambda: holder["fingerprint"])

    failed: list[bool] = []
    exit_code: list[int] = []

    def stop_on_fatal() -> None:  # closes over `server`, assigned below before it can run
        failed.append(True)
        server.should_exit = True

    if isinstance(env, PoolEnv):
        shared = VllmEngine(config_for(spec, env.model))
        engine: OwnEngineBook | VllmEngine = shared
        attachments = pool_tenants(shared, spec, pool=env.pool_name, jobs_file=Path(env.jobs_file), receiver=receiver)

        def app_for(prepare: Callable[[], Awaitable[None]]) -> FastAPI:
            return create_pool_app(
                shared,
                attachments,
                version_wait_seconds=spec.adapter_wait_seconds,
                prepare=prepare,
                on_fatal=stop_on_fatal,
            )
    else:
        job = job_key(env.namespace, env.job_name)
        own = OwnEngineBook(config_for(spec, env.model), job=job)
        engine = own

        def app_for(prepare: Callable[[], Awaitable[None]]) -> FastAPI:
            return create_app(
                own,
                lambda book: receiver(book, wire.round_key(env.token), job),
                token=env.token,
                version_wait_seconds=env.sync_timeout_seconds,
                job=job,
                prepare=prepare,
                on_fatal=stop_on_fatal,
                chat=lambda: job_session_chat(own.tokenizer(), spec),
            )

    async def prepare() -> None:
        try:
            model_dir = await asyncio.to_thread(resolve_model, env.model, spec.model.revision)
        except ModelUnavailable as exc:
            # A spec error, as for the trainer: its own exit code and message, where `kubectl describe` shows them,
            # so that a restarting server says why instead of exiting 1 again and again.
            write_termination_message(str(exc))
            exit_code.append(EXIT_INVALID_SPEC)
            raise
        holder["fingerprint"] = await asyncio.to_thread(fingerprint, model_dir)
        engine.config = config_for(spec, str(model_dir))

    server = uvicorn_server(app_for(prepare), host=env.bind_addr, port=env.port)
    server.run()
    return (exit_code or [1])[0] if failed else 0


def uvicorn_server(app: FastAPI, *, host: str, port: int):
    """The server's uvicorn: on SIGTERM it stops accepting, gives requests in flight DRAIN_SECONDS, then the app's
    shutdown closes the receivers and the engine (uvicorn would otherwise wait for them without limit, and a client
    that is gone already cannot end them)."""
    import uvicorn

    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", access_log=False, timeout_graceful_shutdown=DRAIN_SECONDS
    )
    return uvicorn.Server(config)
