"""A step's rollouts scored: rewards, group-relative advantages and the training batch, and the sample rows a
tracker shows. Pure apart from the task's reward call."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grpolora.api.spec import GRPOSpec
from grpolora.workers.environments.episode import Episode
from grpolora.workers.tasks import Prompt, Scores, Task, TaskError
from grpolora.workers.trainer.buffer import Group
from grpolora.workers.trainer.grpo import group_advantages, overlong_penalty, safe_div
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

    def part_means(self) -> dict[str, float]:
        """Each reward's mean over the samples it applies to (NaN marks the others; one applying to none is left
        out)."""
        return {label: float(v.nanmean()) for label, v in self.parts.items() if not bool(v.isnan().all())}

    @property
    def unscorable(self) -> int:
        """Completions no reward applied to (NaN rewards): out of their group's baseline, advantage 0."""
        return int(self.rewards.isnan().sum())


def reward_figures(scored: Scored) -> dict[str, float | int]:
    """The step's reward figures for metrics.jsonl: mean and (sample) std over the scored completions, how many
    were unscorable (0 and 0 when none was scored: JSON has no NaN), and the share of groups without spread."""
    values = scored.rewards[~scored.rewards.isnan()]
    return {
        "reward_mean": float(values.mean()) if len(values) else 0.0,
        "reward_std": float(values.std()) if len(values) > 1 else 0.0,
        "rewards_unscorable": scored.unscorable,
        "frac_reward_zero_std": frac_reward_zero_std(scored.rewards),
    }


def frac_reward_zero_std(rewards: torch.Tensor) -> float:
    """The share of groups (rows of `rewards[groups, generations]`) whose scored rewards are all equal, under TRL's
    name (GRPOTrainer's `frac_reward_zero_std`): their advantages are 0, so they add nothing but the KL term, and
    the step learns from the other groups only. A group with no scored completion counts as flat too (TRL's
    NaN std does not; it has no signal either way)."""
    return safe_div(float((~has_spread(rewards)).sum()), len(rewards))


def completion_figures(rollouts: Rollouts) -> dict[str, dict[str, float | int]]:
    """The step's completion lengths (tokens the model generated: `generated_length`) under TRL's names, nested so
    that the trackers show `completions/mean_length` and the rest as TRL's GRPOTrainer logs them: mean, min and max
    length; `clipped_ratio`, the share cut at maxNewTokens (finish reason `length`; TRL: no EOS at the end); and the
    lengths of those that terminated, 0 when none did (as TRL)."""
    completions = [c for group in rollouts.completions for c in group]
    lengths = [generated_length(c) for c in completions]
    finished = [n for n, c in zip(lengths, completions, strict=True) if c.finish_reason != "length"]
    cut = len(lengths) - len(finished)
    finished = finished or [0]
    return {
        "completions": {
            "mean_length": safe_div(sum(lengths), len(lengths)),
            "min_length": min(lengths, default=0),
            "max_length": max(lengths, default=0),
            "clipped_ratio": safe_div(cut, len(lengths)),
            "mean_terminated_length": sum(finished) / len(finished),
            "min_terminated_length": min(finished),
            "max_terminated_length": max(finished),
        }
    }


def episode_of(completion: Completion) -> Episode | None:
    """The episode a rollout is (spec.environment), or None for a single completion."""
    return getattr(completion, "episode", None)


def scores_of(task: Task, rollouts: Rollouts) -> Scores:
    """The task's scores of every completion, in order: the weighted total and each reward's own.

    An episode's total is the environment's reward where it gave one, else the task's of its last assistant message;
    an episode the environment ended with an error is unscorable (NaN: out of its group's baseline, advantage 0)."""
    items = [(p, c.text) for p, group in zip(rollouts.prompts, rollouts.completions, strict=True) for c in group]
    scores = task.score(items)
    total = list(scores.total)
    for i, completion in enumerate(c for group in rollouts.completions for c in group):
        if (episode := episode_of(completion)) is not None:
            if episode.error is not None:
                total[i] = math.nan
            elif episode.reward is not None:
                total[i] = episode.reward
    return Scores(total, scores.parts)


def rewards_of(task: Task, rollouts: Rollouts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """scores_of as tensors [prompts, generations]: the weighted total and each reward's own."""
    scores = scores_of(task, rollouts)
    shape = (len(rollouts.prompts), -1)
    rewards = torch.tensor(scores.total, dtype=torch.float32).view(shape)
    return rewards, {label: torch.tensor(v, dtype=torch.float32).view(shape) for label, v in scores.parts.items()}


def has_spread(rewards: torch.Tensor) -> torch.Tensor:
    """Which groups (rows of `rewards[groups, generations]`) have rewards that differ: a group whose completions
    all scored the same has zero advantages and adds nothing but the KL term to the gradient. Unscorable (NaN)
    completions are not compared: they get advantage 0 whatever the others scored."""
    scored = ~rewards.isnan()
    low = torch.where(scored, rewards, torch.full_like(rewards, float("inf"))).amin(dim=1)
    high = torch.where(scored, rewards, torch.full_like(rewards, float("-inf"))).amax(dim=1)
    return scored.any(dim=1) & (high > low)


@dataclass
class Filled:
    """A step's groups after dynamic sampling, with their rewards (rows in the same order)."""

    groups: list[Group]
    rewards: torch.Tensor
    parts: dict[str, torch.Tensor]
    draws: int  # extra draws taken after the first
    filtered: int  # groups drawn but not trained on
    drawn_reward_mean: float  # over every group drawn, trained on or not (the unfiltered learning curve)


def fill_with_spread(
    first: list[Group],
    rate: Callable[[list[Group]], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    take: Callable[[int], list[Group]],
    *,
    wanted: int,
    extra_draws: int,
) -> Filled:
    """Dynamic sampling (DAPO): keep the groups of `first` whose rewards have spread, and `take` as many more as are
    missing, at most `extra_draws` times; then train on what there is. Where no drawn group has spread, the first
    draw is trained on as it is. `rate` gives a list of groups' rewards and reward parts (rewards_of), so each
    group is scored once."""
    kept: list[Group] = []
    rows: list[torch.Tensor] = []
    part_rows: dict[str, list[torch.Tensor]] = {}
    drawn_sum, drawn_count, draws = 0.0, 0, 0
    batch, first_rated = first, None
    while True:
        rewards, parts = rate(batch)
        first_rated = first_rated or (rewards, parts)
        group_means = rewards.nanmean(dim=1).nan_to_num(0.0)  # a group none of whose completions was scored: 0
        drawn_sum, drawn_count = drawn_sum + float(group_means.sum()), drawn_count + len(batch)
        for index in has_spread(rewards).nonzero().flatten().tolist():
            kept.append(batch[index])
            rows.append(rewards[index])
            for label, values in parts.items():
                part_rows.setdefault(label, []).append(values[index])
        if len(kept) >= wanted or draws >= extra_draws:
            break
        batch = take(wanted - len(kept))
        draws += 1
    drawn_mean = drawn_sum / drawn_count
    if not kept:
        rewards, parts = first_rated
        return Filled(list(first), rewards, parts, draws, drawn_count - len(first), drawn_mean)
    stacked = {label: torch.stack(values) for label, values in part_rows.items()}
    return Filled(kept, torch.stack(rows), stacked, draws, drawn_count - len(kept), drawn_mean)


def score(
    task: Task,
    rollouts: Rollouts,
    grpo: GRPOSpec,
    pad_token_id: int,
    rated: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None,
    episode_tokens: int | None = None,
) -> Scored:
    """Rewards from the task, advantages within each prompt's group (of the rewards plus grpo.overlongBuffer's
    length penalty), and the batch the ranks train on (with the replicas' reference logprobs when
    grpo.referenceFrom is inference; without the truncated completions' tokens with grpo.maskTruncated). `rated`:
    the rewards and parts of rewards_of, where they were already computed (dynamic sampling). `episode_tokens`:
    the episodes' budget (spec.environment.maxEpisodeTokens, within the model's length), which an episode's whole
    length meets where a completion's meets grpo.maxNewTokens."""
    rewards, parts = rewards_of(task, rollouts) if rated is None else rated
    shape = (len(rollouts.prompts), -1)
    completions = [c for group in rollouts.completions for c in group]
    failed = [e.error for c in completions if (e := episode_of(c)) is not None and e.error is not None]
    if failed and len(failed) == len(completions):
        raise TaskError("spec.environment", f"every episode of the step ended with an environment error, e.g. "
                        f"{failed[0]}")  # fmt: skip
    penalty = None
    if grpo.overlong_buffer is not None:
        # An episode runs into maxEpisodeTokens (its opening, every turn, the environment's answers), not into one
        # turn's maxNewTokens: its assistant tokens summed over turns are no measure of either.
        episodic = episode_tokens is not None and any(episode_of(c) is not None for c in completions)
        limit = episode_tokens if episodic else grpo.max_new_tokens
        lengths = torch.tensor([episode_length(c) if episodic else generated_length(c) for c in completions])
        penalty = overlong_penalty(
            lengths.view(shape), max_new_tokens=limit, buffer=grpo.overlong_buffer, factor=grpo.overlong_penalty
        )
    shaped = rewards if penalty is None else rewards + penalty
    advantages = group_advantages(shaped, grpo.advantage, scale=grpo.advantage_scale_in_force)
    sequences, flat_advantages, reference, masks = [], [], [], []
    for ids, group, row in zip(rollouts.prompt_ids, rollouts.completions, advantages, strict=True):
        for completion, advantage in zip(group, row.tolist(), strict=True):
            episode = episode_of(completion)
            # An episode's prompt is its own opening (the environment's reset), not the task's rendering.
            sequences.append((ids if episode is None else episode.opening, completion.token_ids, completion.logprobs))
            flat_advantages.append(advantage)
            reference.append(completion.reference_logprobs)
            masks.append(None if episode is None else episode.loss_mask)
    given = reference if grpo.reference_on_replicas else None
    batch = with_loss_masks(
        build_batch(sequences, flat_advantages, pad_token_id, given), [len(p) for p, _, _ in sequences], masks
    )
    sizes = torch.tensor([len(group) for group in rollouts.completions])
    batch = dataclasses.replace(batch, groups=torch.arange(len(sizes)).repeat_interleave(sizes))
    cut = torch.tensor([c.finish_reason == "length" for c in completions])
    if grpo.mask_truncated and cut.any():
        batch = dataclasses.replace(batch, completion_mask=batch.completion_mask * (~cut).to(torch.float32)[:, None])
    return Scored(rewards, parts, advantages, batch, penalty, int(cut.sum()))


def with_loss_masks(batch: Batch, prompt_lengths: list[int], masks: list[list[int] | None]) -> Batch:
    """`batch` with each episode's loss mask (1 on the assistant's tokens, 0 on the environment's and the
    template's) in place of its all-ones completion mask; rows without one (single completions) unchanged. The
    mask is what the loss, the KL, the entropy and the mismatch all sum over, so nothing else needs to know."""
    if all(m is None for m in masks):
        return batch
    completion = batch.completion_mask.clone()
    for row, (length, mask) in enumerate(zip(prompt_lengths, masks, strict=True)):
        if mask is not None:
            start = length - 1  # logits at the prompt's last position predict the first token after it
            completion[row, start : start + len(mask)] = torch.tensor(mask, dtype=completion.dtype)
    return dataclasses.replace(batch, completion_mask=completion)


def generated_length(completion: Completion) -> int:
    """Tokens the model generated: an episode's assistant tokens, not its environment's."""
    episode = episode_of(completion)
    return len(completion.token_ids) if episode is None else sum(episode.loss_mask)


def episode_length(completion: Completion) -> int:
    """An episode's whole length, as maxEpisodeTokens counts it (opening and every later id)."""
    episode = episode_of(completion)
    return len(completion.token_ids) + (0 if episode is None else len(episode.opening))


def episode_figures(rollouts: Rollouts) -> dict[str, float | int]:
    """The step's episode figures for metrics.jsonl (spec.environment); {} when its rollouts are no episodes."""
    episodes = [e for group in rollouts.completions for c in group if (e := episode_of(c)) is not None]
    if not episodes:
        return {}
    count = len(episodes)
    return {
        "episode_turns_mean": sum(e.turns for e in episodes) / count,
        "episode_turns_max": max(e.turns for e in episodes),
        "episode_tool_calls": sum(e.tool_calls for e in episodes),
        "episode_tokens_mean": sum(len(e.opening) + len(e.loss_mask) for e in episodes) / count,
        "episodes_truncated": sum(e.truncated for e in episodes),
        "environment_errors": sum(e.error is not None for e in episodes),
        "environment_faults": sum(e.fault is not None for e in episodes),
        "episode_tool_errors": sum(e.tool_errors for e in episodes),
        "environment_seconds": sum(e.environment_seconds for e in episodes),
        **turn_reward_figures(episodes),
        **agent_figures(episodes),
    }


def agent_figures(episodes: list[Episode]) -> dict[str, int]:
    """An agent's sessions (spec.environment.agent): the segments that train on nothing (the agent rewrote its
    history; the last segment is the sample)."""
    sessions = [e.segments for e in episodes if e.segments is not None]
    if not sessions:
        return {}
    return {"agent_segments_dropped": sum(max(segments - 1, 0) for segments in sessions)}


def turn_reward_figures(episodes: list[Episode]) -> dict[str, float]:
    """The per-turn rewards environments gave (spec.environment.discount's inputs), where any gave one."""
    given = [r for e in episodes for r in e.turn_rewards or [] if r is not None]
    if not given:
        return {}
    return {"episode_turn_reward_mean": sum(given) / len(given), "episode_turn_rewards": len(given)}


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
                **episode_row(completion),
                "reward": None if math.isnan(reward := float(scored.rewards[i, j])) else reward,
                "advantage": float(scored.advantages[i, j]),
            }
            if scored.parts:  # None: that reward does not apply to this sample
                parts = {label: float(v[i, j]) for label, v in scored.parts.items()}
                row["rewards"] = {label: None if math.isnan(x) else x for label, x in parts.items()}
            rows.append(row)
    return rows


def episode_row(completion: Completion) -> dict[str, Any]:
    """An episode's part of its samples.jsonl row: the whole conversation, role-tagged, and how it ended."""
    episode = episode_of(completion)
    if episode is None:
        return {}
    return {
        "messages": episode.messages,
        "turns": episode.turns,
        "truncated": episode.truncated,
        **({"environment_error": episode.error} if episode.error is not None else {}),
        **({"environment_fault": episode.fault} if episode.fault is not None else {}),
        **({"turn_rewards": episode.turn_rewards} if episode.turn_rewards is not None else {}),
    }
