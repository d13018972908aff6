"""The inference server's HTTP app around an in-process engine stand-in (tests/workers/fakeengine.py, no vLLM):
the bearer-token guard on every data and control endpoint, and how a request's sampling settings reach the
engine. The same app with a real vLLM engine is tested in test_inference_sync.py (marked vllm); this keeps the
guard in the fast run."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from grpolora.api.pool import environment_token
from grpolora.workers.inference import app as app_module
from grpolora.workers.inference.app import MAX_BODY_BYTES, create_app
from grpolora.workers.inference.metrics import TokenRate
from grpolora.workers.inference.sessions import CHAT_PATH, SESSIONS_PATH
from grpolora.workers.sync import wire
from grpolora.workers.sync.control import JOIN_PATH, POOL_PATH, PREPARE_PATH, REFUSAL_HEADER, STATE_PATH
from grpolora.workers.sync.receiver import AdapterReceiver
from tests.workers.fakeengine import TOKEN, FakeOwnEngineBook, fake_servers


def receiver_factory(sink) -> AdapterReceiver:
    return AdapterReceiver(sink, replica_index=0, fingerprint="f" * 64, key=wire.round_key(TOKEN))


def wait_healthy(client: TestClient) -> None:
    deadline = time.monotonic() + 10
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the app never became healthy"
        time.sleep(0.01)


@pytest.fixture
def served(tmp_path):
    engine = FakeOwnEngineBook(tmp_path)
    app = create_app(engine, receiver_factory, token=TOKEN, version_wait_seconds=1)
    with TestClient(app) as client:
        wait_healthy(client)
        yield client, engine


def test_an_engine_that_dies_fails_health_at_once_and_stops_the_server(tmp_path):
    """vLLM's EngineCore or a worker died (an OOM kill, a CUDA error, a fault in the sync member's thread there): the
    HTTP process must not live on as a healthy-looking shell. /health fails from then on (the kubelet's liveness
    probe) and the server stops (on_fatal: `grpolora worker inference` exits 1, so the StatefulSet or `grpolora
    run` starts it again). vLLM's own API server does the same: vllm/entrypoints/launchers/launcher.py,
    watchdog_loop and terminate_if_errored, on AsyncLLM.errored (set by MPClient's engine-core monitor thread,
    vllm/v1/engine/core_client.py, start_engine_core_monitor). The real engine's death: test_inference_sync.py."""
    engine = FakeOwnEngineBook(tmp_path)
    stopped = threading.Event()
    app = create_app(engine, receiver_factory, token=TOKEN, version_wait_seconds=1, on_fatal=stopped.set)
    with TestClient(app) as client:
        wait_healthy(client)
        assert not stopped.is_set()
        engine.died = True
        response = client.get("/health")  # at once: not after the watchdog's next look
        assert response.status_code == 500 and "engine died" in response.text, response.text
        assert stopped.wait(10), "the server was not stopped after its engine died"
        assert client.get("/health").status_code == 500


def test_a_hung_engine_fails_health_within_its_bound_and_sends_no_second_round_trip(tmp_path, monkeypatch):
    """A hung engine (its processes alive, so `dead` stays false; it answers nothing: a wedged GPU, a deadlock, an
    EngineCore stopped with SIGSTOP) fails /health within the bound, so that the kubelet's liveness probe and
    `grpolora run` replace the server (before, /health said ok for ever). Later probes fail at once without sending
    the engine another call; once it answers again, /health is ok again. The real engine's round trip:
    VllmEngine.round_trip; the whole path with a stopped EngineCore: test_local_run.py."""
    monkeypatch.setattr(app_module, "ENGINE_PROBE_SECONDS", 0.5, raising=False)
    engine = FakeOwnEngineBook(tmp_path)
    app = create_app(engine, receiver_factory, token=TOKEN, version_wait_seconds=1)
    with TestClient(app) as client:
        wait_healthy(client)
        sent = engine.round_trips
        assert client.get("/health").status_code == 200
        assert engine.round_trips == sent + 1  # each probe asks the engine
        engine.hung = True
        started = time.monotonic()
        response = client.get("/health")
        waited = time.monotonic() - started
        assert response.status_code == 500 and "has not answered a round trip" in response.text, response.text
        assert waited >= 0.45, f"failed after {waited:.2f}s, before the bound"
        assert client.get("/started").status_code == 200  # the start is through: the liveness probe's to act on
        sent = engine.round_trips
        for _ in range(3):
            started = time.monotonic()
            assert client.get("/health").status_code == 500
            assert time.monotonic() - started < 0.45  # at once: the round trip sent earlier is still unanswered
        assert engine.round_trips == sent  # no pile of calls in a hung engine
        engine.hung = False
        wait_healthy(client)


SLOW_JOIN_SECONDS = 4.0
CONTROL_TIMEOUT = 1.0  # the link's control timeout in these tests (CONTROL_TIMEOUT_SECONDS, 10 s, in a server)


def slow_first_join_worker(address: str, authkey_hex: str) -> None:
    """vLLM's worker's end of the members, whose first join takes longer than the control timeout, as the join's
    abort of the stale group on the control thread can (AdapterReceiver.join runs stale.close(); on NCCL,
    ProcessGroupNCCL.abort waits on ncclCommAbort, which is unbounded on a dead InfiniBand peer)."""
    from grpolora.workers.inference.member_host import serve_host
    from grpolora.workers.sync.receiver import AdapterReceiver

    join, joins = AdapterReceiver.join, []

    def slow_first(self, request):
        joins.append(request)
        if len(joins) == 1:
            time.sleep(SLOW_JOIN_SECONDS)
        return join(self, request)

    AdapterReceiver.join = slow_first
    serve_host(address, authkey_hex).finished.wait()


def join_body(**fields) -> dict:
    body = {
        "epoch": 1,
        "rank": 1,
        "world_size": 2,
        "store_addr": "127.0.0.1",
        "store_port": 1,
        "backend": "gloo",
        "timeout_seconds": 1,
        "join_timeout_seconds": 1,
        "trainer_fingerprint": "another model",  # refused by the member itself: its answer shows it was reached
        "current_version": 0,
    }
    return body | fields


def test_a_member_whose_control_call_timed_out_is_attached_again_at_the_next_join(tmp_path):
    """A control call that outlives the control timeout closes the tenant's channel (a late answer would be read as
    the next call's), and the worker's end closes its member when its late answer cannot be sent. Before, every
    later call of that job answered MemberUnreachable for good while /health said ok: the job's own server NotReady
    for ever, a pool serving the job without syncing it. Now the trainer's next join attaches a new member, which
    answers; /health stays ok throughout. Real MemberLink and member host (a spawned process: the worker's end);
    the NCCL abort's length is played by a slow first join."""
    import asyncio
    import multiprocessing as mp

    from grpolora.workers.inference.member_link import MemberLink
    from grpolora.workers.inference.server import sync_member_factory

    link = MemberLink(timeout_seconds=60.0)  # the spawned worker end imports torch: seconds under load
    processes = []

    async def connect(address: str, authkey_hex: str) -> list[bool]:
        process = mp.get_context("spawn").Process(target=slow_first_join_worker, args=(address, authkey_hex))
        process.start()
        processes.append(process)
        return [True]

    asyncio.run(link.start(connect))
    link.timeout_seconds = CONTROL_TIMEOUT
    factory = sync_member_factory(lambda: link, replica_index=0, fingerprint=lambda: "f" * 64)
    engine = FakeOwnEngineBook(tmp_path)

    def member(book):
        return factory(book, wire.round_key(TOKEN), "local")

    app = create_app(engine, member, token=TOKEN, version_wait_seconds=1)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            wait_healthy(client)
            first = client.post(JOIN_PATH, json=join_body(), headers=auth)
            assert first.status_code == 500, first.text  # MemberUnreachable: no answer within the timeout
            assert client.get(STATE_PATH, headers=auth).status_code == 500  # its channel is closed
            assert client.get("/health").status_code == 200  # the engine is fine: nothing to replace
            again = client.post(JOIN_PATH, json=join_body(epoch=2), headers=auth)
            # Reached a member (a new one), which refused the other model's trainer itself: 409, not 500.
            assert again.status_code == 409 and again.headers.get(REFUSAL_HEADER) == "FingerprintMismatch"
            assert client.get(STATE_PATH, headers=auth).json()["replica_index"] == 0
            assert client.get("/health").status_code == 200
    finally:
        link.close()
        for process in processes:
            process.join(30)
    assert processes[0].exitcode == 0, "the worker end did not leave when the HTTP process's link closed"


class LostMember:
    """A RemoteMember whose channel was lost (its control call timed out)."""

    lost = "join: TimeoutError('no answer within 10s')"
    asked = ready = False

    def close(self) -> None:
        pass


def test_health_fails_when_a_lost_member_cannot_be_attached_again(tmp_path):
    """Where the worker cannot give the job a new member (a GPU budget still held by the stuck one, a link that no
    longer answers), the replica is no use to that job: /health fails, naming why, so that the kubelet or
    `grpolora run` replaces it."""
    made = []

    def factory(book):
        made.append(book)
        if len(made) > 1:
            raise RuntimeError("the member worker could not attach local: no room")
        return LostMember()

    app = create_app(FakeOwnEngineBook(tmp_path), factory, token=TOKEN, version_wait_seconds=1)
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_healthy(client)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert client.post(JOIN_PATH, json=join_body(), headers=auth).status_code == 500
        health = client.get("/health")
        assert health.status_code == 500, health.text
        assert "sync member of local was lost" in health.text and "no room" in health.text


GUARDED = [
    ("post", "/v1/generate", {"prompt_token_ids": [[1, 2]]}),
    ("get", STATE_PATH, None),
    ("get", POOL_PATH, None),
    ("post", JOIN_PATH, {}),
    ("post", PREPARE_PATH, {}),
    ("post", f"{SESSIONS_PATH}/s1", {}),
    ("post", f"{SESSIONS_PATH}/s1{CHAT_PATH}", {"messages": [{"role": "user", "content": "hi"}]}),
    ("get", f"{SESSIONS_PATH}/s1", None),
    ("post", f"{SESSIONS_PATH}/s1/close", {}),
]
# The last: the job's environment server's token (derived from the job's, grpolora.api.pool.environment_token). The
# server runs model-driven code; holding that token it must reach no replica's generate, sessions or control.
WRONG = [None, "Bearer wrong", f"bearer {TOKEN}", TOKEN, f"Bearer {TOKEN}x", f"Basic {TOKEN}",
         f"Bearer {environment_token(TOKEN)}"]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "body"), GUARDED, ids=[p for _, p, _ in GUARDED])
@pytest.mark.parametrize("header", WRONG, ids=[str(h) for h in WRONG])
def test_data_and_control_endpoints_refuse_a_missing_or_wrong_token(served, method, path, body, header):
    client, engine = served
    headers = {} if header is None else {"Authorization": header}
    response = client.request(method, path, json=body, headers=headers)
    assert response.status_code == 401, response.text
    assert "GRPOLORA_TOKEN" in response.json()["detail"]
    assert engine.requests == []


def test_the_right_token_is_let_through_and_probes_stay_open(served):
    client, _ = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    response = client.post("/v1/generate", json={"prompt_token_ids": [[1, 2]]}, headers=auth)
    assert response.status_code == 200 and response.json()["results"][0]["samples"][0]["token_ids"] == [3]
    assert client.get(STATE_PATH, headers=auth).json()["replica_index"] == 0
    for path in ("/started", "/health", "/metrics", "/v1/adapter"):  # probes and scraping carry no token
        assert client.get(path).status_code == 200, path
    assert client.get("/ready").status_code in (200, 503)  # open too; readiness depends on the adapter


def test_a_jobs_own_server_names_no_pool_replicas_and_the_trainer_keeps_its_members(tmp_path):
    """Every trainer asks its members for a pool's replicas (it cannot tell a pool's servers from its own job's):
    a job's own server answers 404, which the trainer reads as no list to follow."""
    from grpolora.workers.sync.control import HttpMember

    with fake_servers(tmp_path, 1) as (server,):
        member = HttpMember(0, server.url, TOKEN)
        assert httpx.get(f"{server.url}{POOL_PATH}", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404
        assert member.pool_replicas() is None
        member.close()


def test_one_seed_per_prompt_reaches_the_engine(served):
    client, engine = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = {"prompt_token_ids": [[1], [2], [3]], "n": 2, "temperature": 0.7, "top_p": 0.9, "seed": [11, 22, 33]}
    assert client.post("/v1/generate", json=body, headers=auth).status_code == 200
    assert {tuple(p): r.seed for p, r in engine.requests} == {(1,): 11, (2,): 22, (3,): 33}
    assert all((r.n, r.temperature, r.top_p) == (2, 0.7, 0.9) for _, r in engine.requests)
    engine.requests.clear()
    assert client.post("/v1/generate", json=body | {"seed": 5}, headers=auth).status_code == 200
    assert [r.seed for _, r in engine.requests] == [5, 5, 5]  # one int seeds every prompt alike
    refused = client.post("/v1/generate", json=body | {"seed": [1, 2]}, headers=auth)
    assert refused.status_code == 422 and "one seed per prompt" in refused.text


def test_completion_tokens_are_counted_per_job_and_as_a_rate_for_the_pool_status(served, monkeypatch):
    """GET /v1/adapter reports the server's completion tokens per second (the RolloutPool's Tokens/s column)."""
    from grpolora.workers.inference import metrics

    # The process-wide rate holds earlier tests' tokens, which may leave its window between two reads (CI saw
    # 1.4 before and after): this test's rate starts empty and its clock stands still.
    monkeypatch.setattr(metrics, "TOKEN_RATE", TokenRate(window_seconds=10, clock=lambda: 100.0))
    client, _ = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert client.get("/v1/adapter").json()["tokens_per_second"] == 0
    body = {"prompt_token_ids": [[1], [2], [3]], "n": 2}
    assert client.post("/v1/generate", json=body, headers=auth).status_code == 200
    assert client.get("/v1/adapter").json()["tokens_per_second"] == 0.6  # 6 one-token completions over 10 s
    scraped = client.get("/metrics").text
    assert re.search(r'grpolora_inference_generated_tokens_total\{job="[^"]+"\} [1-9]', scraped), scraped


def test_token_rate_counts_the_window_only():
    now = [100.0]
    rate = TokenRate(window_seconds=10, clock=lambda: now[0])
    assert rate.per_second() == 0
    rate.add(30)
    now[0] = 105.0
    rate.add(20)
    assert rate.per_second() == 5.0  # 50 tokens over the 10 s window
    now[0] = 112.0
    assert rate.per_second() == 2.0  # the first 30 left the window
    now[0] = 200.0
    assert rate.per_second() == 0


@pytest.fixture(scope="module")
def uvicorn_server(tmp_path_factory):
    """The app served by uvicorn on loopback: what a real client meets (TestClient has no socket to close)."""
    with fake_servers(tmp_path_factory.mktemp("uvicorn"), 1) as (server,):
        yield server


BIG = 50 << 20  # a body over MAX_BODY_BYTES (32 MiB)
OVERSIZED = [
    ({"Authorization": f"Bearer {TOKEN}"}, False, 413, f"request body over {MAX_BODY_BYTES} bytes"),
    ({"Authorization": f"Bearer {TOKEN}"}, True, 413, f"request body over {MAX_BODY_BYTES} bytes"),  # counted
    ({}, False, 401, "GRPOLORA_TOKEN"),  # refused before the body is read, like the 413
]


@pytest.mark.parametrize(("headers", "chunked", "status", "words"), OVERSIZED, ids=["413", "413-chunked", "401"])
def test_a_refused_large_body_gets_its_answer_not_a_reset(uvicorn_server, headers, chunked, status, words):
    """The server answers before reading a body it refuses. A client that writes its whole body before it reads
    (httpx's AsyncClient, as the rollout client uses it; http.client) must then read that answer, not a reset
    from a connection closed under it (ReadError / BrokenPipeError before the server lingered)."""
    piece = b" " * (1 << 20)

    async def chunks():
        for _ in range(BIG // len(piece)):
            yield piece

    async def post() -> httpx.Response:
        content = chunks() if chunked else b"[" + b" " * BIG + b"]"
        async with httpx.AsyncClient(timeout=60) as client:
            return await client.post(f"{uvicorn_server.url}/v1/generate", content=content, headers=headers)

    response = asyncio.run(post())
    assert response.status_code == status and words in response.json()["detail"], response.text


@pytest.mark.parametrize("path", [STATE_PATH, JOIN_PATH, PREPARE_PATH, "/ready"])
def test_a_control_call_waiting_on_the_member_in_vllms_worker_stalls_no_generation(tmp_path, path):
    """With the sync member in vLLM's worker (workers/inference/member_host.py), each /v1/sync/* call and the readiness
    probe is a socket round trip to that worker, answered within members.CONTROL_TIMEOUT_SECONDS (10 s) by a thread
    there. Made on the event loop, every generation and probe of the replica would wait for it meanwhile."""
    import concurrent.futures
    import json
    import multiprocessing

    from grpolora.workers.inference.member_link import RemoteMember
    from tests.workers.fakeengine import AppThread

    control, worker_control = multiprocessing.Pipe()
    events, worker_events = multiprocessing.Pipe()
    engine = FakeOwnEngineBook(tmp_path)

    def member(sink) -> RemoteMember:
        return RemoteMember(
            control, events, sink, replica_index=0, fingerprint="f" * 64, name="job", on_round=None, on_error=None,
            timeout_seconds=60,
        )  # fmt: skip

    auth = {"Authorization": f"Bearer {TOKEN}"}
    bodies = {
        JOIN_PATH: {"epoch": 1, "rank": 1, "world_size": 2, "store_addr": "127.0.0.1", "store_port": 1,
                    "backend": "gloo", "timeout_seconds": 5, "join_timeout_seconds": 5,
                    "trainer_fingerprint": "f" * 64, "current_version": 0},
        PREPARE_PATH: {"epoch": 1, "version": 1},
    }  # fmt: skip
    with AppThread(create_app(engine, member, token=TOKEN, version_wait_seconds=1)) as server:
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as threads:
                method = "post" if path in bodies else "get"
                call = threads.submit(
                    httpx.request, method, f"{server.url}{path}", json=bodies.get(path), headers=auth, timeout=60
                )
                # The call has reached the worker's end (observable: its request is there) and is not answered yet.
                assert worker_control.poll(20), f"{path} never reached the member"
                asked = json.loads(worker_control.recv_bytes())["op"]
                generated = httpx.post(
                    f"{server.url}/v1/generate", json={"prompt_token_ids": [[1, 2]]}, headers=auth, timeout=10
                )
                assert generated.status_code == 200
                assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
                assert not call.done()
                state = {"replica_index": 0, "fingerprint": "f" * 64, "epoch": None, "rank": None,
                         "live_version": 0, "required_version": 0, "busy": False}  # fmt: skip
                worker_control.send_bytes(json.dumps({"value": state if asked == "state" else True}).encode())
                deadline = time.monotonic() + 30
                while not call.done():  # and what else the call asks (readiness asks `asked`, then `ready`)
                    assert time.monotonic() < deadline, f"{path} never ended"
                    if worker_control.poll(0.05):
                        asked = json.loads(worker_control.recv_bytes())["op"]
                        worker_control.send_bytes(json.dumps({"value": True}).encode())
                assert call.result().status_code in (200, 202), path
        finally:
            worker_control.close()
            worker_events.close()
