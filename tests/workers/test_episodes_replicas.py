"""Episodes through the rollout producer and the real inference API (issue 39): the producer runs each prompt's
episodes turn by turn over HTTP, each episode on one replica, each turn's prompt the episode's ids so far (token
in, token out), and delivers groups of episodes that score into one batch.

The servers are the real create_app and version leasing around a stand-in engine (tests/workers/fakeengine.py),
which here answers as a model using the calculator would: a call first, the answer once the tool's result is in the
prompt, each turn ending at <|im_end|> with finish_reason `stop` (vLLM's for a sample that ended at its EOS)."""

from __future__ import annotations

import pytest

from grpolora.api.load import parse_job
from grpolora.workers.environments import BUILTIN_ENVIRONMENTS
from grpolora.workers.environments.episode import ChatDelta
from grpolora.workers.environments.runner import EpisodeLimits, EpisodeRunner
from grpolora.workers.inference.vllm_engine import EngineLimits, Sample
from grpolora.workers.models import resolve_model
from grpolora.workers.tasks import Prompt
from grpolora.workers.tasks.arithmetic import ArithmeticTask
from grpolora.workers.trainer.buffer import RolloutBuffer
from grpolora.workers.trainer.producer import RolloutProducer
from grpolora.workers.trainer.rollout import RolloutClient
from grpolora.workers.trainer.scoring import Rollouts, episode_figures, score
from tests.helpers import job_doc
from tests.workers.fakeengine import TOKEN, FakeServer


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
