"""One GRPO optimizer step on one trainer rank: its shard of the batch, in micro-batches, then the update.

Every rank normalises its loss by the completion-token count of the WHOLE step (all ranks, all micro-batches),
so accumulating micro-batches and summing gradients over ranks gives exactly the token-level mean. FSDP
averages gradients over ranks, so each rank's loss is scaled by the world size to turn that average into the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from grpolora.api.spec import GRPOSpec
from grpolora.workers.trainer.grpo import grpo_loss, logprob_mismatch
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


def _all_reduce(values: list[float], world_size: int, device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(tensor)
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
    local = shard(batch, rank, world_size).to(policy.device)
    (total_tokens,) = _all_reduce([float(local.completion_mask.sum())], world_size, policy.device)
    normalizer = max(total_tokens, 1.0)
    policy.model.train()
    optimizer.zero_grad(set_to_none=True)
    sums = {"loss": 0.0, "kl": 0.0, "clipped": 0.0, "mismatch": 0.0, "mismatch_max": 0.0, "gen_kl": 0.0}
    size = grpo.micro_batch_size
    for start in range(0, max(len(local), 1), size):
        micro = local.select(slice(start, start + size))
        if len(micro) == 0:
            # A rank with no sequences still runs forward/backward so that FSDP's collectives stay matched.
            micro = local.select(slice(0, 0)) if len(local) else _empty_like(batch, policy.device)
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
        (loss * world_size).backward()
        mismatch = logprob_mismatch(logp.detach(), micro.behaviour_logprobs, micro.completion_mask)
        sums["loss"] += float(loss.detach())
        sums["kl"] += stats.kl_sum
        sums["clipped"] += stats.clipped_tokens
        sums["mismatch"] += mismatch.mismatch * mismatch.tokens
        sums["gen_kl"] += mismatch.gen_kl * mismatch.tokens
        sums["mismatch_max"] = max(sums["mismatch_max"], mismatch.max_abs_delta)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), grpo.max_grad_norm)
    optimizer.step()
    keys = ["loss", "kl", "clipped", "mismatch", "gen_kl"]
    totals = dict(zip(keys, _all_reduce([sums[k] for k in keys], world_size, policy.device), strict=True))
    return StepStats(
        loss=totals["loss"],
        kl=totals["kl"] / normalizer,
        clip_fraction=totals["clipped"] / normalizer,
        grad_norm=float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
        tokens=int(total_tokens),
        mismatch=totals["mismatch"] / normalizer,
        mismatch_max=sums["mismatch_max"],
        gen_kl=totals["gen_kl"] / normalizer,
    )


def _empty_like(batch: Batch, device: torch.device) -> Batch:
    return batch.select(slice(0, 0)).to(device)
