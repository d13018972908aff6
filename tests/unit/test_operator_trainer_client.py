"""The operator's poll of trainer rank 0's /status: a tenant's trainer runs the job author's code, so what it answers
must not cost the shared operator more than a bounded body and a bounded time; what it refuses is counted."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from grpolora.operator.metrics import Metrics
from grpolora.operator.trainer_client import MAX_STATUS_BYTES, TrainerStatusClient, TrainerUnavailable

REPORT = {"phase": "Running", "totalSteps": 100, "step": 3, "syncMembers": [0]}


async def serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/status", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/status"


def refused(metrics: Metrics, reason: str) -> float:
    return metrics.registry.get_sample_value("grpolora_trainer_status_refused_total", {"reason": reason}) or 0.0


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_status_body_over_the_cap_is_refused_and_counted(chunked):
    big = json.dumps({**REPORT, "message": "x" * (2 * MAX_STATUS_BYTES)}).encode()

    async def handler(request: web.Request) -> web.StreamResponse:
        if not chunked:
            return web.Response(body=big, content_type="application/json")
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for start in range(0, len(big), 4096):
            await response.write(big[start : start + 4096])
        return response

    runner, url = await serve(handler)
    metrics = Metrics()
    client = TrainerStatusClient(metrics=metrics)
    try:
        with pytest.raises(TrainerUnavailable, match=f"over {MAX_STATUS_BYTES} bytes"):
            await client.fetch(url)
        assert refused(metrics, "too_large") == 1
        assert await client.json(url) is None  # the pool's adapter reports: the same cap
        assert refused(metrics, "too_large") == 2
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_deeply_nested_status_is_refused_like_an_oversized_one():
    """Under the byte cap, JSON nested thousands deep makes json.loads raise RecursionError (CPython's scanner enters
    a recursive call per level), which is no ValueError: it escaped the poll and failed the whole pass, which backed
    off and failed again at every poll. Refused and counted like a body over the cap, pass after pass."""
    depth = 20_000
    nested = ("[" * depth + "]" * depth).encode()
    assert len(nested) < MAX_STATUS_BYTES

    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=nested, content_type="application/json")

    runner, url = await serve(handler)
    metrics = Metrics()
    client = TrainerStatusClient(metrics=metrics)
    try:
        for polls in (1, 2, 3):
            with pytest.raises(TrainerUnavailable, match="nested too deep"):
                await client.fetch(url)
            assert await client.json(url) is None  # the pool's adapter reports: the same rule
            assert refused(metrics, "too_deep") == 2 * polls
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_status_under_the_cap_that_arrives_in_pieces_is_read_whole():
    # aiohttp's StreamReader.read(n) returns what is buffered, up to n bytes, not the body to its end: a report sent
    # in two writes with a pause between (a chunked body, or one split across TCP segments) must still be read whole.
    body = json.dumps(REPORT).encode()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(body[:10])
        await asyncio.sleep(0.2)  # the pause between the pieces; the client must wait for the rest, whatever its length
        await response.write(body[10:])
        return response

    runner, url = await serve(handler)
    metrics = Metrics()
    client = TrainerStatusClient(metrics=metrics)
    try:
        assert (await client.fetch(url)).step == 3
        assert await client.json(url) == REPORT
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_status_that_does_not_come_in_time_is_refused_and_counted():
    release = asyncio.Event()

    async def handler(_: web.Request) -> web.Response:
        await release.wait()  # never answers within the client's time
        return web.json_response(REPORT)

    runner, url = await serve(handler)
    metrics = Metrics()
    client = TrainerStatusClient(timeout=0.2, metrics=metrics)
    try:
        with pytest.raises(TrainerUnavailable, match="TimeoutError"):
            await client.fetch(url)
        assert refused(metrics, "timeout") == 1
    finally:
        release.set()
        await client.close()
        await runner.cleanup()


async def test_a_normal_status_is_read():
    runner, url = await serve(_json)
    client = TrainerStatusClient(metrics=Metrics())
    try:
        assert (await client.fetch(url)).step == 3
    finally:
        await client.close()
        await runner.cleanup()


async def _json(_: web.Request) -> web.Response:
    return web.json_response(REPORT)
