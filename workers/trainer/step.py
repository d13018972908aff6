"""One GRPO optimizer step on one trainer rank: its shard of the batch, in micro-batches, then the update.

Every rank normalises its loss by the completion-token count of the WHOLE step (all ranks, all micro-batches),
so accumulating micro-batches and reducing gradients over ranks gives exactly the token-level mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from grpolora.api.spec import GRPOSpec
from grpolora.workers.trainer.grpo import LossStats, MismatchStats, grpo_loss, logprob_mismatch, safe_div
from grpolora.workers.trainer.policy import Batch, Policy

_Stats = TypeVar("_Stats", LossStats, MismatchStats)


@dataclass(frozen=True)
class StepStats:
    loss: float
    kl: float  # mean k3 KL to the reference per completion token
    clip_fraction: float
    grad_norm: float
    tokens: int
    mismatch: float  # mean exp(|logp_trainer - logp_sampler|) - 1 (trainer before the update)
    mismatch_max: float
    gen_kl: float  # k3 estimate of KL(sampler || trainer)
    weight_mean: float = 0.0  # behaviour importance weight pi_trainer / pi_sampler, mean over tokens (off-policy)
    weight_max: float = 0.0  # ... and its largest value, both before truncation
    truncated_fraction: float = 0.0  # share of off-policy tokens whose weight was cut to grpo.importanceWeightCap


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


def make_optimizer(policy: Policy, grpo: GRPOSpec) -> torch.optim.Optimizer:
    return torch.optim.AdamW(policy.trainable_parameters(), lr=grpo.learning_rate, weight_decay=grpo.weight_decay)


def _all_reduce(values: list[float], world_size: int, device: torch.device, op: str = "sum") -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor.tolist()


def train_step(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    grpo: GRPOSpec,
    *,
    on_policy: bool,
    rank: int = 0,
    world_size: int = 1,
) -> StepStats:
    """`on_policy`: the batch was sampled from the current weights, so the loss is the plain clipped surrogate
    around the trainer's own logprobs (ratio exactly 1, gradient of log pi). Otherwise (grpo.maxStaleness > 0,
    syncEverySteps > 1, a replica that served another version) the decoupled objective weights each token by
    pi_trainer / pi_sampler (the sampler's behaviour logprobs), truncated at grpo.importanceWeightCap. The KL
    term's reference logprobs come with the batch where the replicas computed them (grpo.referenceFrom: inference),
    else from a reference pass (adapter off) per micro-batch."""
    local = shard(batch, rank, world_size).by_length().to(policy.device)
    (total_tokens,) = _all_reduce([float(local.completion_mask.sum())], world_size, policy.device)
    # FSDP averages gradients over ranks: normalising by tokens / world_size makes that average the global
    # token-level mean (see grpo_loss).
    normalizer = max(total_tokens, 1.0) / world_size
    policy.model.train()
    optimizer.zero_grad(set_to_none=True)
    loss_stats, mismatch = LossStats(), MismatchStats()
    size = grpo.micro_batch_size
    # Every rank runs the same number of micro-batches (FSDP's collectives must match); a rank with fewer
    # sequences runs a stand-in that contributes nothing.
    (micro_batches,) = _all_reduce([float(math.ceil(len(local) / size))], world_size, policy.device, op="max")
    has_reference = local.reference_logprobs is not None  # the same on every rank: they get one batch
    for index in range(int(micro_batches)):
        micro = local.select(slice(index * size, (index + 1) * size))
        micro = micro.trimmed() if len(micro) else Batch.stand_in(policy.device, reference=has_reference)
        ref = micro.reference_logprobs  # the replicas' (grpo.referenceFrom: inference): no reference pass here
        if ref is None and grpo.kl_coef > 0:
            with torch.no_grad(), policy.reference():
                ref = policy.logprobs(micro)
        logp = policy.logprobs(micro)
        # One optimizer step per batch: the proximal policy (the trust region's centre) is the trainer's own
        # weights before the step, so the ratio is 1 and the clip never binds; the behaviour weight corrects.
        loss, stats = grpo_loss(
            logp,
            logp.detach(),
            ref,
            micro.advantages,
            micro.completion_mask,
            clip_epsilon=grpo.clip_epsilon,
            kl_coef=grpo.kl_coef,
            token_normalizer=normalizer,
            behaviour_logp=None if on_policy else micro.behaviour_logprobs,
            weight_cap=grpo.importance_weight_cap,
        )
        loss.backward()
        loss_stats = loss_stats + stats
        mismatch = mismatch + logprob_mismatch(logp.detach(), micro.behaviour_logprobs, micro.completion_mask)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), grpo.max_grad_norm)
    optimizer.step()
    totals = _reduced(loss_stats, world_size, policy.device)
    merged = _reduced(mismatch, world_size, policy.device)
    return StepStats(
        loss=safe_div(totals.policy_loss_sum + grpo.kl_coef * totals.kl_sum, totals.token_count),
        kl=totals.mean_kl,
        clip_fraction=totals.clip_fraction,
        grad_norm=float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
        tokens=int(totals.token_count),
        mismatch=merged.mean_exp_abs_diff,
        mismatch_max=merged.max_abs_diff,
        gen_kl=merged.mean_kl,
        weight_mean=totals.mean_weight,
        weight_max=totals.weight_max,
        truncated_fraction=totals.truncated_fraction,
    )


def _reduced(stats: _Stats, world_size: int, device: torch.device) -> _Stats:
    """`stats` of all ranks together: sums summed, maxima maxed."""
    values = stats.as_tensor().tolist()
    return type(stats).from_reduced(
        _all_reduce(values, world_size, device), _all_reduce(values, world_size, device, op="max")
    )
