"""Episodes through the rollout producer and the real inference API (issue 39): the producer runs each prompt's
episodes turn by turn over HTTP, each episode on one replica, each turn's prompt the episode's ids so far (token
in, token out), and delivers groups of episodes that score into one batch.

The servers are the real create_app and version leasing around a stand-in engine (tests/workers/fakeengine.py),
which here answers as a model using the calculator would: a call first, the answer once the tool's result is in the
prompt, each turn ending at <|im_end|> with finish_reason `stop` (vLLM's for a sample that ended at its EOS).
With grpo.maxStaleness 1 the replicas are the real adapter book on MarkingEngine (real sync over gloo, real
activation and unloading), whose answers also tell whose adapter served each turn."""

from __future__ import annotations

import threading

import pytest

from grpolora.api.load import parse_job
from grpolora.workers.environments import BUILTIN_ENVIRONMENTS
from grpolora.workers.environments.calculator import CalculatorEnvironment
from grpolora.workers.environments.episode import ChatDelta
from grpolora.workers.environments.runner import EpisodeLimits, EpisodeRunner
from grpolora.workers.inference.vllm_engine import EngineLimits, Sample, config_for
from grpolora.workers.models import resolve_model
from grpolora.workers.sync.control import HttpMember
from grpolora.workers.tasks import Prompt
from grpolora.workers.tasks.arithmetic import ArithmeticTask
from grpolora.workers.trainer.buffer import RolloutBuffer
from grpolora.workers.trainer.producer import RolloutProducer
from grpolora.workers.trainer.rollout import RolloutClient
from grpolora.workers.trainer.scoring import Rollouts, episode_figures, score
from tests.helpers import job_doc
from tests.workers.fakeengine import TOKEN, FakeServer, MarkingBook, marked
from tests.workers.syncfakes import gloo_sender


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model("offline:smollm2-135m-instruct"))


def calculator_user(server: FakeServer, tokenizer) -> None:
    """Make `server`'s engine answer as a model that uses the calculator (its vocabulary the tokenizer's)."""
    engine = server.engine
    engine.limits = EngineLimits(max_model_len=2048, vocab_size=len(tokenizer))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(prompt_token_ids, request, version):
        engine.requests.append((prompt_token_ids, request))
        prompt = tokenizer.decode(prompt_token_ids)
        text = "Answer: 84" if "<result>84" in prompt else "<calc>12*7</calc>"
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [end]
        return [Sample(ids, [-0.25] * len(ids), text, "stop") for _ in range(request.n)]

    engine.generate = generate


PROMPT = Prompt("What is 12 * 7?", answer="84")


class LiveSender:
    """The producer's view of the sync group: the live version and the replicas serving it (AdapterSender.live)."""

    def __init__(self, version: int, replicas: list[int]):
        self.version, self.replicas = version, replicas

    def live(self):
        return self.version, list(self.replicas)

    def refresh(self) -> None:
        pass


def test_the_producer_runs_groups_of_episodes_on_the_replicas(tmp_path, tokenizer):
    spec = parse_job(
        job_doc(
            grpo={"promptsPerStep": 2, "generationsPerPrompt": 2, "maxNewTokens": 16},
            environment={"builtin": "calculator", "maxTurns": 3, "maxEpisodeTokens": 400},
        )
    ).spec
    env = spec.environment
    runner = EpisodeRunner(
        BUILTIN_ENVIRONMENTS["calculator"],
        ChatDelta(tokenizer),
        EpisodeLimits(env.max_turns, env.max_episode_tokens, spec.grpo.max_new_tokens, env.step_timeout_seconds),
    )
    with FakeServer(tmp_path / "a") as first, FakeServer(tmp_path / "b") as second:
        servers = [first, second]
        for server in servers:
            calculator_user(server, tokenizer)
            server.engine.set_live(1)
        rollouts = RolloutClient([s.url for s in servers], TOKEN, timeout_seconds=10)
        buffer = RolloutBuffer(staleness=0, next_position=0)
        producer = RolloutProducer(
            spec.grpo, iter([PROMPT] * 4), lambda p: [1, 2], None,
            sender=LiveSender(1, [0, 1]), rollouts=rollouts, buffer=buffer, episodes=runner,
        )  # fmt: skip
        buffer.allow(2)
        producer.start()
        groups, _ = buffer.take(2, version=1, then_allow=0)
        buffer.close()
        rollouts.close()
        runner.close()
    episodes = [c for g in groups for c in g.completions]
    assert len(episodes) == 4 and all(c.version == 1 for c in episodes)
    assert [(c.episode.turns, c.episode.tool_calls, c.episode.error) for c in episodes] == [(2, 1, None)] * 4
    # Two turns per episode, each on one replica: the second turn's prompt is the first's plus the ids generated
    # and the environment's turn, exactly as the episode holds them.
    requests = [r for s in servers for r in s.engine.requests]
    assert len(requests) == 8 and all(r.n == 1 for _, r in requests)
    for server in servers:
        firsts = [r.seed for ids, r in server.engine.requests if "<result>84" not in tokenizer.decode(ids)]
        seconds = [r.seed for ids, r in server.engine.requests if "<result>84" in tokenizer.decode(ids)]
        # An episode's turn t has seed base + t: each second turn went where its episode's first turn went.
        assert len(firsts) == len(seconds) == 2 and sorted(seconds) == sorted(seed + 1 for seed in firsts)
    for episode in episodes:
        assert episode.text == "Answer: 84"
        full = episode.episode.opening + episode.token_ids
        assert any(ids == full[: len(ids)] for s in servers for ids, _ in s.engine.requests if len(ids) > 40)
    # The groups score into one batch: rewards from the arithmetic task, masks from the episodes.
    rollouts_of_step = Rollouts.of(groups)
    scored = score(ArithmeticTask(), rollouts_of_step, spec.grpo, tokenizer.pad_token_id or 0)
    assert scored.rewards.flatten().tolist() == pytest.approx([1.1] * 4)
    assert int(scored.batch.completion_mask.sum()) == sum(sum(c.episode.loss_mask) for c in episodes)
    assert episode_figures(rollouts_of_step)["episode_turns_mean"] == 2.0


# ---- grpo.maxStaleness 1: the next version goes live while episodes are between turns ------------------------


def marking_calculator_user(book: MarkingBook, tokenizer, served: list[tuple[int, bool, int, int]]) -> None:
    """`book`'s engine answers as calculator_user's does, and records each turn it serves: (seed, whether it is
    the answer after the tool's result, the mark of the adapter that served it, the book's live version then)."""
    engine = book._engine
    book.limits = EngineLimits(max_model_len=2048, vocab_size=len(tokenizer))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(prompt_token_ids, request, lora):
        answered = "<result>84" in tokenizer.decode(prompt_token_ids)
        served.append((request.seed, answered, engine.marks[lora.lora_int_id], book.live_version))
        text = "Answer: 84" if answered else "<calc>12*7</calc>"
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [end]
        return [Sample(ids, [-0.25] * len(ids), text, "stop") for _ in range(request.n)]

    engine.generate = generate


class SyncAtFirstStep:
    """The trainer's next sync, landing while a round's episodes are between their turns (with k = 1 the trainer
    syncs while the producer generates): the first environment step sends the next adapter, once; the others
    (they run at once, each on a thread of its own) wait for it."""

    def __init__(self, sender, adapter):
        self.sender, self.adapter = sender, adapter
        self._lock = threading.Lock()
        self.sent: int | None = None  # the version it went live as

    def __call__(self) -> CalculatorEnvironment:
        hook = self

        class Calculator(CalculatorEnvironment):
            def step(self, message):
                with hook._lock:
                    if hook.sent is None:
                        hook.sent = hook.sender.send(hook.adapter, {}).version
                return super().step(message)

        return Calculator()


def test_with_staleness_1_an_episode_ends_on_the_version_it_started_on_while_the_next_is_live(tokenizer):
    """grpo.maxStaleness 1 (issue 39: bounded staleness with episodes): version 2 goes live on both replicas after
    the first turns of a round started on version 1. Each episode's second turn still runs under version 1, on the
    replica of its first (which keeps k + 1 versions), so the episode is one version's sample; the trainer, at
    version 2, takes those groups (one version behind, within k) instead of dropping them, and the next round's
    episodes run on version 2."""
    spec = parse_job(
        job_doc(
            grpo={"promptsPerStep": 2, "generationsPerPrompt": 2, "maxNewTokens": 16, "maxStaleness": 1},
            environment={"builtin": "calculator", "maxTurns": 3, "maxEpisodeTokens": 400},
        )
    ).spec
    books = [MarkingBook(), MarkingBook()]
    served: list[list[tuple[int, bool, int, int]]] = [[], []]
    with FakeServer(book=books[0]) as first, FakeServer(book=books[1]) as second:
        for book, record in zip(books, served, strict=True):
            book.config = config_for(spec, "fake")  # as the job's replicas: k + 1 versions kept
            marking_calculator_user(book, tokenizer, record)
        sender = gloo_sender(
            [HttpMember(i, s.url, TOKEN) for i, s in enumerate([first, second])], token=TOKEN, timeout_seconds=10
        )
        rollouts = RolloutClient([first.url, second.url], TOKEN, timeout_seconds=10)
        env = spec.environment
        sync = SyncAtFirstStep(sender, marked(22))
        runner = EpisodeRunner(
            sync,
            ChatDelta(tokenizer),
            EpisodeLimits(env.max_turns, env.max_episode_tokens, spec.grpo.max_new_tokens, env.step_timeout_seconds),
        )
        buffer = RolloutBuffer(staleness=spec.grpo.staleness, next_position=0)
        producer = RolloutProducer(
            spec.grpo, iter([PROMPT] * 4), lambda p: [1, 2], None,
            sender=sender, rollouts=rollouts, buffer=buffer, episodes=runner,
        )  # fmt: skip
        try:
            sender.form_group()
            assert sender.send(marked(11), {}).version == 1
            buffer.allow(2)
            producer.start()
            # The trainer, its weights at version 2 by now, takes the first step's groups; then the next round.
            started_on_1, dropped = buffer.take(2, version=2, then_allow=2)
            started_on_2, _ = buffer.take(2, version=2, then_allow=0)
        finally:
            buffer.close()
            rollouts.close()
            runner.close()
            sender.close()
    assert sync.sent == 2 and dropped == 0
    old = [c for g in started_on_1 for c in g.completions]
    new = [c for g in started_on_2 for c in g.completions]
    assert [(c.version, c.episode.turns, c.text) for c in old] == [(1, 2, "Answer: 84")] * 4
    assert [(c.version, c.episode.turns, c.text) for c in new] == [(2, 2, "Answer: 84")] * 4
    for record in served:  # each replica ran two episodes of each round
        first_round, second_round = record[:4], record[4:]
        # The first round's answers (second turns) were served while version 2 was live, yet by version 1's adapter
        # (mark 11; a replica that had let version 1 go would serve its live version 2 instead, and the episode
        # would mix two policies), each on the replica of its episode's call (seed base + 1 where it was base).
        # (In any order: each episode asks for its next turn when its own environment answered, issue 46.)
        assert sorted((answered, mark) for _, answered, mark, _ in first_round) == [(False, 11)] * 2 + [(True, 11)] * 2
        assert [live for _, answered, _, live in first_round if answered] == [2, 2]
        calls, answers = ([seed for seed, answered, _, _ in first_round if answered == a] for a in (False, True))
        assert sorted(answers) == sorted(seed + 1 for seed in calls)
        assert sorted((answered, mark) for _, answered, mark, _ in second_round) == [(False, 22)] * 2 + [(True, 22)] * 2
