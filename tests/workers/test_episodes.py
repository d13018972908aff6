"""Multi-turn episodes (issue 39), token in and token out: the sample is the ids vLLM generated plus the environment's
turns tokenised once each, the loss mask keeps the environment's tokens out of the loss, the KL, the entropy and the
mismatch; episodes run turn by turn on one replica each, and an environment's fault ends only its episode.

The replicas are played by `ScriptedReplicas`: it answers each turn as /v1/generate does (token ids, their
logprobs, the detokenised text, finish_reason `stop` at the end-of-turn token or `length` at max_tokens; the
version served), so the turn loop, the budgets and the faults are checked without an engine. The real engine's
logprobs over a multi-turn sample are checked in test_adapters_from_memory.py (episode_parity.py); whole runs of
episodes on real engines in test_episodes_run.py."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from grpolora.api.constants import MAX_EPISODE_TURNS
from grpolora.api.spec import EnvironmentSpec, GRPOSpec
from grpolora.workers.environments import BUILTIN_ENVIRONMENTS, Opening, Reply, load_environment
from grpolora.workers.environments.base import EnvironmentUnavailable, InvalidAction
from grpolora.workers.environments.episode import ChatDelta, Episode, EpisodeTokens
from grpolora.workers.environments.runner import EnvironmentOutage, EpisodeCompletion, EpisodeLimits, EpisodeRunner
from grpolora.workers.models import resolve_model
from grpolora.workers.tasks import Prompt, TaskError
from grpolora.workers.tasks.arithmetic import ArithmeticTask
from grpolora.workers.trainer.grpo import entropy_stats, grpo_loss, logprob_mismatch
from grpolora.workers.trainer.policy import build_batch
from grpolora.workers.trainer.rollout import Completion, Sampling
from grpolora.workers.trainer.scoring import (
    Rollouts,
    episode_figures,
    rewards_of,
    sample_rows,
    score,
    with_loss_masks,
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model("offline:smollm2-135m-instruct"))


# ---- the loss mask -------------------------------------------------------------------------------------------------

OPENING = [1, 2, 3]
FIRST, ENV, SECOND = [10, 11], [20, 21, 22], [12, 13]


def _episode_batch(env_ids: list[int], env_logprobs: list[float]):
    tokens = EpisodeTokens(list(OPENING))
    tokens.add_assistant(FIRST, [-0.5, -0.7], None)
    tokens.add_environment(env_ids)
    tokens.logprobs[len(FIRST) : len(FIRST) + len(env_ids)] = env_logprobs  # what a sampler might say of them
    tokens.add_assistant(SECOND, [-0.2, -0.9], None)
    batch = build_batch([(tokens.opening, tokens.tokens, tokens.logprobs)], [1.5], pad_id=0)
    return with_loss_masks(batch, [len(OPENING)], [tokens.mask])


def test_the_mask_is_one_on_assistant_tokens_only():
    batch = _episode_batch(ENV, [0.0] * 3)
    # Position t predicts token t + 1: the opening's last position predicts the first assistant token.
    assert batch.completion_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 1]


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_changing_only_environment_tokens_leaves_loss_and_gradient_unchanged(kl_coef):
    """The issue's check: a hand-built episode whose environment tokens (and so the trainer's and the sampler's
    logprobs of them, and the reference's) differ gives the same loss, the same gradient, the same mismatch and
    entropy figures; changing an assistant token's logprob does change them (the check can fail)."""
    torch.manual_seed(0)
    base_logp = torch.randn(1, 9) - 2

    def run(batch, logp_values, ref_shift):
        logp = logp_values.clone().requires_grad_(True)
        ref = logp_values.detach() - 0.3 + ref_shift
        loss, _ = grpo_loss(
            logp, logp.detach() - 0.05, ref, batch.advantages, batch.completion_mask,
            clip_epsilon=0.2, kl_coef=kl_coef, normalizer=float(batch.completion_mask.sum()),
            behaviour_logp=batch.behaviour_logprobs, weight_cap=2.0,
        )  # fmt: skip
        loss.backward()
        mismatch = logprob_mismatch(logp.detach(), batch.behaviour_logprobs, batch.completion_mask)
        spread = entropy_stats(logp.detach().abs(), batch.completion_mask)
        return float(loss.detach()), logp.grad, mismatch, spread

    env_positions = torch.tensor([0, 0, 0, 0, 1, 1, 1, 0, 0], dtype=torch.bool)
    one = run(_episode_batch(ENV, [-1.0, -2.0, -3.0]), base_logp, 0.0)
    other_logp = torch.where(env_positions, torch.randn(1, 9) * 5, base_logp)
    other = run(_episode_batch([40, 41, 42], [-9.0, -0.1, -4.0]), other_logp, env_positions * 7.0)
    assert one[0] == other[0]
    assert torch.equal(one[1], other[1]) and not one[1][0, env_positions].any()
    assert one[2] == other[2] and one[3] == other[3]
    assistant_changed = run(_episode_batch(ENV, [-1.0, -2.0, -3.0]), base_logp + torch.eye(9)[2] * 0.5, 0.0)
    assert assistant_changed[0] != one[0]


def test_single_completions_keep_their_mask():
    batch = build_batch([([1, 2], [5, 6, 7], [-1.0, -1.0, -1.0])], [1.0], pad_id=0)
    assert with_loss_masks(batch, [2], [None]) is batch


# ---- token in, token out -------------------------------------------------------------------------------------------


def test_environment_turns_are_template_deltas_and_the_sample_decodes_to_the_transcript(tokenizer):
    delta = ChatDelta(tokenizer)
    opening = Opening([{"role": "system", "content": "S"}, {"role": "user", "content": "What is 12 * 7?"}])
    tokens = EpisodeTokens(delta.opening(opening))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    first = tokenizer("<calc>12*7</calc>", add_special_tokens=False)["input_ids"] + [end]  # stopped at <|im_end|>
    tokens.add_assistant(first, [-0.1] * len(first), None)
    reply = [{"role": "tool", "content": "<result>84</result>"}]
    tokens.add_environment(delta.environment_turn(first, reply))
    second = tokenizer("Answer: 84", add_special_tokens=False)["input_ids"] + [end]
    tokens.add_assistant(second, [-0.1] * len(second), None)
    transcript = [
        *opening.messages,
        {"role": "assistant", "content": "<calc>12*7</calc>"},
        *reply,
        {"role": "assistant", "content": "Answer: 84"},
    ]
    rendered = tokenizer.apply_chat_template(transcript, tokenize=False)
    assert tokenizer.decode(tokens.ids) == rendered.removesuffix("\n")  # the model did not write the last newline
    assert tokens.mask == [1] * len(first) + [0] * (len(tokens.tokens) - len(first) - len(second)) + [1] * len(second)


def test_a_turn_cut_by_a_stop_string_gets_its_whole_closing(tokenizer):
    delta = ChatDelta(tokenizer)
    generated = tokenizer("<calc>1+1</calc>", add_special_tokens=False)["input_ids"]  # no <|im_end|>
    ids = delta.environment_turn(generated, [{"role": "tool", "content": "2"}])
    assert tokenizer.decode(ids) == "<|im_end|>\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n"


def test_the_sample_keeps_generated_ids_that_re_tokenising_would_change(tokenizer):
    """Token in, token out: vLLM may sample a split that the tokenizer would merge ("Answer" as "An" "swer"); the sample
    trains on those ids, with their logprobs, where re-tokenising the transcript gives other ids."""
    delta = ChatDelta(tokenizer)
    opening = Opening([{"role": "user", "content": "12 * 7?"}])
    tokens = EpisodeTokens(delta.opening(opening))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    split = [tokenizer.convert_tokens_to_ids(t) for t in ("An", "swer", ":", "Ġ", "8", "4")] + [end]
    assert tokenizer.decode(split[:-1]) == "Answer: 84"
    tokens.add_assistant(split, [-0.25] * len(split), None)
    retokenised = tokenizer(tokenizer.decode(tokens.ids), add_special_tokens=False)["input_ids"]
    assert retokenised != tokens.ids  # the merge changes the ids ...
    assert tokens.tokens == split and tokens.logprobs == [-0.25] * len(split)  # ... the sample keeps vLLM's


# ---- episodes on the replicas --------------------------------------------------------------------------------------


class ScriptedReplicas:
    """Plays the replicas' /v1/generate for episodes: each call answers each prompt (n = 1) with the next scripted
    text of its episode, tokenised, ending at <|im_end|> with finish_reason `stop` unless max_tokens cuts it
    (`length`, as vLLM reports a sample that hit max_tokens). Records every call."""

    def __init__(self, tokenizer, script: dict[int, list[str]], version: int = 3):
        self.tokenizer, self.script, self.version = tokenizer, script, version
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.calls: list[tuple[int, int, list[int]]] = []  # (replica, max_tokens, seeds)
        self.lock = threading.Lock()

    def __call__(self, replica, prompts, sampling, seeds):
        assert sampling.n == 1
        with self.lock:
            self.calls.append((replica, sampling.max_tokens, list(seeds)))
        out = []
        for _ids, seed in zip(prompts, seeds, strict=True):
            episode = seed // 1024 % 1000  # the tests' seeds name the episode (seed base 1024 * episode)
            turn = seed % 1024
            text = self.script[episode][turn]
            generated = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.end]
            finish = "stop"
            if len(generated) > sampling.max_tokens:
                generated, finish = generated[: sampling.max_tokens], "length"
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
            reference = [-0.75] * len(generated) if sampling.reference_logprobs else None
            out.append(Completion(generated, [-0.5] * len(generated), text, finish, self.version + replica, reference))
        return out


def _runner(tokenizer, factory=None, **limits) -> EpisodeRunner:
    settings = {"max_turns": 4, "max_episode_tokens": 512, "max_new_tokens": 32, "step_timeout_seconds": 5.0}
    return EpisodeRunner(
        factory or BUILTIN_ENVIRONMENTS["calculator"], ChatDelta(tokenizer), EpisodeLimits(**{**settings, **limits})
    )


PROMPT = Prompt("What is 12 * 7?", answer="84")


def test_a_calculator_episode_on_one_replica(tokenizer):
    replicas = ScriptedReplicas(tokenizer, {0: ["<calc>12*7</calc>", "Answer: 84"], 1: ["Answer: 80"]})
    runner = _runner(tokenizer)
    groups = runner.run([PROMPT], [[1]], [0], Sampling(2, 1.0, 1.0, 32), replicas, replicas=[0, 1], version=3)
    [[used, one_turn]] = groups
    assert isinstance(used, EpisodeCompletion)
    assert (used.episode.turns, used.episode.tool_calls, used.episode.truncated) == (2, 1, False)
    # The opening (the calculator's worked example included), then the episode's own turns.
    assert [m["role"] for m in used.episode.messages[-4:]] == ["user", "assistant", "tool", "assistant"]
    assert used.episode.messages[-2]["content"] == "<result>84</result>"
    assert used.text == "Answer: 84" and used.finish_reason == "stop"
    assert (one_turn.episode.turns, one_turn.episode.tool_calls) == (1, 0)
    # Each episode stays on its replica; the version recorded is the one that served it.
    assert {r for r, _, seeds in replicas.calls if 0 in seeds or 1 in seeds} == {0}
    assert (used.version, one_turn.version) == (3, 4)
    # Assistant ids trained (with their logprobs), the environment's not; the ids decode to the transcript.
    mask = used.episode.loss_mask
    assert sum(mask) == sum(1 for lp in used.logprobs if lp == -0.5) and 0 in mask
    assert tokenizer.decode(used.episode.opening + used.token_ids).endswith(
        "<|im_start|>tool\n<result>84</result><|im_end|>\n<|im_start|>assistant\nAnswer: 84<|im_end|>"
    )
    runner.close()


def test_limits_truncate_episodes(tokenizer):
    looping = {0: ["<calc>1+1</calc>"] * 4}
    runner = _runner(tokenizer, max_turns=2)
    [[done]] = runner.run(
        [PROMPT], [[1]], [0], Sampling(1, 1.0, 1.0, 32), ScriptedReplicas(tokenizer, looping), replicas=[0], version=3
    )
    assert (done.episode.turns, done.episode.truncated, done.finish_reason) == (2, True, "length")
    # The environment's answer to the last turn is in the transcript, not in the sample: no turn trains after it.
    assert done.episode.loss_mask[-1] == 1 and done.episode.messages[-1]["role"] == "tool"
    # maxEpisodeTokens: the budget left bounds a turn's max_tokens, and a turn that reaches it ends the episode.
    replicas = ScriptedReplicas(tokenizer, looping)
    opening_length = len(ChatDelta(tokenizer).opening(BUILTIN_ENVIRONMENTS["calculator"]().reset(PROMPT)))
    runner = _runner(tokenizer, max_episode_tokens=opening_length + 12, max_new_tokens=32)
    [[cut]] = runner.run([PROMPT], [[1]], [0], Sampling(1, 1.0, 1.0, 32), replicas, replicas=[0], version=3)
    assert replicas.calls[0][1] == 12 and cut.episode.truncated and cut.finish_reason == "length"
    assert len(cut.episode.opening) + len(cut.token_ids) <= opening_length + 12


class Faulty:
    """An environment that fails in the way it is told to at its first step."""

    def __init__(self, how: str):
        if how == "make":
            raise ValueError("cannot make")
        self.how = how

    def reset(self, prompt):
        if self.how == "reset":
            raise RuntimeError("no sandbox")
        return [{"role": "user", "content": prompt.text}]

    def step(self, message):
        if self.how == "raise":
            raise KeyError("state")
        if self.how == "hang":
            time.sleep(3)  # beyond the test's stepTimeoutSeconds (0.2 s); the runner does not wait for it
        if self.how == "malformed":
            return {"messages": []}
        if self.how == "gone":
            raise EnvironmentUnavailable("the environment's process died")
        return Reply(done=True, reward=0.75)


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("raise", "the environment raised KeyError"),
        ("malformed", "step(): expected a Reply or (messages, done, reward), got dict"),
    ],
)
def test_an_environment_that_fails_at_the_models_message_scores_the_episode_with_the_error_reward(tokenizer, how, says):
    """Issue 46: an episode whose environment raised at the model's message was unscorable (advantage 0), a refuge
    from the negative advantage of a wrong answer. It now ends there with spec.environment.errorReward and is
    scored; the fault is recorded beside it."""
    hows = iter([how, "ok"])
    runner = _runner(tokenizer, factory=lambda: Faulty(next(hows)), step_timeout_seconds=2.0, error_reward=-0.5)
    replicas = ScriptedReplicas(tokenizer, {0: ["x"], 1: ["y"]})
    [[failed, fine]] = runner.run([PROMPT], [[7, 8]], [0], Sampling(2, 1.0, 1.0, 8), replicas, replicas=[0], version=3)
    assert says in failed.episode.fault and failed.episode.error is None and failed.episode.reward == -0.5
    assert fine.episode.fault is None and fine.episode.reward == 0.75
    rollouts = Rollouts([PROMPT], [[1]], [[failed, fine]], 0.0)
    rewards, _ = rewards_of(ArithmeticTask(), rollouts)
    assert rewards[0].tolist() == [-0.5, 0.75]  # both in the group's baseline
    assert episode_figures(rollouts)["environment_errors"] == 0
    runner.close()


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("hang", "step() took longer than stepTimeoutSeconds (0.2 s)"),
        ("reset", "the environment raised RuntimeError: no sandbox"),
        ("make", "the environment raised ValueError: cannot make"),
        ("gone", "the environment's process died"),
    ],
)
def test_an_infrastructure_fault_plays_the_episode_again_on_a_fresh_environment(tokenizer, how, says):
    """A fault that is not the model's (the environment could not be made or reset, a step past stepTimeoutSeconds,
    the environment gone) begins the episode again on a fresh environment, episodeRetries times at most; past
    them the episode is unscorable (NaN: out of its group's baseline), never held against the model."""
    replicas = ScriptedReplicas(tokenizer, {0: ["x"], 1: ["y"]})
    hows = iter([how, "ok", "ok"])
    runner = _runner(tokenizer, factory=lambda: Faulty(next(hows)), step_timeout_seconds=0.2, episode_retries=1)
    [[again, fine]] = runner.run([PROMPT], [[7, 8]], [0], Sampling(2, 1.0, 1.0, 8), replicas, replicas=[0], version=3)
    assert (again.episode.error, again.episode.reward, again.episode.turns) == (None, 0.75, 1)
    assert fine.episode.reward == 0.75
    runner.close()
    # Past episodeRetries (0 here): an error, unscorable.
    hows = iter([how, "ok"])
    runner = _runner(tokenizer, factory=lambda: Faulty(next(hows)), step_timeout_seconds=0.2)
    [[failed, fine]] = runner.run([PROMPT], [[7, 8]], [0], Sampling(2, 1.0, 1.0, 8), replicas, replicas=[0], version=3)
    assert says in failed.episode.error
    if how in ("reset", "make"):  # never opened: the task's prompt ids stand in, nothing generated
        assert (failed.episode.opening, failed.token_ids, failed.episode.turns) == ([7, 8], [], 0)
    # Nothing of it trains: it counts as of the version the round asked for, not as stale (its group would be
    # dropped as older than any trainer version).
    assert failed.version == 3 or how in ("hang", "gone")
    rollouts = Rollouts([PROMPT], [[1]], [[failed, fine]], 0.0)
    rewards, _ = rewards_of(ArithmeticTask(), rollouts)
    assert torch.isnan(rewards[0, 0]) and rewards[0, 1] == 0.75
    assert episode_figures(rollouts)["environment_errors"] == 1
    runner.close()


def test_an_invalid_action_is_answered_as_the_tools_error_and_the_episode_goes_on(tokenizer):
    class Strict:
        def reset(self, prompt):
            return [{"role": "user", "content": prompt.text}]

        def step(self, message):
            if message["content"] == "x":
                raise InvalidAction("say a number")
            return Reply(done=True, reward=1.0)

    runner = _runner(tokenizer, factory=Strict)
    replicas = ScriptedReplicas(tokenizer, {0: ["x", "5"]})
    [[done]] = runner.run([PROMPT], [[7]], [0], Sampling(1, 1.0, 1.0, 8), replicas, replicas=[0], version=3)
    assert done.episode.messages[-2] == {"role": "tool", "content": "error: say a number"}
    assert (done.episode.turns, done.episode.tool_errors, done.episode.reward, done.episode.fault) == (2, 1, 1.0, None)
    runner.close()


@pytest.mark.parametrize("lockstep", [False, True])
def test_each_episode_moves_to_its_next_turn_when_its_own_environment_answers(tokenizer, lockstep):
    """Issue 46 item 4: turns ran in lockstep (every episode's turn t, then every step, then turn t + 1), so one slow
    environment held every episode back a whole step per turn. Now an episode asks for its next turn as soon as its
    own environment has answered; lockstep (the benchmark's baseline) still holds them back."""
    made = itertools.count()

    class Paced:
        def __init__(self):
            self.slow = next(made) == 0

        def reset(self, prompt):
            return [{"role": "user", "content": prompt.text}]

        def step(self, message):
            if self.slow:
                time.sleep(0.5)
            return Reply([{"role": "user", "content": "go on"}])

    replicas = ScriptedReplicas(tokenizer, {0: ["a"] * 3, 1: ["b"] * 3})
    asked: list[tuple[int, int, float]] = []  # (episode, turn, when)

    def generate(replica, prompts, sampling, seeds):
        asked.extend((seed // MAX_EPISODE_TURNS, seed % MAX_EPISODE_TURNS, time.monotonic()) for seed in seeds)
        return replicas(replica, prompts, sampling, seeds)

    runner = EpisodeRunner(Paced, ChatDelta(tokenizer), EpisodeLimits(3, 512, 8, 5.0), lockstep=lockstep)
    [[slow, fast]] = runner.run([PROMPT], [[7]], [0], Sampling(2, 1.0, 1.0, 8), generate, replicas=[0], version=3)
    assert slow.episode.turns == fast.episode.turns == 3 and slow.episode.truncated and fast.episode.truncated
    when = {(episode, turn): at for episode, turn, at in asked}
    # The fast episode's last turn is asked for before the slow one's second (after its 0.5 s step) -- or, in
    # lockstep, only after it.
    assert (when[(1, 2)] < when[(0, 1)]) != lockstep
    runner.close()


def test_per_turn_rewards_make_the_episodes_return_with_its_discount(tokenizer):
    """Issue 46 item 6: an environment may reward every step, not only the last (its reward was read only with
    `done`); the episode's return, discounted by turn, is its reward, and the per-turn rewards are logged."""

    class Shaping:
        def reset(self, prompt):
            self.turn = 0
            return [{"role": "user", "content": prompt.text}]

        def step(self, message):
            self.turn += 1
            if message["content"] == "boom":
                raise KeyError("state")
            if self.turn == 3:
                return Reply(done=True, reward=1.0)
            reward = 0.5 if self.turn == 1 else None  # turn 2 gives none: it counts 0
            return Reply([{"role": "user", "content": "go on"}], reward=reward)

    runner = _runner(tokenizer, factory=Shaping, discount=0.5, error_reward=-1.0)
    replicas = ScriptedReplicas(tokenizer, {0: ["a", "b", "c"], 1: ["a", "boom"]})
    [[played, faulted]] = runner.run([PROMPT], [[7]], [0], Sampling(2, 1.0, 1.0, 8), replicas, replicas=[0], version=3)
    assert played.episode.turn_rewards == [0.5, None, 1.0]
    assert played.episode.reward == 0.5 + 0.25 * 1.0  # 0.5^0 * 0.5 + 0.5^1 * 0 + 0.5^2 * 1.0
    assert faulted.episode.turn_rewards == [0.5, -1.0] and faulted.episode.reward == 0.5 + 0.5 * -1.0
    rollouts = Rollouts([PROMPT], [[1]], [[played, faulted]], 0.0)
    rewards, _ = rewards_of(ArithmeticTask(), rollouts)
    assert rewards[0].tolist() == [0.75, 0.0]
    figures = episode_figures(rollouts)
    assert figures["episode_turn_rewards"] == 4 and figures["episode_turn_reward_mean"] == (0.5 + 1.0 + 0.5 - 1.0) / 4
    runner.close()


def test_an_outage_of_the_environment_waits_within_outage_seconds_then_fails_naming_it(tokenizer):
    """Issue 46: when every episode of a step failed on the environment (a service restarting), the run failed at
    once (exit 65). The step is now played again with growing pauses within outageSeconds: an environment that
    refuses every call for its first seconds does not end the run; one that stays down fails it, naming the
    environment and its last error."""
    down_until = time.monotonic() + 1.5

    class Restarting:
        def reset(self, prompt):
            if time.monotonic() < down_until:
                raise EnvironmentUnavailable("reset(): connection refused")
            return [{"role": "user", "content": prompt.text}]

        def step(self, message):
            return Reply(done=True, reward=1.0)

    replicas = ScriptedReplicas(tokenizer, {0: ["x"], 1: ["y"]})
    runner = _runner(tokenizer, factory=Restarting, outage_seconds=30.0)
    [[one, two]] = runner.run([PROMPT], [[7]], [0], Sampling(2, 1.0, 1.0, 8), replicas, replicas=[0], version=3)
    assert time.monotonic() >= down_until and (one.episode.reward, two.episode.reward) == (1.0, 1.0)
    down_until = time.monotonic() + 3600
    runner = _runner(tokenizer, factory=Restarting, outage_seconds=1.0)
    runner.name = "my_envs:make"
    with pytest.raises(EnvironmentOutage, match=r"^spec.environment \(my_envs:make\): every episode of the step "
                       r"failed on the environment for \d+ s, past outageSeconds \(1\); the last error: reset\(\): "
                       r"connection refused"):  # fmt: skip
        runner.run([PROMPT], [[7]], [0], Sampling(2, 1.0, 1.0, 8), replicas, replicas=[0], version=3)


def _episode(error=None, reward=None, turns=2, tools=1, truncated=False) -> EpisodeCompletion:
    return EpisodeCompletion(
        [5, 6, 7, 8], [-0.5, 0.0, 0.0, -0.5], "Answer: 84", "length" if truncated else "stop", 1,
        episode=Episode([1, 2, 3], [1, 0, 0, 1], [{"role": "user", "content": "q"}], turns, tools, error, reward,
                        truncated, 0.5),
    )  # fmt: skip


def test_every_episode_failing_fails_the_step():
    rollouts = Rollouts([PROMPT], [[1]], [[_episode(error="boom"), _episode(error="boom")]], 0.0)
    with pytest.raises(TaskError, match=r"spec.environment: every episode of the step ended with an environment error"):
        score(ArithmeticTask(), rollouts, GRPOSpec(generations_per_prompt=2), pad_token_id=0)


def test_the_overlong_penalty_of_an_episode_measures_it_against_max_episode_tokens():
    """Issue 46: overlongBuffer compared an episode's assistant tokens summed over its turns with one turn's
    maxNewTokens, so a 3-turn episode of 20 tokens a turn (60) at maxNewTokens 48, overlongBuffer 16 got the full -1.
    An episode's whole length (opening, turns, the environment's answers) meets maxEpisodeTokens."""

    def episode(turn_tokens: int, environment_tokens: int) -> EpisodeCompletion:
        mask = ([1] * turn_tokens + [0] * environment_tokens) * 2 + [1] * turn_tokens
        return EpisodeCompletion([5] * len(mask), [-0.5] * len(mask), "Answer: 84", "stop", 1,
                                 episode=Episode([1] * 30, mask, [], 3, 2))  # fmt: skip

    grpo = GRPOSpec(generations_per_prompt=2, max_new_tokens=48, overlong_buffer=16)
    short, long = episode(20, 10), episode(100, 40)  # 30 + 80 = 110 tokens; 30 + 380 = 410
    scored = score(ArithmeticTask(), Rollouts([PROMPT], [[1]], [[short, long]], 0.0), grpo, 0, episode_tokens=400)
    assert scored.penalty[0].tolist() == [0.0, -1.0]
    near = episode(100, 34)  # 30 + 368 = 398: 14 tokens into the last 16 before 400
    scored = score(ArithmeticTask(), Rollouts([PROMPT], [[1]], [[short, near]], 0.0), grpo, 0, episode_tokens=400)
    assert scored.penalty[0].tolist() == [0.0, pytest.approx(-14 / 16)]


def test_episodes_score_train_on_their_masks_and_report_their_figures():
    rollouts = Rollouts([PROMPT], [[1]], [[_episode(), _episode(turns=3, tools=2, truncated=True)]], 0.0)
    scored = score(ArithmeticTask(), rollouts, GRPOSpec(generations_per_prompt=2, mask_truncated=True), 0)
    # The opening is the prompt; the mask follows the episode's; a truncated episode leaves the loss (maskTruncated).
    assert scored.batch.input_ids[0].tolist() == [1, 2, 3, 5, 6, 7, 8]
    assert scored.batch.completion_mask.tolist() == [[0, 0, 1, 0, 0, 1], [0, 0, 0, 0, 0, 0]]
    assert scored.truncated == 1
    assert episode_figures(rollouts) == {
        "episode_turns_mean": 2.5,
        "episode_turns_max": 3,
        "episode_tool_calls": 3,
        "episode_tokens_mean": 7.0,
        "episodes_truncated": 1,
        "environment_errors": 0,
        "environment_faults": 0,
        "episode_tool_errors": 0,
        "environment_seconds": 1.0,
    }
    row = sample_rows(rollouts, scored, 1)[0]
    assert row["messages"] == [{"role": "user", "content": "q"}] and row["turns"] == 2
    assert episode_figures(Rollouts([PROMPT], [[1]], [[Completion([5], [-1.0], "x", "stop", 1)]], 0.0)) == {}


def test_a_plugin_environment_plays_through_the_runner(tokenizer, tmp_path):
    (tmp_path / "number_game.py").write_text(
        "from grpolora.workers.environments import Reply\n"
        "class Game:\n"
        "    def reset(self, prompt):\n"
        "        return [{'role': 'user', 'content': 'Guess my number (1-10).'}]\n"
        "    def step(self, message):\n"
        "        guess = message['content'].strip()\n"
        "        if guess == '7':\n"
        "            return Reply(done=True, reward=1.0)\n"
        "        return Reply([{'role': 'user', 'content': 'higher' if guess < '7' else 'lower'}])\n"
    )
    factory = load_environment(EnvironmentSpec(plugin="number_game:Game"), root=tmp_path)
    runner = _runner(tokenizer, factory=factory)
    replicas = ScriptedReplicas(tokenizer, {0: ["3", "9", "7"]})
    [[won]] = runner.run([PROMPT], [[1]], [0], Sampling(1, 1.0, 1.0, 8), replicas, replicas=[0], version=3)
    assert (won.episode.turns, won.episode.reward, won.episode.tool_calls) == (3, 1.0, 0)
    assert [m["content"] for m in won.episode.messages if m["role"] == "user"][1:] == ["higher", "lower"]


def test_reference_logprobs_from_the_replicas_cover_the_whole_episode(tokenizer):
    """grpo.referenceFrom: inference: each turn's request asks for the base model's logprobs of what it generated,
    given the whole episode so far; the sample carries them at the assistant's tokens (0 at the environment's,
    which the mask leaves out of the KL)."""
    replicas = ScriptedReplicas(tokenizer, {0: ["<calc>12*7</calc>", "Answer: 84"], 1: ["Answer: 84"]})
    sampling = Sampling(2, 1.0, 1.0, 32, reference_logprobs=True)
    [[two_turns, one_turn]] = _runner(tokenizer).run([PROMPT], [[1]], [0], sampling, replicas, replicas=[0], version=3)
    mask = two_turns.episode.loss_mask
    assert two_turns.reference_logprobs == [-0.75 if m else 0.0 for m in mask] and 0 in mask
    grpo = GRPOSpec(generations_per_prompt=2, reference_from="inference")
    scored = score(ArithmeticTask(), Rollouts([PROMPT], [[1]], [[two_turns, one_turn]], 0.0), grpo, 0)
    kept = scored.batch.completion_mask.bool()
    assert scored.batch.reference_logprobs is not None
    assert set(scored.batch.reference_logprobs[kept].tolist()) == {-0.75}


def test_the_episode_budget_is_also_bounded_by_the_model_length():
    env = EnvironmentSpec(builtin="calculator", max_episode_tokens=4096, max_turns=5)
    assert EpisodeLimits.of(env, 64, model_length=2048, margin=1) == EpisodeLimits(5, 2048, 64, 30.0, 1, 2, 0.0, 300.0)
    assert EpisodeLimits.of(env, 64, model_length=None).max_episode_tokens == 4096
    assert EpisodeLimits.of(env, 64, model_length=8192).max_episode_tokens == 4096


class Stuck:
    """Episode 0's environment never answers its first step (until the test lets it go); episode 1's answers once
    and ends at its second step."""

    made = 0

    def __init__(self, release: threading.Event):
        self.index, self.release, self.steps = Stuck.made, release, 0
        Stuck.made += 1

    def reset(self, prompt):
        return [{"role": "user", "content": prompt.text}]

    def step(self, message):
        self.steps += 1
        if self.index == 0:
            self.release.wait()
            return Reply(done=True)
        return Reply([{"role": "user", "content": "go on"}]) if self.steps == 1 else Reply(done=True, reward=0.5)


def test_a_step_that_never_returns_stalls_neither_generation_nor_the_other_episodes(tokenizer):
    """A timed-out step's thread cannot be stopped; it must not hold the threads that later turns need (one
    worker here, so that a held pool shows at once)."""
    release = threading.Event()
    Stuck.made = 0
    runner = EpisodeRunner(
        lambda: Stuck(release),
        ChatDelta(tokenizer),
        EpisodeLimits(max_turns=3, max_episode_tokens=512, max_new_tokens=16, step_timeout_seconds=0.2),
        workers=1,
    )
    replicas = ScriptedReplicas(tokenizer, {0: ["a"] * 3, 1: ["b"] * 3})
    done: list = []
    thread = threading.Thread(
        target=lambda: done.append(
            runner.run([PROMPT], [[1]], [0], Sampling(2, 1.0, 1.0, 8), replicas, replicas=[0], version=3)
        ),
        daemon=True,
    )
    thread.start()
    thread.join(timeout=60)
    finished = not thread.is_alive()
    release.set()
    assert finished, "the runner waited behind a step that never returned"
    [[stuck, other]] = done[0]
    assert "took longer than stepTimeoutSeconds" in stuck.episode.error
    assert (other.episode.error, other.episode.turns, other.episode.reward) == (None, 2, 0.5)
    runner.close()


def test_evaluation_runs_episodes_and_scores_them_as_training_does(tokenizer):
    """spec.eval with spec.environment: each held-out prompt plays one episode (eval sampling), and the episode's
    reward is what training would give it (the environment's, else the task's of the last message; an
    environment error is unscorable, left out). The figures a user reads carry the episodes' turns."""
    from grpolora.api.spec import GRPOLoraJobSpec
    from grpolora.workers.trainer.evaluate import evaluate

    spec = GRPOLoraJobSpec.model_validate({
        "model": {"name": "m"}, "environment": {"builtin": "calculator"}, "eval": {"everySteps": 5},
    })  # fmt: skip
    prompts = [PROMPT, Prompt("What is 3 * 5?", answer="15")]
    replicas = ScriptedReplicas(tokenizer, {0: ["<calc>12*7</calc>", "Answer: 84"], 1: ["Answer: 16"]})
    runner = _runner(tokenizer)

    def generate(asked, ids, sampling):
        assert (sampling.n, sampling.temperature) == (1, 0.0)  # one greedy episode per held-out prompt
        return runner.run(asked, ids, [0, 1024], sampling, replicas, replicas=[0], version=5)

    result = evaluate(prompts, task=ArithmeticTask(), tokenize=lambda p: [1], generate=generate, spec=spec)
    expected = ArithmeticTask().score([(PROMPT, "Answer: 84"), (prompts[1], "Answer: 16")]).total
    assert result.prompts == 2 and result.reward_mean == pytest.approx(sum(expected) / 2)
    record = result.record()
    assert record["eval_episode_turns_mean"] == 1.5 and record["eval_environment_errors"] == 0
    runner.close()


def test_grpolora_eval_says_it_does_not_play_episodes(tmp_path):
    from grpolora.api.spec import GRPOLoraJobSpec
    from grpolora.workers.trainer.evaluate import offline

    spec = GRPOLoraJobSpec.model_validate({"model": {"name": "m"}, "environment": {"builtin": "calculator"}})
    with pytest.raises(TaskError, match=r"^spec.environment: `grpolora eval` does not play episodes yet"):
        offline(spec, tmp_path)
