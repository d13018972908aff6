"""spec.environment.url (issue 39): an environment that runs as a service, over HTTP on loopback. The service is the
project's own (workers/environments/service.py, uvicorn in a thread) serving the built-in calculator or a test's
environment; the client is what the trainer loads (load_environment). The replicas are played by
test_episodes.ScriptedReplicas, as there.

Where each rule comes from: retries on timeouts, connection errors, 429 and 5xx with a doubling back-off are the
rule our reward services keep (workers/remote_service.py, docs/tasks.md). A step retried after its answer was lost
must not step twice: the turn number is an idempotency key, as Stripe's `Idempotency-Key` or the AWS APIs'
`ClientToken` make a retried mutation safe. 401/403 are the job's credentials refused: a spec error (exit 78), as
for a model token the hub refuses."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from grpolora.api import contract
from grpolora.api.spec import EnvironmentSpec
from grpolora.workers.environments import BUILTIN_ENVIRONMENTS, Reply, check_environment, load_environment
from grpolora.workers.environments.runner import EnvironmentOutage
from grpolora.workers.environments.service import build_app
from grpolora.workers.models import resolve_model
from grpolora.workers.remote_service import AuthRefused
from grpolora.workers.trainer.main import exit_code
from grpolora.workers.trainer.rollout import Sampling
from tests.helpers import example
from tests.workers.rewardserver import AppServer
from tests.workers.test_episodes import PROMPT, ScriptedReplicas, _runner

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model("offline:smollm2-135m-instruct"))


class Recorded:
    """Every request the service got (path, JSON body), in order; and the service's episodes closed."""

    def __init__(self, app: FastAPI):
        self.requests: list[tuple[str, dict]] = []
        self.lock = threading.Lock()

        @app.middleware("http")
        async def record(request: Request, call_next):
            body = await request.json() if request.method == "POST" else {}
            with self.lock:
                self.requests.append((request.url.path, body))
            return await call_next(request)

    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]


@pytest.fixture(scope="module")
def calculator_service():
    app = build_app(BUILTIN_ENVIRONMENTS["calculator"])
    recorded = Recorded(app)
    server = AppServer(app).start()
    server.recorded = recorded
    yield server
    server.stop()


def remote(url: str, **settings):
    return load_environment(EnvironmentSpec.model_validate({"url": url, **settings}))


def wait_for(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_a_service_plays_the_calculator_as_the_builtin_does(tokenizer, calculator_service):
    script = {0: ["<calc>12*7</calc>", "Answer: 84"], 1: ["Answer: 80"]}
    sampling = Sampling(2, 1.0, 1.0, 32)
    here = _runner(tokenizer)
    [local] = here.run([PROMPT], [[1]], [0], sampling, ScriptedReplicas(tokenizer, script), replicas=[0], version=3)
    calculator_service.recorded.requests.clear()
    there = _runner(tokenizer, factory=remote(calculator_service.url))
    [served] = there.run([PROMPT], [[1]], [0], sampling, ScriptedReplicas(tokenizer, script), replicas=[0], version=3)
    for a, b in zip(local, served, strict=True):  # the same episodes, token for token
        assert (a.token_ids, a.episode.opening, a.episode.loss_mask) == (
            b.token_ids,
            b.episode.opening,
            b.episode.loss_mask,
        )
        assert (a.episode.messages, a.episode.turns, a.episode.tool_calls) == (
            b.episode.messages, b.episode.turns, b.episode.tool_calls,
        )  # fmt: skip
        assert b.episode.error is None
    # The wire: a reset per episode with the task's prompt, steps numbered from 1 under its id, and a close once
    # it is over (on a thread of its own: waited for).
    wait_for(lambda: calculator_service.recorded.paths().count("/close") == 2, "both episodes closed")
    requests = calculator_service.recorded.requests
    resets = [body for path, body in requests if path == "/reset"]
    assert [r["prompt"]["text"] for r in resets] == [PROMPT.text] * 2 and resets[0]["prompt"]["answer"] == "84"
    episodes = {r["episode"] for r in resets}
    steps = [(b["episode"], b["turn"]) for path, b in requests if path == "/step"]
    assert len(episodes) == 2 and {b["episode"] for p, b in requests if p == "/close"} == episodes
    assert {e for e, _ in steps} == episodes and sorted(turn for _, turn in steps) == [1, 1, 2]
    here.close()
    there.close()


class Counting:
    """An environment that counts its own steps in its answers: a step taken twice shows."""

    def __init__(self):
        self.steps = 0

    def reset(self, prompt):
        return [{"role": "user", "content": "Say anything, twice."}]

    def step(self, message):
        self.steps += 1
        if self.steps == 2:
            return Reply(done=True, reward=1.0)
        return Reply([{"role": "user", "content": f"step {self.steps}"}])


def test_a_step_whose_answer_was_lost_is_retried_and_taken_once(tokenizer):
    """The service takes each step, but the first answer to every /step request is lost (a 503 from a proxy in
    between, after the service did the work): the retry, same turn, gets the answer the service kept."""
    app = build_app(Counting)
    seen: Counter = Counter()

    @app.middleware("http")
    async def lose_first_answer(request: Request, call_next):
        response = await call_next(request)
        if request.url.path == "/step":
            seen["step"] += 1
            if seen["step"] % 2 == 1:
                return JSONResponse({"detail": "upstream reset"}, status_code=503)
        return response

    server = AppServer(app).start()
    try:
        runner = _runner(tokenizer, factory=remote(server.url, retries=1))
        replicas = ScriptedReplicas(tokenizer, {0: ["hello", "hello again"]})
        [[episode]] = runner.run([PROMPT], [[1]], [0], Sampling(1, 1.0, 1.0, 8), replicas, replicas=[0], version=3)
        assert episode.episode.error is None, episode.episode.error
        # Taken once each: the second turn read `step 1`, and the episode ended at the environment's second step.
        assert [m["content"] for m in episode.episode.messages if m["role"] == "user"][-1] == "step 1"
        assert (episode.episode.turns, episode.episode.reward, seen["step"]) == (2, 1.0, 4)
        runner.close()
    finally:
        server.stop()


def test_refused_credentials_fail_the_run_and_headers_come_from_the_secret(tokenizer, tmp_path, monkeypatch):
    app = build_app(BUILTIN_ENVIRONMENTS["calculator"], token=TOKEN)
    recorded = Recorded(app)
    server = AppServer(app).start()
    try:
        replicas = ScriptedReplicas(tokenizer, {0: ["Answer: 84"]})
        runner = _runner(tokenizer, factory=remote(server.url, retries=3))
        with pytest.raises(AuthRefused, match=r"^spec.environment.url: .*/reset refused the job's credentials: "
                           r"HTTP 401.*check headersFrom") as refused:  # fmt: skip
            runner.run([PROMPT], [[1]], [0], Sampling(1, 1.0, 1.0, 8), replicas, replicas=[0], version=3)
        assert recorded.paths().count("/reset") == 1  # asked once: not retried
        assert exit_code(refused.value) == contract.EXIT_INVALID_SPEC
        runner.close()
        # With the Secret mounted (for `grpolora run`: GRPOLORA_SECRETS_DIR), its keys are the headers.
        secret = tmp_path / "env-auth"
        secret.mkdir()
        (secret / "Authorization").write_text(f"Bearer {TOKEN}\n")
        monkeypatch.setenv("GRPOLORA_SECRETS_DIR", str(tmp_path))
        # The example job's environment, pointed at this service.
        settings = example("calculator-service.yaml")["spec"]["environment"] | {"url": server.url}
        assert settings["headersFrom"] == {"secretName": "env-auth"}
        runner = _runner(tokenizer, factory=load_environment(EnvironmentSpec.model_validate(settings)))
        [[played]] = runner.run([PROMPT], [[1]], [0], Sampling(1, 1.0, 1.0, 8), replicas, replicas=[0], version=3)
        assert played.episode.error is None and played.episode.turns == 1
        runner.close()
    finally:
        server.stop()


def test_validate_reports_an_unmounted_secret_as_not_checked_here(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPOLORA_SECRETS_DIR", str(tmp_path))
    spec = EnvironmentSpec.model_validate({"url": "http://env:8000", "headersFrom": {"secretName": "env-auth"}})
    problems, unreachable = check_environment(spec)
    assert problems == [] and [str(u) for u in unreachable] == [
        f"spec.environment.headersFrom: Secret 'env-auth' not found at {tmp_path / 'env-auth'} (set "
        "GRPOLORA_SECRETS_DIR when running locally: one folder per Secret, one file per key)"
    ]


def _bad_service(step_answer) -> AppServer:
    app = FastAPI()

    @app.post("/reset")
    async def reset():
        return {"messages": [{"role": "user", "content": "go"}]}

    @app.post("/step")
    async def step():
        return await step_answer()

    @app.post("/close")
    async def close():
        return {}

    return AppServer(app).start()


async def _garbage():
    return {"done": "yes"}


async def _hang():
    import asyncio

    await asyncio.sleep(30)  # cancelled when the server stops
    return {"done": True}


async def _not_found():
    return JSONResponse({"detail": "no such episode"}, status_code=404)


async def _unavailable():
    return JSONResponse({"detail": "overloaded"}, status_code=503)


@pytest.mark.parametrize(
    ("answer", "says", "infrastructure"),
    [
        (_garbage, "step().done: expected a bool, got 'yes'", False),
        (_hang, "step()", True),  # within stepTimeoutSeconds, retries included
        (_not_found, "step(): http://127.0.0.1:", True),  # the service lost the episode
        (_unavailable, "failed 2 time(s): HTTP 503", True),
    ],
    ids=["malformed", "hangs", "404", "503"],
)
def test_a_service_that_fails_a_step_within_the_step_timeout(tokenizer, answer, says, infrastructure):
    """A malformed answer is the environment's answer to the model's message: the episode ends with errorReward,
    scored. A service that hangs, lost the episode or is down is an infrastructure fault: with every episode of the
    step failing so and outageSeconds 0, the step fails at once, naming the environment and the error."""
    server = _bad_service(answer)
    try:
        runner = _runner(tokenizer, factory=remote(server.url, retries=1, stepTimeoutSeconds=1.0))
        replicas = ScriptedReplicas(tokenizer, {0: ["x"], 1: ["y"]})
        started = time.monotonic()
        if infrastructure:
            with pytest.raises(EnvironmentOutage) as caught:
                runner.run([PROMPT], [[1]], [0], Sampling(2, 1.0, 1.0, 8), replicas, replicas=[0], version=3)
            assert says in str(caught.value)
        else:
            groups = runner.run([PROMPT], [[1]], [0], Sampling(2, 1.0, 1.0, 8), replicas, replicas=[0], version=3)
            for episode in groups[0]:
                assert episode.episode.error is None and says in episode.episode.fault, episode.episode.fault
                assert episode.episode.reward == 0.0
        assert time.monotonic() - started < 4  # one stepTimeoutSeconds (1 s) for the turn: not the 30 s hang
        runner.close()
    finally:
        server.stop()


def test_an_unreachable_service_is_played_again_then_fails_the_step(tokenizer):
    from grpolora.testing.servers import free_port

    runner = _runner(tokenizer, factory=remote(f"http://127.0.0.1:{free_port()}", retries=0), episode_retries=1)
    replicas = ScriptedReplicas(tokenizer, {0: ["x"]})
    says = r"the last error: reset\(\): .*cannot reach it.*\(after 1 more plays\)"
    with pytest.raises(EnvironmentOutage, match=says):
        runner.run([PROMPT], [[7, 8]], [0], Sampling(1, 1.0, 1.0, 8), replicas, replicas=[0], version=3)
    runner.close()


def test_a_service_gets_the_models_tool_calls_and_answers_an_invalid_action_as_the_tools_error():
    """Native tool calls reach an environment service as they reach a plugin (the message's tool_calls were dropped
    by the service's message check), and an InvalidAction it raises is the tool's error, not a fault."""
    import sys
    from pathlib import Path

    from grpolora.workers.environments.base import InvalidAction

    sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
    try:
        import tool_calling_env
    finally:
        sys.path.pop(0)

    class Picky(tool_calling_env.ToolCallingEnvironment):
        def step(self, message):
            if message["content"] == "?":
                raise InvalidAction("call a tool or answer")
            return super().step(message)

    server = AppServer(build_app(Picky)).start()
    try:
        env = remote(server.url)()
        env.reset(PROMPT)
        call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        reply = env.step({"role": "assistant", "content": "", "tool_calls": [call]})
        assert reply.messages == [{"role": "tool", "content": "5.0", "tool_call_id": "call_1", "name": "add"}]
        reply = env.step({"role": "assistant", "content": "?"})
        assert reply.messages == [{"role": "tool", "content": "error: call a tool or answer"}] and not reply.done
    finally:
        server.stop()
