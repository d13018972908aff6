"""One GRPO training step on one trainer rank: its shard of the batch, in micro-batches, then the update (or, with
grpo.updatesPerBatch and grpo.miniBatches, several updates over mini-batches of it).

Every rank normalises its loss by the normaliser of the WHOLE mini-batch (all ranks, all micro-batches; tokens,
sequences or sequences x maxNewTokens by grpo.lossAggregation), so accumulating micro-batches and reducing
gradients over ranks gives exactly the loss of one rank holding the whole mini-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from grpolora.api.spec import GRPOSpec, LrSchedule
from grpolora.workers.trainer.grpo import (
    EntropyStats,
    LossStats,
    MismatchStats,
    entropy_stats,
    group_entropy_sums,
    grpo_loss,
    logprob_mismatch,
    loss_normalizer,
    mean_of_group_means,
    safe_div,
)
from grpolora.workers.trainer.policy import Batch, Policy

_Stats = TypeVar("_Stats", LossStats, MismatchStats, EntropyStats)


@dataclass(frozen=True)
class StepStats:
    loss: float
    kl: float  # mean k3 KL to the reference per completion token
    clip_fraction: float
    grad_norm: float
    tokens: int  # the step's completion tokens in the loss (mask sum, all ranks); not TRL's cumulative num_tokens
    mismatch: float  # mean exp(|logp_trainer - logp_sampler|) - 1 (trainer before the update)
    mismatch_max: float
    gen_kl: float  # k3 estimate of KL(sampler || trainer)
    weight_mean: float = 0.0  # behaviour importance weight pi_trainer / pi_sampler, mean over the weighted tokens
    weight_max: float = 0.0  # ... and its largest value, both before truncation
    truncated_fraction: float = 0.0  # share of off-policy tokens whose weight was cut to grpo.importanceWeightCap
    weight_ess: float = 0.0  # effective sample size of the weights the loss used, as a share of those tokens
    updates: int = 1  # optimizer steps taken on the batch (grpo.updatesPerBatch x mini-batches)
    learning_rate: float = 0.0  # the step's rate after grpo.lrSchedule
    entropy: float = 0.0  # the policy's mean token entropy (nats) on the batch, before the first update
    entropy_group_mean: float = 0.0  # ... as the mean of each prompt group's token mean (TRL's averaging)
    grad_clipped: float = 0.0  # share of the updates whose gradient norm grpo.maxGradNorm cut (clipped_share)
    clip_low: float = 0.0  # share of the tokens PPO's clip cut below (A < 0): TRL's clip_ratio/low_mean
    clip_high: float = 0.0  # ... above (A > 0): TRL's clip_ratio/high_mean
    clip_region: float = 0.0  # ... either way: TRL's clip_ratio/region_mean (clip_fraction adds clipRatioMax's)


def clipped_share(norms: list[float], *, max_norm: float) -> float:
    """The share of updates whose gradient norm (as `clip_grad_norm_` returns it, before the cut) is above max_norm:
    the cut bound there (it multiplies by max_norm / (norm + 1e-6); at norm == max_norm that is a no-op). With
    Adam the cut matters where it binds on some steps and not others: it changes those steps' weight in the
    moments, which is why the figure is logged beside grad_norm."""
    return safe_div(sum(1 for n in norms if n > max_norm), len(norms))


def logprob_agreement(stats: StepStats, on_policy: bool) -> dict[str, float | None]:
    """The step's trainer-vs-vLLM logprob figures under the name of what they measure. On an on-policy step the
    trainer's weights are the version vLLM sampled from, so any difference is numerics (kernels, dtype): the
    `mismatch`. On an off-policy step they are a newer version's, so the same comparison measures how far the
    policy moved since (`policy_drift`), which must not read as broken numerics."""
    mean, largest = stats.mismatch, stats.mismatch_max
    if on_policy:
        return {"mismatch": mean, "mismatch_max_abs": largest, "policy_drift": None, "policy_drift_max_abs": None}
    return {"mismatch": None, "mismatch_max_abs": None, "policy_drift": mean, "policy_drift_max_abs": largest}


def shard(batch: Batch, rank: int, world_size: int) -> Batch:
    """This rank's sequences: a strided split keeps every rank's share of long and short sequences alike."""
    return batch.select(torch.arange(rank, len(batch), world_size))


def mini_batch_indices(size: int, mini_batches: int) -> list[torch.Tensor]:
    """The sequence indices of each mini-batch (one optimizer step each): `mini_batches` contiguous runs of
    near-equal size, in batch order, so that a group stays together where the count divides the groups; never an
    empty one (at most `size` mini-batches). The same split on every rank and in every pass over the batch."""
    return [run for run in torch.arange(size).tensor_split(min(mini_batches, max(size, 1))) if len(run)]


def micro_batch_slices(lengths: list[int], *, size: int, tokens: int | None) -> list[slice]:
    """Micro-batches over sequences sorted by length (Batch.by_length), as slices: at most `size` sequences each
    and, with a token budget, at most `tokens` padded tokens (count x the longest, prompt included, which is what a
    forward pass holds in activations); a sequence longer than the budget goes alone. Greedy in order, so short
    sequences share a pass and long ones get passes of their own: 4k-16k-token completions fit one GPU without
    making every pass of short ones a pass of one."""
    slices, start = [], 0
    for end in range(1, len(lengths) + 1):
        if (
            end == len(lengths)
            or end + 1 - start > size
            or (tokens is not None and (end + 1 - start) * lengths[end] > tokens)
        ):
            slices.append(slice(start, end))
            start = end
    return slices


def learning_rate_factor(schedule: LrSchedule, step: int, *, total_steps: int, warmup_steps: int) -> float:
    """The learning rate of training step `step` (0-based) of `total_steps`, as a fraction of grpo.learningRate.

    Warmup ramps linearly over the first `warmup_steps` steps, (step + 1) / warmup_steps, so the first step
    already learns; then `constant` stays at 1, `linear` decays as (total - step) / (total - warmup) and `cosine` as
    (1 + cos(pi * (step - warmup) / (total - warmup))) / 2, both reaching 0 one step past the last. Every optimizer
    step of a training step (grpo.updatesPerBatch x grpo.miniBatches) takes that step's rate. A pure function of
    the step, so a resumed run continues the schedule without saving any scheduler state.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}; valid: constant, linear, cosine")


def corrects_mismatch(grpo: GRPOSpec, dtype: str) -> bool:
    """Whether on-policy steps weight tokens by pi_trainer / pi_vLLM too: grpo.mismatchCorrection, else on for the
    half-precision dtypes, where trainer and vLLM kernels disagree by far more than in float32."""
    if grpo.mismatch_correction is not None:
        return grpo.mismatch_correction
    return dtype in ("bfloat16", "float16")


def make_optimizer(policy: Policy, grpo: GRPOSpec) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(
        policy.trainable_parameters(),
        lr=grpo.learning_rate,
        betas=(grpo.adam_beta1, grpo.adam_beta2),
        weight_decay=grpo.weight_decay,
    )
    return with_schedule_base(optimizer, grpo.learning_rate)


def with_schedule_base(optimizer: torch.optim.Optimizer, learning_rate: float) -> torch.optim.Optimizer:
    """Record `learning_rate` as every parameter group's `initial_lr` (where torch's schedulers keep it), the rate
    grpo.lrSchedule scales. It travels in the optimizer's state dict; a fresh optimizer must have it too for a
    checkpoint to restore into it (make_optimizer's do, and TrainerContext.resume sets it again after a restore, so
    checkpoints written before it existed resume as well)."""
    for group in optimizer.param_groups:
        group["initial_lr"] = learning_rate
    return optimizer


def set_learning_rate(optimizer: torch.optim.Optimizer, factor: float) -> float:
    """Each parameter group's rate at `factor` times its `initial_lr` (with_schedule_base); returns the first
    group's rate. An optimizer without one (a test's SGD, a bench's) keeps its own rate, at factor 1 only."""
    for group in optimizer.param_groups:
        if "initial_lr" in group:
            group["lr"] = group["initial_lr"] * factor
        elif factor != 1:
            raise ValueError("a learning-rate schedule needs the optimizer of make_optimizer (or with_schedule_base)")
    return optimizer.param_groups[0]["lr"]


def _all_reduce(values: list[float], world_size: int, device: torch.device, op: str = "sum") -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor.tolist()


@dataclass(frozen=True)
class _Micro:
    """One micro-batch and, with several updates per batch, the logprobs taken before the first update: the
    proximal (old) policy's and the reference's."""

    batch: Batch
    old: torch.Tensor | None = None
    reference: torch.Tensor | None = None


@dataclass(frozen=True)
class _MiniBatch:
    micros: list[_Micro]
    normalizer: float  # loss_normalizer over all ranks, / world_size (FSDP averages the gradients over ranks)


def _mini_batch(policy: Policy, mini: Batch, grpo: GRPOSpec, rank: int, world_size: int) -> _MiniBatch:
    """This rank's share of one mini-batch, in micro-batches, and the loss normaliser of the whole mini-batch."""
    local = shard(mini, rank, world_size).by_length().to(policy.device)
    tokens, sequences = _all_reduce([float(local.completion_mask.sum()), float(len(local))], world_size, policy.device)
    normalizer = loss_normalizer(
        grpo.loss_aggregation,
        tokens=max(tokens, 1.0),
        sequences=max(sequences, 1.0),
        max_new_tokens=grpo.max_new_tokens,
    )
    lengths = local.attention_mask.sum(dim=1).tolist()
    slices = micro_batch_slices(lengths, size=grpo.micro_batch_size, tokens=grpo.micro_batch_tokens)
    # Every rank runs the same number of micro-batches (FSDP's collectives must match); a rank with fewer
    # runs stand-ins that contribute nothing.
    (count,) = _all_reduce([float(len(slices))], world_size, policy.device, op="max")
    has_reference = local.reference_logprobs is not None  # the same on every rank: they get one batch
    micros = [_Micro(local.select(part).trimmed()) for part in slices]
    while len(micros) < count:
        micros.append(_Micro(Batch.stand_in(policy.device, reference=has_reference)))
    return _MiniBatch(micros, normalizer / world_size)


def _reference(policy: Policy, micro: Batch, grpo: GRPOSpec) -> torch.Tensor | None:
    """The KL term's reference logprobs: the replicas' (grpo.referenceFrom: inference), else a reference pass
    (adapter off) here; None at klCoef 0."""
    if micro.reference_logprobs is not None or grpo.kl_coef == 0:
        return micro.reference_logprobs
    with torch.no_grad(), policy.reference():
        return policy.logprobs(micro)


def train_step(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    grpo: GRPOSpec,
    *,
    on_policy: bool,
    rank: int = 0,
    world_size: int = 1,
    step: int = 0,
) -> StepStats:
    """One training step on one batch: grpo.updatesPerBatch passes over it, each in grpo.miniBatches optimizer
    steps (one by default), at the learning rate of training step `step` (grpo.lrSchedule).

    `on_policy`: the batch was sampled from the current weights, so the loss is the plain clipped surrogate
    around the trainer's own logprobs before the first update. Otherwise (grpo.maxStaleness > 0,
    syncEverySteps > 1, a replica that served another version) the decoupled objective weights each token by
    pi_trainer / pi_sampler (the sampler's behaviour logprobs), capped at grpo.importanceWeightCap; on-policy
    steps too with grpo.mismatchCorrection (by default for half-precision models: corrects_mismatch). The KL
    term's reference logprobs come with the batch where the replicas computed them (grpo.referenceFrom: inference),
    else from a reference pass (adapter off) per micro-batch.

    With one update per batch the proximal policy is the weights themselves (ratio exactly 1, no extra pass). With
    several, a no-grad pass first takes the old logprobs (and the reference's, once) of every micro-batch; every
    update's ratio is then against those, so the clip binds and `clip_fraction` counts it. The figures are over
    all updates (grad_norm their mean); the mismatch is the trainer's before the first update."""
    learning_rate = set_learning_rate(
        optimizer,
        learning_rate_factor(grpo.lr_schedule, step, total_steps=grpo.steps, warmup_steps=grpo.warmup_steps),
    )
    minis = [
        _mini_batch(policy, batch.select(indices), grpo, rank, world_size)
        for indices in mini_batch_indices(len(batch), grpo.mini_batches)
    ]
    updates = grpo.updates_per_batch * len(minis)
    weighted = not on_policy or corrects_mismatch(grpo, policy.spec.model.dtype)
    policy.model.train()
    mismatch, spread = MismatchStats(), EntropyStats()
    groups = _GroupSpread(int(batch.groups.max()) + 1 if batch.groups is not None and len(batch) else 0)
    if updates > 1:
        minis, mismatch, spread = _take_old_logprobs(policy, minis, grpo, groups)
    loss_stats, grad_norms = LossStats(), []
    for _ in range(grpo.updates_per_batch):
        for mini in minis:
            optimizer.zero_grad(set_to_none=True)
            for micro in mini.micros:
                ref = micro.reference if updates > 1 else _reference(policy, micro.batch, grpo)
                if updates == 1:
                    logp, entropy = policy.logprobs_and_entropy(micro.batch)
                    spread = spread + entropy_stats(entropy, micro.batch.completion_mask)
                    groups.add(entropy, micro.batch)
                else:
                    logp = policy.logprobs(micro.batch)
                stats = _backward(logp, micro, ref, mini.normalizer, grpo, weighted)
                loss_stats = loss_stats + stats
                if updates == 1:
                    mismatch = mismatch + logprob_mismatch(
                        logp.detach(), micro.batch.behaviour_logprobs, micro.batch.completion_mask
                    )
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), grpo.max_grad_norm)
            grad_norms.append(float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm))
            optimizer.step()
    totals = _reduced(loss_stats, world_size, policy.device)
    merged = _reduced(mismatch, world_size, policy.device)
    entropy = _reduced(spread, world_size, policy.device)
    group_sums = torch.tensor(_all_reduce(groups.sums.flatten().tolist(), world_size, policy.device))
    return StepStats(
        loss=safe_div(totals.policy_loss_sum + grpo.kl_coef * totals.kl_sum, totals.token_count),
        kl=totals.mean_kl,
        clip_fraction=totals.clip_fraction,
        grad_norm=sum(grad_norms) / len(grad_norms),
        tokens=int(merged.token_count),
        mismatch=merged.mean_exp_abs_diff,
        mismatch_max=merged.max_abs_diff,
        gen_kl=merged.mean_kl,
        weight_mean=totals.mean_weight,
        weight_max=totals.weight_max,
        truncated_fraction=totals.truncated_fraction,
        weight_ess=totals.weight_ess,
        updates=updates,
        learning_rate=learning_rate,
        entropy=entropy.mean,
        entropy_group_mean=mean_of_group_means(group_sums.view(2, groups.num_groups)),
        grad_clipped=clipped_share(grad_norms, max_norm=grpo.max_grad_norm),
        clip_low=totals.clip_low_fraction,
        clip_high=totals.clip_high_fraction,
        clip_region=totals.clip_region_fraction,
    )


class _GroupSpread:
    """The entropy sums and token counts of each prompt group over the micro-batches (group_entropy_sums)."""

    def __init__(self, num_groups: int):
        self.num_groups = num_groups
        self.sums = torch.zeros(2, num_groups, dtype=torch.float64)

    def add(self, entropy: torch.Tensor, micro: Batch) -> None:
        if micro.groups is not None and self.num_groups:  # stand-ins have none (and no tokens)
            self.sums += group_entropy_sums(entropy, micro.completion_mask, micro.groups, self.num_groups)


def _take_old_logprobs(
    policy: Policy, minis: list[_MiniBatch], grpo: GRPOSpec, groups: _GroupSpread
) -> tuple[list[_MiniBatch], MismatchStats, EntropyStats]:
    """Before the first of several updates: every micro-batch's logprobs under the current weights (the proximal
    policy all updates are clipped around) and its reference logprobs, each once; the mismatch of the former
    with the sampler's, and the policy's entropy."""
    mismatch, spread = MismatchStats(), EntropyStats()
    taken = []
    for mini in minis:
        micros = []
        for micro in mini.micros:
            with torch.no_grad():
                old, entropy = policy.logprobs_and_entropy(micro.batch)
            spread = spread + entropy_stats(entropy, micro.batch.completion_mask)
            groups.add(entropy, micro.batch)
            micros.append(_Micro(micro.batch, old, _reference(policy, micro.batch, grpo)))
            mismatch = mismatch + logprob_mismatch(old, micro.batch.behaviour_logprobs, micro.batch.completion_mask)
        taken.append(_MiniBatch(micros, mini.normalizer))
    return taken, mismatch, spread


def _backward(
    logp: torch.Tensor, micro: _Micro, ref: torch.Tensor | None, normalizer: float, grpo: GRPOSpec, weighted: bool
) -> LossStats:
    # The proximal policy (the trust region's centre) is the trainer before the batch's first update: with one
    # update that is these very weights (ratio 1, the clip never binds; the behaviour weight corrects), with
    # several the old logprobs taken before the first.
    batch = micro.batch
    loss, stats = grpo_loss(
        logp,
        logp.detach() if micro.old is None else micro.old,
        ref,
        batch.advantages,
        batch.completion_mask,
        clip_epsilon=grpo.clip_low,
        clip_epsilon_high=grpo.clip_high,
        kl_coef=grpo.kl_coef,
        normalizer=normalizer,
        aggregation=grpo.loss_aggregation,
        ratio_level=grpo.importance_ratio,
        behaviour_logp=batch.behaviour_logprobs if weighted else None,
        weight_cap=grpo.importance_weight_cap,
        weight_mode=grpo.importance_weight_mode,
        weight_level=grpo.importance_weight_level,
        weight_floor=grpo.importance_weight_floor,
        clip_ratio_max=grpo.clip_ratio_max,
    )
    loss.backward()
    return stats


def _reduced(stats: _Stats, world_size: int, device: torch.device) -> _Stats:
    """`stats` of all ranks together: sums summed, maxima maxed."""
    values = stats.as_tensor().tolist()
    return type(stats).from_reduced(
        _all_reduce(values, world_size, device), _all_reduce(values, world_size, device, op="max")
    )
