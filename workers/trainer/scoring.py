"""A step's rollouts scored: rewards, group-relative advantages and the training batch, and the sample rows a
tracker shows. Pure apart from the task's reward call."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from grpolora.api.spec import GRPOSpec
from grpolora.workers.tasks import Prompt, Task
from grpolora.workers.trainer.buffer import Group
from grpolora.workers.trainer.grpo import group_advantages, overlong_penalty
from grpolora.workers.trainer.policy import Batch, build_batch
from grpolora.workers.trainer.rollout import Completion


@dataclass
class Rollouts:
    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    completions: list[list[Completion]]
    seconds: float
    """Wall time of the generation round(s) that produced them (the longest)."""

    @classmethod
    def of(cls, groups: list[Group]) -> Rollouts:
        return cls(
            [g.prompt for g in groups],
            [g.prompt_ids for g in groups],
            [g.completions for g in groups],
            max(g.seconds for g in groups),
        )

    def prompts_and_completions(self, count: int) -> list[tuple[Prompt, list[Completion]]]:
        return list(zip(self.prompts[:count], self.completions[:count], strict=True))

    @property
    def versions(self) -> set[int]:
        """The adapter versions that generated these completions (a replica may have served another one)."""
        return {c.version for group in self.completions for c in group}


@dataclass
class Scored:
    rewards: torch.Tensor  # [prompts, generations], the weighted total
    parts: dict[str, torch.Tensor]  # each reward's own scores, same shape (several rewards only)
    advantages: torch.Tensor  # same shape
    batch: Batch
    penalty: torch.Tensor | None = None  # grpo.overlongBuffer's length penalty, same shape, in the advantages only
    truncated: int = 0  # completions cut off at maxNewTokens (out of the loss with grpo.maskTruncated)


def score(task: Task, rollouts: Rollouts, grpo: GRPOSpec, pad_token_id: int) -> Scored:
    """Rewards from the task, advantages within each prompt's group (of the rewards plus grpo.overlongBuffer's
    length penalty), and the batch the ranks train on (with the replicas' reference logprobs when
    grpo.referenceFrom is inference; without the truncated completions' tokens with grpo.maskTruncated)."""
    items = [(p, c.text) for p, group in zip(rollouts.prompts, rollouts.completions, strict=True) for c in group]
    scores = task.score(items)
    shape = (len(rollouts.prompts), -1)
    rewards = torch.tensor(scores.total, dtype=torch.float32).view(shape)
    parts = {label: torch.tensor(v, dtype=torch.float32).view(shape) for label, v in scores.parts.items()}
    completions = [c for group in rollouts.completions for c in group]
    penalty = None
    if grpo.overlong_buffer is not None:
        lengths = torch.tensor([len(c.token_ids) for c in completions]).view(shape)
        penalty = overlong_penalty(
            lengths, max_new_tokens=grpo.max_new_tokens, buffer=grpo.overlong_buffer, factor=grpo.overlong_penalty
        )
    shaped = rewards if penalty is None else rewards + penalty
    advantages = group_advantages(shaped, grpo.advantage, scale=grpo.advantage_scale_in_force)
    sequences, flat_advantages, reference = [], [], []
    for ids, group, row in zip(rollouts.prompt_ids, rollouts.completions, advantages, strict=True):
        for completion, advantage in zip(group, row.tolist(), strict=True):
            sequences.append((ids, completion.token_ids, completion.logprobs))
            flat_advantages.append(advantage)
            reference.append(completion.reference_logprobs)
    given = reference if grpo.reference_on_replicas else None
    batch = build_batch(sequences, flat_advantages, pad_token_id, given)
    cut = torch.tensor([c.finish_reason == "length" for c in completions])
    if grpo.mask_truncated and cut.any():
        batch = dataclasses.replace(batch, completion_mask=batch.completion_mask * (~cut).to(torch.float32)[:, None])
    return Scored(rewards, parts, advantages, batch, penalty, int(cut.sum()))


def reference_from(scored: Scored, grpo: GRPOSpec) -> str | None:
    """Where the step's KL reference logprobs came from: `inference` (the replicas), `trainer`, None at klCoef 0."""
    if scored.batch.reference_logprobs is not None:
        return "inference"
    return "trainer" if grpo.kl_coef > 0 else None


def sample_rows(rollouts: Rollouts, scored: Scored, prompts: int) -> list[dict[str, Any]]:
    """The first `prompts` prompts of the step, each with all its completions, rewards and advantages."""
    rows = []
    for i, (prompt, group) in enumerate(rollouts.prompts_and_completions(prompts)):
        for j, completion in enumerate(group):
            row = {
                "prompt": prompt.text,
                "answer": prompt.answer,
                "completion": completion.text,
                "reward": float(scored.rewards[i, j]),
                "advantage": float(scored.advantages[i, j]),
            }
            if scored.parts:
                row["rewards"] = {label: float(v[i, j]) for label, v in scored.parts.items()}
            rows.append(row)
    return rows
