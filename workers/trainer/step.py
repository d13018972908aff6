"""One GRPO optimizer step on one trainer rank: its shard of the batch, in micro-batches, then the update.

Every rank normalises its loss by the completion-token count of the WHOLE step (all ranks, all micro-batches),
so accumulating micro-batches and reducing gradients over ranks gives exactly the token-level mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from grpolora.api.spec import GRPOSpec
from grpolora.workers.trainer.grpo import LossStats, MismatchStats, grpo_loss, logprob_mismatch
from grpolora.workers.trainer.policy import Batch, Policy


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
    """`on_policy`: the batch was sampled from the current weights (sequential mode), so the importance ratio is
    taken against the trainer's own logprobs (exactly 1, gradient of log pi); otherwise (pipelined, one step
    behind) against the sampler's behaviour logprobs."""
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
    for index in range(int(micro_batches)):
        micro = local.select(slice(index * size, (index + 1) * size))
        micro = micro.trimmed() if len(micro) else Batch.stand_in(policy.device)
        ref = None
        if grpo.kl_coef > 0:
            with torch.no_grad(), policy.reference():
                ref = policy.logprobs(micro)
        logp = policy.logprobs(micro)
        behaviour = logp.detach() if on_policy else micro.behaviour_logprobs
        loss, stats = grpo_loss(
            logp,
            behaviour,
            ref,
            micro.advantages,
            micro.completion_mask,
            clip_epsilon=grpo.clip_epsilon,
            kl_coef=grpo.kl_coef,
            token_normalizer=normalizer,
        )
        loss.backward()
        loss_stats = loss_stats + stats
        mismatch = mismatch + logprob_mismatch(logp.detach(), micro.behaviour_logprobs, micro.completion_mask)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), grpo.max_grad_norm)
    optimizer.step()
    totals = LossStats(*_all_reduce(loss_stats.as_tensor().tolist(), world_size, policy.device))
    mismatch_sums = _all_reduce(
        [mismatch.token_count, mismatch.exp_abs_diff_sum, mismatch.kl_sum], world_size, policy.device
    )
    (mismatch_max,) = _all_reduce([mismatch.max_abs_diff], world_size, policy.device, op="max")
    merged = MismatchStats(mismatch_sums[0], mismatch_sums[1], mismatch_max, mismatch_sums[2])
    return StepStats(
        loss=_safe(totals.policy_loss_sum + grpo.kl_coef * totals.kl_sum, totals.token_count),
        kl=totals.mean_kl,
        clip_fraction=totals.clip_fraction,
        grad_norm=float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
        tokens=int(totals.token_count),
        mismatch=merged.mean_exp_abs_diff,
        mismatch_max=merged.max_abs_diff,
        gen_kl=merged.mean_kl,
    )


def _safe(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0
