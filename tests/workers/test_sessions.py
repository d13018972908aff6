"""OpenAI-compatible chat sessions on the replicas (issue 48, item 1), called with the `openai` package's own client:
the real create_app, the real adapter book with its real activation, leases and unloading, fed by a real gloo sync,
around MarkingEngine (tests/workers/fakeengine.py), which stands in for vLLM alone and answers each call with one
token, the mark of the adapter whose weights served it. The rendering is SmolLM2's real chat template and tokenizer
through ChatDelta, the episodes' own suffix rendering."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from grpolora.api.load import parse_job
from grpolora.workers.environments.base import Opening
from grpolora.workers.environments.episode import ChatDelta
from grpolora.workers.inference.app import create_app
from grpolora.workers.inference.sessions import VERSION_HEADER, job_session_chat
from grpolora.workers.inference.vllm_engine import EngineLimits, Sample, config_for
from grpolora.workers.models import resolve_model
from grpolora.workers.sync import wire
from grpolora.workers.sync.control import HttpMember
from grpolora.workers.sync.receiver import AdapterReceiver
from tests.helpers import job_doc
from tests.workers.fakeengine import TOKEN, AppThread, FakeServer, MarkingBook, marked
from tests.workers.syncfakes import gloo_sender


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model("offline:smollm2-135m-instruct"))


@pytest.fixture
def replica(tokenizer):
    """A job's own replica keeping k + 1 = 2 versions (grpo.maxStaleness 1), and the trainer's sender to it."""
    spec = parse_job(job_doc(grpo={"maxStaleness": 1})).spec
    book = MarkingBook()
    with FakeServer(book=book, version_wait_seconds=2) as served:
        book.config = config_for(spec, "fake")
        book.limits = EngineLimits(max_model_len=2048, vocab_size=len(tokenizer))
        book._engine.get_tokenizer = lambda: tokenizer
        sender = gloo_sender([HttpMember(0, served.url, TOKEN)], token=TOKEN, timeout_seconds=10)
        try:
            sender.form_group()
            yield served, sender
        finally:
            sender.close()


def client(url: str, session: str, **options) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/sessions/{session}/v1", api_key=TOKEN, max_retries=0, **options)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_two_concurrent_sessions_pinned_to_different_versions_each_get_their_own_versions_tokens(replica, tokenizer):
    """Session a opens while version 1 is live, session b once version 2 is: their later calls, made at once, are
    served by their own version's adapter (mark 11 and 22), though version 2 is live for both; each continues its own
    ids, the new messages rendered as a suffix after the assistant's turn; the record masks the generated ids."""
    served, sender = replica
    assert sender.send(marked(11), {}).version == 1

    async def play() -> tuple[list, list, dict, dict]:
        a, b = client(served.url, "a"), client(served.url, "b")
        a_chat = [user("What is 12 * 7?")]
        first_a = await a.chat.completions.create(model="policy", messages=a_chat, max_tokens=4)
        await asyncio.to_thread(sender.send, marked(22), {})  # version 2 goes live while a is between turns
        b_chat = [user("Name a prime.")]
        first_b = await b.chat.completions.create(model="policy", messages=b_chat, max_tokens=4)
        a_chat += [first_a.choices[0].message.model_dump(exclude_none=True), user("And 12 * 8?")]
        b_chat += [first_b.choices[0].message.model_dump(exclude_none=True), user("Another one.")]
        second_a, second_b = await asyncio.gather(
            a.chat.completions.create(model="policy", messages=a_chat, max_tokens=4),
            b.chat.completions.create(model="policy", messages=b_chat, max_tokens=4),
        )
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            records = [(await http.get(f"{served.url}/sessions/{s}")).json() for s in "ab"]
        await a.close()
        await b.close()
        return [first_a, second_a], [first_b, second_b], *records

    a_answers, b_answers, a_record, b_record = asyncio.run(play())
    assert [answer.choices[0].message.content for answer in a_answers] == ["m11"] * 2  # MarkingEngine's text
    assert [answer.choices[0].message.content for answer in b_answers] == ["m22"] * 2
    assert (a_record["adapter_version"], b_record["adapter_version"]) == (1, 2)
    assert [call["completion_token_ids"] for call in a_record["calls"]] == [[11], [11]]
    assert [call["completion_token_ids"] for call in b_record["calls"]] == [[22], [22]]
    delta = ChatDelta(tokenizer)
    for record, mark, opening_text, follow_up in ((a_record, 11, "What is 12 * 7?", "And 12 * 8?"),
                                                  (b_record, 22, "Name a prime.", "Another one.")):  # fmt: skip
        (segment,) = record["segments"]
        text = tokenizer.apply_chat_template([user(opening_text)], tokenize=False, add_generation_prompt=True)
        opening = tokenizer(text, add_special_tokens=False)["input_ids"]
        turn = delta.environment_turn([mark], [user(follow_up)])
        assert segment["prompt_token_ids"] == list(opening)
        assert segment["token_ids"] == [mark, *turn, mark]  # token in, token out: the suffix, never re-rendered
        assert segment["mask"] == [1] + [0] * len(turn) + [1]
        assert segment["logprobs"] == [-0.5] + [0.0] * len(turn) + [-0.5]
        assert record["calls"][1]["prompt_token_ids"] == [*opening, mark, *turn]


def test_a_rewritten_history_starts_a_new_segment_and_close_returns_the_record(replica, tokenizer):
    served, sender = replica
    assert sender.send(marked(11), {}).version == 1
    assert sender.send(marked(22), {}).version == 2

    async def play() -> tuple[dict, int, int]:
        # Pinned at its first call to version 1, which this replica still keeps (k + 1 versions) though 2 is live.
        pinned = client(served.url, "c", default_headers={VERSION_HEADER: "1"})
        chat = [user("Hi")]
        answer = await pinned.chat.completions.create(model="policy", messages=chat)
        chat += [answer.choices[0].message.model_dump(exclude_none=True), user("Again")]
        await pinned.chat.completions.create(model="policy", messages=chat)
        # The agent edits its first message: the old ids no longer hold, a new segment begins.
        rewritten = [user("Hello"), *chat[1:]]
        await pinned.chat.completions.create(model="policy", messages=rewritten)
        other = client(served.url, "c", default_headers={VERSION_HEADER: "2"})
        with pytest.raises(openai.ConflictError):  # a session's version is its own for its life
            await other.chat.completions.create(model="policy", messages=rewritten)
        await pinned.close()
        await other.close()
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            closed = (await http.post(f"{served.url}/sessions/c/close")).json()
            gone = (await http.get(f"{served.url}/sessions/c")).status_code
        async with httpx.AsyncClient() as http:
            unauthenticated = (await http.get(f"{served.url}/sessions/c")).status_code
        return closed, gone, unauthenticated

    record, gone, unauthenticated = asyncio.run(play())
    assert record["closed"] and record["adapter_version"] == 1
    assert [call["segment"] for call in record["calls"]] == [0, 0, 1]
    assert [s["calls"] for s in record["segments"]] == [2, 1]
    assert all(call["completion_token_ids"] == [11] for call in record["calls"])
    rewritten = record["segments"][1]
    # The new segment is the rewritten conversation rendered afresh, then the one generated id.
    assert rewritten["prompt_token_ids"] == record["calls"][2]["prompt_token_ids"]
    assert (rewritten["token_ids"], rewritten["mask"]) == ([11], [1])
    assert (gone, unauthenticated) == (404, 401)


CALC_TOOL = {
    "type": "function",
    "function": {"name": "calc", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}},
}


def test_a_jobs_sessions_render_and_parse_as_its_episodes_tool_calls_included(tokenizer):
    """The server of a job with spec.environment.toolParser hermes (server.py passes job_session_chat): the model's
    call comes back as OpenAI `tool_calls` (finish_reason tool_calls); the agent's tool answer continues the ids."""
    spec = parse_job(job_doc(environment={"builtin": "calculator", "toolParser": "hermes"})).spec
    book = MarkingBook()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12*7"}}\n</tool_call>'

    prompts: list[list[int]] = []

    async def generate(prompt_token_ids, request, lora):
        prompts.append(prompt_token_ids)
        text = call if len(prompts) == 1 else "84."
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [end]
        return [Sample(ids, [-0.25] * len(ids), text, "stop")]

    app = create_app(
        book,
        lambda engine: AdapterReceiver(engine, replica_index=0, fingerprint="fp", key=wire.round_key(TOKEN)),
        token=TOKEN,
        version_wait_seconds=1,
        chat=lambda: job_session_chat(tokenizer, spec),
    )
    with AppThread(app) as served:
        book.limits = EngineLimits(max_model_len=2048, vocab_size=len(tokenizer))
        book._engine.generate = generate

        async def play():
            async with client(served.url, "t") as agent:
                chat = [user("What is 12 * 7?")]
                first = await agent.chat.completions.create(model="policy", messages=chat, tools=[CALC_TOOL])
                message = first.choices[0].message
                chat += [message.model_dump(exclude_none=True)]
                chat += [{"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "84"}]
                second = await agent.chat.completions.create(model="policy", messages=chat, tools=[CALC_TOOL])
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
                return first, second, (await http.get(f"{served.url}/sessions/t")).json()

        first, second, record = asyncio.run(play())
    assert first.choices[0].finish_reason == "tool_calls"
    (called,) = first.choices[0].message.tool_calls
    assert (called.function.name, json.loads(called.function.arguments)) == ("calc", {"expression": "12*7"})
    assert second.choices[0].message.content == "84."
    (segment,) = record["segments"]  # the tool answer continued the session's ids: one segment
    assert record["adapter_version"] == 0 and [c["segment"] for c in record["calls"]] == [0, 0]
    assert sum(segment["mask"]) == sum(len(c["completion_token_ids"]) for c in record["calls"])
    assert prompts[1][: len(prompts[0])] == prompts[0]  # token in, token out: the first prompt, then the rest
    assert record["calls"][1]["prompt_token_ids"] == prompts[1]


def test_what_a_session_does_not_serve_is_refused_with_the_field_named(replica):
    """Streaming, n > 1, a forced tool choice (no guided decoding here), an unknown role or field: 4xx naming what,
    never a silent fallback; and a refused call leaves no session behind."""
    served, _ = replica
    base = {"model": "policy", "messages": [user("Hi")]}
    cases = [
        ({"stream": True}, "stream"),
        ({"n": 2}, "n"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "calc"}}}, "tool_choice"),
        ({"messages": [{"role": "robot", "content": "Hi"}]}, "role"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
    ]
    with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        for extra, named in cases:
            answer = http.post(f"{served.url}/sessions/r/v1/chat/completions", json=base | extra)
            assert answer.status_code == 422 and named in answer.text, (extra, answer.text)
        # Refused by the model's limits once the session was opened under its version: it is forgotten again.
        too_long = http.post(f"{served.url}/sessions/r/v1/chat/completions", json=base | {"max_tokens": 4096})
        assert too_long.status_code == 400 and "max_tokens" in too_long.text
        assert http.get(f"{served.url}/sessions/r").status_code == 404
        bad = http.post(f"{served.url}/sessions/r/v1/chat/completions", json=base, headers={VERSION_HEADER: "x"})
        assert bad.status_code == 422 and VERSION_HEADER in bad.text.lower()


def test_a_full_server_forgets_its_oldest_idle_session_and_refuses_when_none_is_idle():
    import time

    from fastapi import HTTPException

    from grpolora.workers.inference.sessions import Sessions

    sessions = Sessions(max_sessions=3, idle_seconds=100.0)
    now = time.monotonic()
    for sid, idle in (("a", 200.0), ("b", 300.0), ("c", 0.0)):
        sessions.open("job", sid, 1).used = now - idle  # a and b idle past the limit, b the longest; c just called
    sessions.open("job", "d", 1)
    assert sessions.get("job", "b") is None and sessions.get("job", "a") is not None and len(sessions) == 3
    for sid in ("a", "c", "d"):
        sessions.get("job", sid)  # called now: none idle
    with pytest.raises(HTTPException) as refused:
        sessions.open("job", "e", 1)
    assert refused.value.status_code == 429 and len(sessions) == 3


def bounds(**overrides) -> dict:
    """SessionBounds as the trainer opens an agent's session (workers/environments/agent.py, AgentSessions)."""
    return {"max_calls": 2, "max_tokens": 400, "max_new_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
            "seed": 7} | overrides  # fmt: skip


def requests_of(served) -> list:
    """Every SamplingRequest the replica's engine is given from now on (the marking engine still answers them)."""
    asked: list = []
    engine = served.engine._engine
    marking = engine.generate

    async def generate(prompt_token_ids, request, lora):
        asked.append(request)
        return await marking(prompt_token_ids, request, lora)

    engine.generate = generate
    return asked


def test_a_session_the_trainer_opened_is_pinned_bounded_and_sampled_as_the_job_samples(replica, tokenizer):
    """The trainer opens an agent's session before the agent runs: its version is pinned then, each call samples with
    the job's temperature, top-p and top-k and seed + call whatever the agent asks, generates at most maxNewTokens,
    and a call past maxTurns is refused (400, naming the limit) and recorded, the session kept for its record."""
    served, sender = replica
    assert sender.send(marked(11), {}).version == 1
    asked = requests_of(served)
    with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        opened = http.post(f"{served.url}/sessions/agent-1", json=bounds(adapter_version=1))
        assert opened.status_code == 200 and opened.json()["adapter_version"] == 1
        assert http.post(f"{served.url}/sessions/agent-1", json=bounds()).status_code == 409  # opened once
        assert sender.send(marked(22), {}).version == 2  # live moves on; the session keeps version 1

    async def play() -> list:
        agent = client(served.url, "agent-1")
        chat, answers = [user("Hi")], []
        for _ in range(3):
            try:
                answer = await agent.chat.completions.create(model="policy", messages=chat, max_tokens=100,
                                                             temperature=0.0, seed=99)  # fmt: skip
            except openai.BadRequestError as exc:
                answers.append(exc)
                break
            answers.append(answer)
            chat += [answer.choices[0].message.model_dump(exclude_none=True), user("More")]
        await agent.close()
        return answers

    first, second, refused = asyncio.run(play())
    assert [a.choices[0].message.content for a in (first, second)] == ["m11", "m11"]  # version 1's adapter
    assert [(r.temperature, r.top_p, r.top_k, r.max_tokens, r.seed) for r in asked] == [(0.5, 0.9, 5, 3, 7),
                                                                                          (0.5, 0.9, 5, 3, 8)]
    # In the client's own words too (OpenAI's `error.message`): an agent's log says why, not just "Error code: 400".
    assert refused.status_code == 400 and "spec.environment.maxTurns" in str(refused)
    with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        record = http.post(f"{served.url}/sessions/agent-1/close").json()
    assert "maxTurns" in record["refused"] and len(record["calls"]) == 2
    (segment,) = record["segments"]
    assert [m["role"] for m in segment["messages"]] == ["user", "assistant", "user", "assistant"]
    assert segment["finish_reasons"] == ["length", "length"]


def test_a_bounded_sessions_calls_end_where_max_episode_tokens_does(replica, tokenizer):
    """maxEpisodeTokens bounds a segment's ids, its prompt included: a call generates at most what is left, and one
    whose conversation already fills it is refused (the episode truncated), never served past it."""
    served, sender = replica
    assert sender.send(marked(11), {}).version == 1
    opening = ChatDelta(tokenizer).opening(Opening([user("Hi")]))
    asked = requests_of(served)
    with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        room = bounds(max_calls=8, max_tokens=len(opening) + 2, max_new_tokens=48)
        assert http.post(f"{served.url}/sessions/agent-2", json=room).status_code == 200

        def call(messages: list) -> httpx.Response:
            return http.post(f"{served.url}/sessions/agent-2/v1/chat/completions", json={"messages": messages})

        first = call([user("Hi")])
        assert first.status_code == 200, first.text
        chat = [user("Hi"), first.json()["choices"][0]["message"], user("More")]
        refused = call(chat)
        assert refused.status_code == 400 and "spec.environment.maxEpisodeTokens" in refused.text
        record = http.get(f"{served.url}/sessions/agent-2").json()
    assert [request.max_tokens for request in asked] == [2] and "maxEpisodeTokens" in record["refused"]


def figures(url: str, job: str) -> dict[str, float]:
    """The server's /metrics as Prometheus scrapes it: `name{label=value,...}` -> value, for `job`'s series."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.labels.get("job") == job:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in {"job", "le"})
                if "le" not in sample.labels:
                    found[f"{sample.name}{{{labels}}}"] = sample.value
    return found


def test_session_figures_on_metrics_sessions_calls_tokens_latency_and_refusals_by_reason(tokenizer):
    """A job's own server under its own job label, scraped at GET /metrics as Prometheus does: sessions open, opened
    and closed; calls and tokens per session observed as a session closes; each answered call's latency; and every
    refused call by its reason, a failure of the server's own as `error` (a refused first call opens nothing)."""
    job = "figures/agent"
    book = MarkingBook()
    failing = []

    async def generate(prompt_token_ids, request, lora):
        if failing:
            raise RuntimeError("the engine failed")
        return [Sample([7, 8], [-0.5, -0.25], "m7", "length")]

    app = create_app(
        book,
        lambda engine: AdapterReceiver(engine, replica_index=0, fingerprint="fp", key=wire.round_key(TOKEN)),
        token=TOKEN,
        version_wait_seconds=0.2,
        job=job,
    )
    with AppThread(app) as served:
        book.limits = EngineLimits(max_model_len=2048, vocab_size=len(tokenizer))
        book._engine.get_tokenizer = lambda: tokenizer
        book._engine.generate = generate
        assert not any(key.startswith("grpolora_inference_session") for key in figures(served.url, job))

        async def play() -> dict:
            async with client(served.url, "kept") as kept, client(served.url, "closed") as closed:
                chat = [user("Hi")]
                first = await closed.chat.completions.create(model="policy", messages=chat, max_tokens=2)
                chat += [first.choices[0].message.model_dump(exclude_none=True), user("Again")]
                await closed.chat.completions.create(model="policy", messages=chat, max_tokens=2)
                await kept.chat.completions.create(model="policy", messages=[user("Hi")], max_tokens=2)
                with pytest.raises(openai.ConflictError):  # "kept" is pinned to version 0
                    await kept.chat.completions.create(
                        model="policy", messages=[user("Hi")], extra_headers={VERSION_HEADER: "1"}
                    )
                with pytest.raises(openai.ConflictError):  # version 5 never goes live
                    async with client(served.url, "early", default_headers={VERSION_HEADER: "5"}) as early:
                        await early.chat.completions.create(model="policy", messages=[user("Hi")])
                with pytest.raises(openai.UnprocessableEntityError):  # refused by the route
                    await kept.chat.completions.create(
                        model="policy", messages=[user("Hi")], tool_choice={"type": "function", "function": {}}
                    )
                with pytest.raises(openai.UnprocessableEntityError):  # refused by FastAPI, before the route
                    await kept.chat.completions.create(model="policy", messages=[user("Hi")], n=2)
                async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
                    opened = await http.post(f"{served.url}/sessions/bounded", json=bounds(max_calls=1))
                    assert opened.status_code == 200
                async with client(served.url, "bounded") as bounded:
                    answer = await bounded.chat.completions.create(model="policy", messages=[user("Hi")])
                    chat = [user("Hi"), answer.choices[0].message.model_dump(exclude_none=True), user("More")]
                    with pytest.raises(openai.BadRequestError):  # past its maxTurns
                        await bounded.chat.completions.create(model="policy", messages=chat)
                failing.append(True)
                async with client(served.url, "failed") as failed:
                    with pytest.raises(openai.InternalServerError):
                        await failed.chat.completions.create(model="policy", messages=[user("Hi")])
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
                return (await http.post(f"{served.url}/sessions/closed/close")).json()

        record = asyncio.run(play())
        found = figures(served.url, job)
    (segment,) = record["segments"]
    assert found["grpolora_inference_sessions_open{}"] == 2  # "kept", "bounded"; refused first calls left nothing
    assert found["grpolora_inference_sessions_opened_total{}"] == 3
    assert found["grpolora_inference_sessions_closed_total{reason=closed}"] == 1
    assert found["grpolora_inference_calls_per_session_count{}"] == 1
    assert found["grpolora_inference_calls_per_session_sum{}"] == 2
    all_ids = len(segment["prompt_token_ids"]) + len(segment["token_ids"])
    assert found["grpolora_inference_tokens_per_session_sum{kind=all}"] == all_ids
    assert found["grpolora_inference_tokens_per_session_sum{kind=generated}"] == 4  # two calls of [7, 8]
    calls = {key: value for key, value in found.items() if key.startswith("grpolora_inference_session_calls_total")}
    assert calls == {
        "grpolora_inference_session_calls_total{status=ok}": 4,
        "grpolora_inference_session_calls_total{status=limit}": 1,
        "grpolora_inference_session_calls_total{status=pinned}": 1,
        "grpolora_inference_session_calls_total{status=version_unavailable}": 1,
        "grpolora_inference_session_calls_total{status=invalid}": 2,
        "grpolora_inference_session_calls_total{status=error}": 1,
    }
    assert found["grpolora_inference_session_call_seconds_count{}"] == 4
    assert found["grpolora_inference_requests_total{status=error}"] == 1  # as /v1/generate counts its failures


def test_a_session_forgotten_idle_is_counted_with_its_calls_and_tokens():
    """Sessions.open forgets the oldest idle session to make room: it leaves the open count as `idle`, its length
    observed; a session that never answered a call leaves no figure."""
    import time

    from grpolora.workers.environments.episode import EpisodeTokens
    from grpolora.workers.inference import metrics
    from grpolora.workers.inference.sessions import Segment, Sessions, _answered

    job = "figures/idle"

    def value(name: str, **labels: str) -> float:
        return metrics.REGISTRY.get_sample_value(name, {"job": job, **labels}) or 0.0

    sessions = Sessions(max_sessions=1, idle_seconds=10.0)
    old = sessions.open(job, "old", 0)
    sample = Sample([4, 5], [-0.1, -0.2], "", "stop")
    _answered(old, Segment(EpisodeTokens([1, 2, 3]), [], None), None, [1, 2, 3], sample)
    sessions.answered(old)  # what the route does as a call is answered: the first counts the session as opened
    old.used = time.monotonic() - 60
    sessions.open(job, "new", 0)
    assert value("grpolora_inference_sessions_open") == 0
    assert value("grpolora_inference_sessions_closed_total", reason="idle") == 1
    assert value("grpolora_inference_calls_per_session_sum") == 1
    assert value("grpolora_inference_tokens_per_session_sum", kind="all") == 5
    assert value("grpolora_inference_tokens_per_session_sum", kind="generated") == 2
    sessions.get(job, "new").used = time.monotonic() - 60
    sessions.open(job, "newer", 0)  # "new" answered nothing: no figure
    assert value("grpolora_inference_sessions_closed_total", reason="idle") == 1


def test_a_detached_jobs_sessions_go_with_it_and_a_job_attached_again_finds_none(tokenizer, tmp_path):
    """A RolloutPool's server (the real pool app and attachment list, MarkingEngine for vLLM): job B opens a session,
    is detached (its token refused, its versions unloaded), then attached again under the same name. Its old session,
    pinned to a version the server no longer holds, must not be found again, and the open-sessions gauge must not
    count it (nor go below zero once it left)."""
    from grpolora.api.pool import Attachments, write_attachments
    from grpolora.testing.servers import pool_attachment, tiny_cpu_pool
    from grpolora.workers.inference.app import create_pool_app
    from grpolora.workers.inference.tenants import pool_tenants
    from tests.workers.fakeengine import MarkingEngine

    tokens = {"team/a": "token-of-a", "team/b": "token-of-b"}
    pool = tiny_cpu_pool(name="shared", namespace="team")
    jobs_file = tmp_path / "jobs.json"

    def attach(*jobs: str) -> None:
        write_attachments(jobs_file, Attachments(pool=pool.name, jobs=[pool_attachment(j, tokens[j]) for j in jobs]))

    attach("team/a", "team/b")
    engine = MarkingEngine()
    engine.get_tokenizer = lambda: tokenizer
    attachments = pool_tenants(
        engine,
        pool.pool.spec,
        pool=pool.name,
        jobs_file=jobs_file,
        receiver=lambda book, key, job: AdapterReceiver(book, replica_index=0, fingerprint="fp", key=key, name=job),
        join_grace_seconds=0,
    )
    as_b = {"Authorization": f"Bearer {tokens['team/b']}"}
    chat = {"model": "policy", "messages": [user("Hi")], "max_tokens": 1}

    def wait_for(condition, what: str) -> None:
        import time

        deadline = time.monotonic() + 20
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    with AppThread(create_pool_app(engine, attachments, version_wait_seconds=1)) as served:
        engine.limits = EngineLimits(max_model_len=2048, vocab_size=len(tokenizer))
        answer = httpx.post(f"{served.url}/sessions/old/v1/chat/completions", json=chat, headers=as_b)
        assert answer.status_code == 200
        assert figures(served.url, "team/b")["grpolora_inference_sessions_open{}"] == 1
        attach("team/a")
        wait_for(lambda: "grpolora_inference_sessions_open{}" not in figures(served.url, "team/b"), "B's series gone")
        attach("team/a", "team/b")
        wait_for(
            lambda: httpx.post(f"{served.url}/sessions/new/v1/chat/completions", json=chat, headers=as_b).status_code
            == 200,
            "B attached again",
        )
        old = httpx.get(f"{served.url}/sessions/old", headers=as_b)
        open_now = figures(served.url, "team/b")["grpolora_inference_sessions_open{}"]
    assert old.status_code == 404, old.text
    assert open_now == 1  # "new" alone
