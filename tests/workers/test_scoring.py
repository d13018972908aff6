"""A step's rollouts scored: the recipe options that act on rewards and on which completions train."""

from __future__ import annotations

import pytest
import torch

from grpolora.api.load import parse_job
from grpolora.workers.tasks.base import Prompt, Scores
from grpolora.workers.trainer.rollout import Completion
from grpolora.workers.trainer.scoring import Rollouts, score
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
