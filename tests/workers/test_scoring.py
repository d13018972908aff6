"""A step's rollouts scored: the recipe options that act on rewards and on which completions train."""

from __future__ import annotations

import threading

import pytest
import torch

from grpolora.api.load import parse_job
from grpolora.workers.tasks.base import Prompt, Scores
from grpolora.workers.trainer.buffer import BufferClosed, Group, RolloutBuffer
from grpolora.workers.trainer.controller import Controller
from grpolora.workers.trainer.rollout import Completion
from grpolora.workers.trainer.scoring import Rollouts, fill_with_spread, has_spread, score
from tests.helpers import job_doc


class _LengthTask:
    """Reward 1 for every completion (so only the options make a difference)."""

    def score(self, items):
        return Scores([1.0] * len(items))


def _rollouts(lengths: list[list[int]], finish: list[list[str]]) -> Rollouts:
    completions = [
        [Completion([7] * n, [-0.5] * n, "x" * n, reason, 0) for n, reason in zip(row, why, strict=True)]
        for row, why in zip(lengths, finish, strict=True)
    ]
    prompts = [Prompt(text=f"p{i}", answer=None) for i in range(len(lengths))]
    return Rollouts(prompts, [[1, 2, 3]] * len(lengths), completions, 0.1)


def _grpo(**fields):
    return parse_job(job_doc(grpo={"maxNewTokens": 10, **fields})).spec.grpo


def test_the_soft_overlong_penalty_enters_the_advantages_not_the_reported_reward():
    # One group, lengths [3, 7, 10] with maxNewTokens 10, buffer 4: penalties [0, -0.25, -1]; rewards 1 each.
    # Advantages of [1, 0.75, 0] (unscaled): mean 0.5833333 → [0.4166667, 0.1666667, -0.5833333].
    rollouts = _rollouts([[3, 7, 10]], [["stop", "stop", "length"]])
    scored = score(_LengthTask(), rollouts, _grpo(overlongBuffer=4, advantageScale="none"), pad_token_id=0)
    torch.testing.assert_close(scored.rewards, torch.tensor([[1.0, 1.0, 1.0]]))
    torch.testing.assert_close(scored.penalty, torch.tensor([[0.0, -0.25, -1.0]]))
    torch.testing.assert_close(scored.advantages, torch.tensor([[0.4166667, 0.1666667, -0.5833333]]))
    assert scored.truncated == 1


@pytest.mark.parametrize("mask", [True, False])
def test_truncated_completions_leave_the_loss_when_masked(mask):
    rollouts = _rollouts([[3, 10], [10, 4]], [["stop", "length"], ["length", "stop"]])
    scored = score(_LengthTask(), rollouts, _grpo(maskTruncated=mask), pad_token_id=0)
    tokens = scored.batch.completion_mask.sum(dim=1).tolist()
    assert tokens == ([3.0, 0.0, 0.0, 4.0] if mask else [3.0, 10.0, 10.0, 4.0])
    assert scored.truncated == 2 and scored.penalty is None


# --- dynamic sampling -----------------------------------------------------------------------------------------------


def test_a_group_has_spread_unless_all_its_rewards_are_equal():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5], [0.0, 0.0, 1e-6]])
    assert has_spread(rewards).tolist() == [False, True, False, True]


def _group(position: int) -> Group:
    return Group(position, Prompt(text=f"p{position}"), [1, 2], [], 0.1)


class _Draws:
    """Groups numbered from 0 in stream order; `spread` says which have rewards that differ."""

    def __init__(self, spread: set[int]):
        self.spread, self.next, self.asked = spread, 0, []

    def take(self, count: int) -> list[Group]:
        self.asked.append(count)
        groups = [_group(self.next + i) for i in range(count)]
        self.next += count
        return groups

    def rate(self, groups: list[Group]):
        rows = [[0.0, 1.0] if g.position in self.spread else [1.0, 1.0] for g in groups]
        return torch.tensor(rows), {"judge": torch.tensor(rows) * 2}


def test_dynamic_sampling_replaces_flat_groups_with_new_draws():
    # 4 wanted; groups 0-3 drawn, 1 and 3 flat; a draw of 2 (4, 5: 5 flat), then of 1 (6): [0, 2, 4, 6].
    draws = _Draws(spread={0, 2, 4, 6, 7})
    filled = fill_with_spread(draws.take(4), draws.rate, draws.take, wanted=4, extra_draws=3)
    assert [g.position for g in filled.groups] == [0, 2, 4, 6]
    assert draws.asked == [4, 2, 1] and (filled.draws, filled.filtered) == (2, 3)
    torch.testing.assert_close(filled.rewards, torch.tensor([[0.0, 1.0]] * 4))
    torch.testing.assert_close(filled.parts["judge"], torch.tensor([[0.0, 2.0]] * 4))
    assert filled.drawn_reward_mean == pytest.approx((4 * 0.5 + 3 * 1.0) / 7)


def test_dynamic_sampling_trains_on_what_there_is_after_its_draws():
    # Only group 1 has spread and one extra draw is allowed: the step trains on [1] alone (4-6 are flat too).
    draws = _Draws(spread={1})
    filled = fill_with_spread(draws.take(4), draws.rate, draws.take, wanted=4, extra_draws=1)
    assert [g.position for g in filled.groups] == [1] and draws.asked == [4, 3]
    assert (filled.draws, filled.filtered) == (1, 6)
    # No group with spread at all: the first draw is trained on as it is (its advantages are zero); the extra
    # draw's 2 groups are the ones left out.
    draws = _Draws(spread=set())
    filled = fill_with_spread(draws.take(2), draws.rate, draws.take, wanted=2, extra_draws=1)
    assert [g.position for g in filled.groups] == [0, 1] and filled.filtered == 2


class _SpreadTask:
    """Prompts p0, p1, ...: the completions of an even-numbered prompt score [0, 1], of an odd one [1, 1]."""

    def score(self, items):
        return Scores([float(int(p.text[1:]) % 2 == 1 or i % 2 == 1) for i, (p, _) in enumerate(items)])


def _generated(position: int) -> Group:
    return Group(position, Prompt(text=f"p{position}"), [1], [Completion([5], [-1.0], "x", "stop", 0)] * 2, 0.1)


def test_the_controllers_extra_draws_come_from_the_buffer_within_its_allowance():
    """At maxStaleness 0 the buffer allows the producer nothing while a step trains: each extra draw must allow
    exactly what it takes, and leave the allowance as the step set it."""
    buffer = RolloutBuffer(0, next_position=4)

    def produce():
        try:
            while True:
                count, start = buffer.reserve(8)
                groups = [_generated(start + i) for i in range(count)]
                buffer.deliver(groups, reserved=count, next_position=start + count)
        except BufferClosed:
            pass

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    controller = Controller.__new__(Controller)
    controller._buffer, controller.task = buffer, _SpreadTask()
    controller.spec = parse_job(job_doc(grpo={"promptsPerStep": 4, "dynamicSamplingDraws": 3})).spec
    first = [_generated(i) for i in range(4)]
    try:
        filled, dropped, _ = controller._fill_with_spread(first, version=0, then_allow=0)
        room = buffer._room()  # the allowance the step set, less what is held: nothing
    finally:
        buffer.close()
        producer.join(timeout=10)
    # p0, p2 kept; draw 2 (p4, p5: p4 kept), draw 1 (p6).
    assert [g.prompt.text for g in filled.groups] == ["p0", "p2", "p4", "p6"] and filled.draws == 2
    assert dropped == 0 and room == 0 and buffer.held() == 0 and buffer.consumed() == 7


class _SkippingTask:
    """Reward 1 for completions longer than 2 tokens, 0 for others, and None (NaN) for those of length 2."""

    def score(self, items):
        return Scores([float("nan") if len(c) == 2 else float(len(c) > 2) for _, c in items])


def test_unscorable_completions_are_counted_and_reported_over_the_scored_ones():
    from grpolora.workers.trainer.scoring import reward_figures, sample_rows

    rollouts = _rollouts([[1, 2, 3, 3]], [["stop"] * 4])
    scored = score(_SkippingTask(), rollouts, _grpo(), pad_token_id=0)
    assert scored.unscorable == 1
    assert scored.advantages[0, 1] == 0.0 and scored.advantages[0, 0] < 0 < scored.advantages[0, 2]
    # metrics.jsonl: mean (0 + 1 + 1) / 3 and sample std of (0, 1, 1) over the scored ones; the count beside them.
    figures = reward_figures(scored)
    assert figures["reward_mean"] == pytest.approx(2 / 3)
    assert figures["reward_std"] == pytest.approx(torch.tensor([0.0, 1.0, 1.0]).std().item())
    assert figures["rewards_unscorable"] == 1
    # A sample row shows no reward for it (JSON has no NaN).
    assert [row["reward"] for row in sample_rows(rollouts, scored, 1)] == [0.0, None, 1.0, 1.0]
    # A group is flat when its scored rewards are equal, whatever its unscorable ones.
    assert has_spread(torch.tensor([[1.0, float("nan"), 1.0], [0.0, float("nan"), 1.0]])).tolist() == [False, True]


# --- the figures practitioners read first, under TRL's names (issue 47) ----------------------------------------------


def test_the_share_of_groups_without_reward_spread_is_trls_frac_reward_zero_std():
    # TRL's GRPOTrainer logs frac_reward_zero_std: the share of groups whose rewards have std 0 (trl
    # grpo_trainer.py, _generate_and_score_completions; 0.28-0.34 in the race's first steps). Four groups:
    # (1, 1, 1) flat, (0, 1, 0) spread, (0.5, 0.5, NaN) flat over its scored ones, (NaN, NaN, NaN) nothing scored:
    # no spread either (its advantages are 0). 3 of 4 -> 0.75.
    from grpolora.workers.trainer.scoring import frac_reward_zero_std

    nan = float("nan")
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, nan], [nan, nan, nan]])
    assert frac_reward_zero_std(rewards) == 0.75
    assert frac_reward_zero_std(torch.tensor([[0.0, 1.0]])) == 0.0


def test_reward_figures_carry_the_share_of_flat_groups():
    from grpolora.workers.trainer.scoring import reward_figures

    # _LengthTask scores every completion 1: both groups are flat.
    scored = score(_LengthTask(), _rollouts([[3, 4], [5, 6]], [["stop"] * 2] * 2), _grpo(), pad_token_id=0)
    assert reward_figures(scored)["frac_reward_zero_std"] == 1.0


def test_completion_figures_are_trls_completions_block():
    # TRL's completions/{mean,min,max}_length, clipped_ratio (cut at the length limit) and the lengths of those that
    # terminated (trl grpo_trainer.py, _generate_and_score_completions). Lengths 3, 10 (cut), 10 (cut), 4, 5:
    # mean 32 / 5 = 6.4, min 3, max 10; clipped 2 / 5; terminated 3, 4, 5: mean 4, min 3, max 5.
    from grpolora.workers.trainer.scoring import completion_figures

    rollouts = _rollouts([[3, 10], [10, 4], [5, 5]], [["stop", "length"], ["length", "stop"], ["stop", "stop"]])
    rollouts.completions[2].pop()  # groups need not be the same size here: 5 completions
    assert completion_figures(rollouts) == {
        "completions": {
            "mean_length": 6.4,
            "min_length": 3,
            "max_length": 10,
            "clipped_ratio": 0.4,
            "mean_terminated_length": 4.0,
            "min_terminated_length": 3,
            "max_terminated_length": 5,
        }
    }
    # None terminated: TRL reports 0 for the terminated lengths (it takes a zero tensor); so do we.
    cut = completion_figures(_rollouts([[10, 10]], [["length", "length"]]))["completions"]
    assert (cut["clipped_ratio"], cut["mean_terminated_length"], cut["max_terminated_length"]) == (1.0, 0.0, 0)


def test_the_batch_numbers_each_sequences_prompt_group():
    # The trainer's per-group figures (entropy as TRL averages it) need each sequence's group after sharding and
    # length sorting have reordered them.
    scored = score(_LengthTask(), _rollouts([[3, 4, 5], [6, 7, 8]], [["stop"] * 3] * 2), _grpo(), pad_token_id=0)
    assert scored.batch.groups.tolist() == [0, 0, 0, 1, 1, 1]
    assert scored.batch.by_length().trimmed().groups.tolist() == [0, 0, 0, 1, 1, 1]
    assert scored.batch.select(torch.tensor([5, 0])).groups.tolist() == [1, 0]
