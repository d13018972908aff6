"""Agents (spec.environment.agent, issue 48 item 2) played by the trainer's own EpisodeRunner, without vLLM: the
agents' code runs in real environment processes (processes.py) with the real `openai.AsyncOpenAI` client, against
chat sessions on the real inference app (create_app, sessions.py, the real adapter book and its leases) through the
trainer's real RolloutClient; only the engine is stood in for (fakeengine.MarkingBook, whose generate a test
replaces), rendering with SmolLM2's real tokenizer and chat template. Each fault path is walked through the runner's
own replay: a process killed mid-agent, an agent hung past its bound, a 5xx from the replica, the agent's own
exception, a call past the session's bounds."""

from __future__ import annotations

import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpolora.api.spec import EnvironmentSpec
from grpolora.workers.environments.agent import AgentCall, load_agent, session_sample
from grpolora.workers.environments.base import Opening
from grpolora.workers.environments.episode import ChatDelta
from grpolora.workers.environments.processes import CALL_THREADS, EnvironmentProcesses
from grpolora.workers.environments.runner import EnvironmentOutage, EpisodeLimits, EpisodeRunner
from grpolora.workers.inference.vllm_engine import EngineLimits, Sample
from grpolora.workers.models import resolve_model
from grpolora.workers.sync.control import HttpMember
from grpolora.workers.tasks import Prompt
from grpolora.workers.tasks.base import TaskError
from grpolora.workers.trainer.rollout import RolloutClient, Sampling
from tests.workers.fakeengine import TOKEN, FakeServer, MarkingBook, marked
from tests.workers.syncfakes import gloo_sender

AGENTS = '''
import asyncio, os, pathlib

def first_play(prompt):
    """True the first time a prompt's agent gets here (a mark on disk: the processes share no memory)."""
    mark = pathlib.Path(os.environ["AGENT_MARKS"]) / prompt.text
    if mark.exists():
        return False
    mark.write_text("played")
    return True

async def ask(client, messages):
    answer = await client.chat.completions.create(model="policy", messages=messages, max_tokens=64)
    return [*messages, answer.choices[0].message.model_dump(exclude_none=True)]

async def follow_up(prompt, client):
    chat = await ask(client, [{"role": "user", "content": prompt.text}])
    chat = await ask(client, [*chat, {"role": "user", "content": "Are you sure?"}])
    return 0.5

async def killed_once(prompt, client):
    await ask(client, [{"role": "user", "content": prompt.text}])
    if first_play(prompt):
        os.kill(os.getpid(), 9)  # the process dies mid-agent
    return await follow_up(prompt, client)

async def hangs_once(prompt, client):
    if first_play(prompt):
        await asyncio.sleep(3600)
    return await follow_up(prompt, client)

async def raises(prompt, client):
    await ask(client, [{"role": "user", "content": prompt.text}])
    raise ValueError("the agent's own bug")

async def past_its_bounds(prompt, client):
    chat = [{"role": "user", "content": prompt.text}]
    while True:  # the session refuses the call past maxTurns; the agent fails with the client's error
        chat = await ask(client, [*chat, {"role": "user", "content": "More."}] if len(chat) > 1 else chat)

async def rewrites(prompt, client):
    chat = await ask(client, [{"role": "user", "content": prompt.text}])
    await ask(client, [{"role": "user", "content": "Let me ask again: " + prompt.text}])
    return None

def not_async(prompt, client):
    return 1.0

import threading
TOGETHER = threading.Barrier(int(os.environ.get("AGENTS_TOGETHER", "1")))

async def together(prompt, client):
    TOGETHER.wait(timeout=20)  # blocks its own thread (its own event loop): every agent of the process at once
    return 1.0
'''


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model("offline:smollm2-135m-instruct"))


class Replica:
    """A job's own replica serving version 1 (mark 11), its engine answering "Answer: 7" and <|im_end|> (finish
    stop, logprob -0.25 each), or failing the next `failures` calls (a 500, as a dead engine answers)."""

    def __init__(self, served: FakeServer, tokenizer, sender):
        self.served, self.sender, self.failures, self.prompts = served, sender, 0, []
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.ids = tokenizer("Answer: 7", add_special_tokens=False)["input_ids"] + [end]

        async def generate(prompt_token_ids, request, lora):
            self.prompts.append((prompt_token_ids, request))
            if self.failures:
                self.failures -= 1
                raise RuntimeError("the engine failed")
            return [Sample(list(self.ids), [-0.25] * len(self.ids), "Answer: 7", "stop")]

        served.engine._engine.generate = generate


@pytest.fixture
def replica(tokenizer):
    book = MarkingBook()
    with FakeServer(book=book, version_wait_seconds=2) as served:
        book.limits = EngineLimits(max_model_len=2048, vocab_size=len(tokenizer))
        book._engine.get_tokenizer = lambda: tokenizer
        sender = gloo_sender([HttpMember(0, served.url, TOKEN)], token=TOKEN, timeout_seconds=10)
        try:
            sender.form_group()
            assert sender.send(marked(11), {}).version == 1
            yield Replica(served, tokenizer, sender)
        finally:
            sender.close()


@pytest.fixture
def agents(tmp_path, monkeypatch):
    (tmp_path / "agents_mod.py").write_text(textwrap.dedent(AGENTS))
    (tmp_path / "marks").mkdir()
    monkeypatch.setenv("AGENT_MARKS", str(tmp_path / "marks"))  # the environment processes inherit it
    return tmp_path


LIMITS = EpisodeLimits(max_turns=3, max_episode_tokens=400, max_new_tokens=16, step_timeout_seconds=10.0,
                       episode_retries=1, error_reward=-1.0)  # fmt: skip


def play(agents, replica, tokenizer, function: str, limits: EpisodeLimits = LIMITS, prompts=("7 * 1",), n=1):
    spec = EnvironmentSpec(agent=f"agents_mod:{function}", processes=1)
    processes = EnvironmentProcesses(spec, root=agents).start()
    runner = EpisodeRunner(processes, ChatDelta(tokenizer), limits, agent=True, name=spec.agent)
    client = RolloutClient([replica.served.url], TOKEN, timeout_seconds=10)
    sampling = Sampling(n=n, temperature=1.0, top_p=1.0, max_tokens=16)
    fallback = [[1, 2, 3] for _ in prompts]

    def no_generate(*_):
        raise AssertionError("an agent's episode never calls /v1/generate")

    try:
        return runner.run([Prompt(p, answer="7") for p in prompts], fallback, [100] * len(prompts), sampling,
                          no_generate, [0], version=1, sessions=client)  # fmt: skip
    finally:
        runner.close()
        client.close()


def test_a_session_becomes_one_sample_with_the_loss_on_generated_tokens_only(agents, replica, tokenizer):
    """Two assistant turns (a follow-up user message between them): the sample is the session's ids as the replica
    generated them, the loss mask 1 on the generated ids only, the behaviour logprobs vLLM's, the agent's reward
    the episode's, the version the session's; each call was seeded seed + call and sampled at the job's sampling."""
    ((completion,),) = play(agents, replica, tokenizer, "follow_up")
    episode = completion.episode
    delta = ChatDelta(tokenizer)
    opening = delta.opening(Opening([{"role": "user", "content": "7 * 1"}]))
    follow = delta.environment_turn(replica.ids, [{"role": "user", "content": "Are you sure?"}])
    assert episode.opening == opening
    assert completion.token_ids == [*replica.ids, *follow, *replica.ids]
    assert episode.loss_mask == [1] * len(replica.ids) + [0] * len(follow) + [1] * len(replica.ids)
    assert completion.logprobs == [-0.25] * len(replica.ids) + [0.0] * len(follow) + [-0.25] * len(replica.ids)
    assert (episode.reward, episode.turns, episode.segments, episode.error, episode.fault) == (0.5, 2, 1, None, None)
    assert completion.version == 1 and completion.text == "Answer: 7" and not episode.truncated
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "user", "assistant"]
    assert [(r.seed, r.temperature, r.max_tokens) for _, r in replica.prompts] == [(100, 1.0, 16), (101, 1.0, 16)]
    assert replica.prompts[1][0] == opening + completion.token_ids[: len(replica.ids) + len(follow)]


def test_a_process_killed_mid_agent_plays_the_episode_again_on_a_fresh_process(agents, replica, tokenizer):
    ((completion,),) = play(agents, replica, tokenizer, "killed_once")
    episode = completion.episode
    assert episode.error is None and episode.fault is None and episode.reward == 0.5 and episode.turns == 2
    # The killed play's call, then the whole play again on a fresh session (its call, then follow_up's two),
    # seeded as the first play was.
    assert [r.seed for _, r in replica.prompts] == [100, 100, 101, 102]


def test_an_agent_past_its_time_is_ended_and_played_again(agents, replica, tokenizer):
    """The whole run is bounded by maxTurns x stepTimeoutSeconds (here 2 x 1 s): its process is ended past it."""
    limits = EpisodeLimits(max_turns=2, max_episode_tokens=400, max_new_tokens=16, step_timeout_seconds=1.0,
                           episode_retries=1)  # fmt: skip
    ((completion,),) = play(agents, replica, tokenizer, "hangs_once", limits)
    assert completion.episode.error is None and completion.episode.reward == 0.5


def test_a_5xx_from_the_session_plays_the_episode_again_and_a_step_all_lost_so_waits_out_outage_seconds(
    agents, replica, tokenizer
):
    replica.failures = 1
    ((completion,),) = play(agents, replica, tokenizer, "follow_up")
    assert completion.episode.error is None and completion.episode.reward == 0.5  # the second play went through
    assert len(replica.prompts) == 3  # the failed call, then the whole play again
    replica.failures = 100  # every play of every episode fails: past outageSeconds (0 here) the run fails, naming it
    with pytest.raises(EnvironmentOutage) as outage:
        play(agents, replica, tokenizer, "follow_up", n=2)
    assert "HTTP 500" in str(outage.value) and "agents_mod:follow_up" in str(outage.value)


def test_what_the_agent_raises_is_its_own_fault_scored_with_error_reward(agents, replica, tokenizer):
    ((completion,),) = play(agents, replica, tokenizer, "raises")
    episode = completion.episode
    assert "ValueError: the agent's own bug" in episode.fault and episode.reward == -1.0 and episode.error is None
    assert episode.turns == 1 and sum(episode.loss_mask) == len(replica.ids)  # its call trains, scored -1
    assert len(replica.prompts) == 1  # not played again


def test_a_call_past_max_turns_is_refused_and_the_episode_truncated(agents, replica, tokenizer):
    ((completion,),) = play(agents, replica, tokenizer, "past_its_bounds")
    episode = completion.episode
    assert episode.truncated and completion.finish_reason == "length" and episode.fault is None
    assert episode.turns == LIMITS.max_turns == len(replica.prompts)  # the fourth call never reached the engine


def test_a_rewritten_history_trains_the_last_segment_and_counts_the_dropped_one(agents, replica, tokenizer):
    ((completion,),) = play(agents, replica, tokenizer, "rewrites")
    episode = completion.episode
    assert episode.segments == 2 and episode.turns == 1 and episode.reward is None  # the task's reward scores it
    assert episode.messages[0]["content"] == "Let me ask again: 7 * 1"


def test_an_agent_that_is_no_async_function_is_refused_naming_the_field(agents):
    with pytest.raises(TaskError) as refused:
        load_agent("agents_mod:not_async", agents)
    assert "spec.environment.agent" in str(refused.value) and "async def not_async(prompt, client)" in str(
        refused.value
    )


def test_an_environment_process_runs_more_agents_at_once_than_its_pool_of_call_threads(agents, monkeypatch):
    """An agent's play holds its call for the whole run, so a process's short-call pool (256 threads) must not queue
    it: its time runs from the send, and one queued past it ended the process and every agent in it. Here 257 agents
    of one process each wait for all the others (a barrier): they return together only if all run at once."""
    count = CALL_THREADS + 1
    monkeypatch.setenv("AGENTS_TOGETHER", str(count))  # the environment process inherits it
    processes = EnvironmentProcesses(EnvironmentSpec(agent="agents_mod:together", processes=1), root=agents).start()
    call = AgentCall(Prompt("7 * 1", answer="7"), "http://127.0.0.1:9/sessions/s/v1", TOKEN, 1, 30.0)
    try:
        players = [processes() for _ in range(count)]
        with ThreadPoolExecutor(max_workers=count) as drivers:
            assert list(drivers.map(lambda player: player.play(call, 30.0), players)) == [1.0] * count
    finally:
        processes.close()


def test_session_sample_of_a_session_without_calls_is_none():
    assert session_sample({"segments": [], "adapter_version": 1, "calls": [], "refused": None}) is None


def test_an_agent_with_the_reference_on_the_replicas_is_refused_at_validation():
    """The replicas score a reference only for /v1/generate, not a session's calls: refused, naming the field."""
    from grpolora.api.load import InvalidJob, parse_job
    from tests.helpers import job_doc

    with pytest.raises(InvalidJob) as refused:
        parse_job(job_doc(environment={"agent": "agents_mod:follow_up"},
                          grpo={"referenceFrom": "inference", "klCoef": 0.05, "temperature": 1.0}))  # fmt: skip
    assert "grpo.referenceFrom" in str(refused.value) and "agent" in str(refused.value)
    parse_job(job_doc(environment={"agent": "agents_mod:follow_up"}, grpo={"klCoef": 0.05}))  # the trainer's: fine


def test_when_no_replica_opens_a_session_the_round_is_lost_to_the_replicas_not_the_environment(tokenizer):
    """Every replica gone (nothing listens): ReplicasLost, which the producer answers by re-forming the sync group
    and playing the round again (producer.on_live_replicas), as for /v1/generate; not an environment outage, which
    would wait outageSeconds and then fail the run naming the environment."""
    from grpolora.workers.trainer.rollout import ReplicasLost
    from tests.workers.syncfakes import free_port

    runner = EpisodeRunner(lambda: object(), ChatDelta(tokenizer), LIMITS, agent=True, name="agents_mod:follow_up")
    client = RolloutClient([f"http://127.0.0.1:{free_port()}"], TOKEN, timeout_seconds=2)
    try:
        with pytest.raises(ReplicasLost) as lost:
            runner.run([Prompt("7 * 1", answer="7")], [[1, 2, 3]], [100], Sampling(n=2, temperature=1.0, top_p=1.0,
                       max_tokens=16), lambda *_: [], [0], version=1, sessions=client)  # fmt: skip
    finally:
        runner.close()
        client.close()
    assert "ConnectError" in str(lost.value)


def test_a_session_asked_for_a_version_the_replica_no_longer_keeps_is_pinned_to_its_live_one(replica):
    """As /v1/generate serves a request that asked for a version the replica moved past (RolloutClient.generate):
    the trainer opens the session on the live version, and the episode is accounted with the version it got."""
    sender = replica.sender
    assert [sender.send(marked(mark), {}).version for mark in (22, 33, 44)] == [2, 3, 4]
    client = RolloutClient([replica.served.url], TOKEN, timeout_seconds=10)
    bounds = {"max_calls": 1, "max_tokens": 64, "max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0}
    try:
        url, version = client.open_session(0, "behind", bounds | {"adapter_version": 1})
        assert (url, version) == (f"{replica.served.url}/sessions/behind/v1", 4)
        assert client.open_session(0, "live", bounds | {"adapter_version": 4})[1] == 4
        assert client.close_session(0, "behind")["adapter_version"] == 4
    finally:
        client.close()


def test_an_agent_whose_first_call_cannot_fit_is_unscorable_not_the_models_fault(agents, replica, tokenizer):
    """The agent's opening alone fills maxEpisodeTokens: the session refuses its first call, and nothing was generated
    to score. As an episode whose opening leaves no room: unscorable (error), never errorReward for the model; the
    round's other episode plays as usual."""
    limits = EpisodeLimits(max_turns=3, max_episode_tokens=80, max_new_tokens=4, step_timeout_seconds=10.0,
                           error_reward=-1.0)  # fmt: skip
    long = "Add these up: " + " + ".join(["7"] * 40)
    (short,), (refused,) = play(agents, replica, tokenizer, "follow_up", limits, prompts=("7 * 1", long))
    assert short.episode.error is None and short.episode.turns == 2
    episode = refused.episode
    assert "maxEpisodeTokens" in episode.error and episode.fault is None and episode.reward is None
    assert refused.token_ids == [] and len(replica.prompts) == 2  # the short episode's two calls alone
    assert episode.segments == 0  # an agent's all the same: its step reports agent_segments_dropped


def test_an_agents_step_reports_its_figures_even_when_every_session_was_lost():
    """agent_segments_dropped is in every agent step's record (0 where none dropped), lost episodes included, so a
    tracker's series has no holes."""
    from grpolora.workers.environments.episode import Episode
    from grpolora.workers.trainer.scoring import agent_figures

    lost = Episode(opening=[1], loss_mask=[], messages=[], turns=0, tool_calls=0, error="gone", segments=0)
    assert agent_figures([lost]) == {"agent_segments_dropped": 0}
    assert agent_figures([Episode(opening=[1], loss_mask=[], messages=[], turns=0, tool_calls=0)]) == {}
