"""Two gloo trainer ranks with FSDP2, started once for the whole session: spawning them (each imports torch,
transformers and peft and loads the model) costs far more than what they compute, so one pair of processes does
what several tests check — the rank-equivalence of an update (test_trainer_ranks.py), a sharded checkpoint's
round trip, and a sharded restore refusing an adapter that does not fit (test_checkpoint.py). Each rank writes
what it saw to files; the tests read them (the `two_ranks` fixture in conftest.py)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from grpolora.api.load import parse_job
from grpolora.workers.adapter import WEIGHTS_FILE
from grpolora.workers.environments.episode import EpisodeTokens
from grpolora.workers.models import resolve_model
from grpolora.workers.trainer import checkpoint
from grpolora.workers.trainer.policy import Batch, Policy, build_batch
from grpolora.workers.trainer.scoring import with_loss_masks
from grpolora.workers.trainer.step import train_step
from tests.helpers import job_doc


def spec_with(**grpo):
    """The tests' spec with these grpo fields."""
    return parse_job(
        job_doc(
            model={"name": "offline:tiny-llama", "dtype": "float32"},
            lora={"rank": 8, "alpha": 16},
            # No gradient clipping: a clip to 1.0 would rescale a wrong gradient scale across ranks away.
            grpo={
                "learningRate": 1e-2,
                "microBatchSize": 2,
                "klCoef": 0.05,
                "temperature": 0.8,
                "maxGradNorm": 1e6,
                **grpo,
            },
            trainer={"gpusPerReplica": 0},
            inference={"gpusPerReplica": 0},
        )
    ).spec


SPEC = spec_with()
# Recipes whose step touches the cross-rank reduction, each also run on the two ranks (name -> (grpo, on_policy)):
# several updates over mini-batches (the old logprobs taken once; micro-batches by a 16-token budget, so the
# ranks' counts differ and stand-ins fill in) with a narrow clip-higher range so the clip binds, sequence-level
# ratios and the per-sequence mean, off-policy (behaviour weights truncated at a low cap); and Dr. GRPO's
# constant normaliser over 3 mini-batches of 2, 2 and 1 sequences (rank 1 runs a stand-in in the last),
# on-policy with the mismatch correction masking the tokens past a low cap. Both sample from behaviour logprobs
# near the policy's own (`off_policy`).
RECIPES = {
    "updates": (
        spec_with(
            updatesPerBatch=2,
            miniBatches=2,
            clipEpsilonLow=0.002,
            clipEpsilonHigh=0.003,
            importanceRatio="sequence",
            lossAggregation="sequence-mean",
            importanceWeightCap=1.5,
            microBatchTokens=16,
        ).grpo,
        False,
    ),
    "constant": (
        spec_with(
            miniBatches=3,
            lossAggregation="constant",
            maxNewTokens=8,
            mismatchCorrection=True,
            importanceWeightMode="mask",
            importanceWeightCap=1.2,
        ).grpo,
        True,
    ),
}
# Multi-turn episodes (spec.environment, issue 39) on the "updates" recipe: each sample is assistant tokens, an
# environment's turn and assistant tokens again, the environment's masked out of the loss (episode_batch).
RECIPES["episodes"] = RECIPES["updates"]
# Several SGD steps of lr 1 on one batch diverge (the first already moves logprobs by tens of nats; the k3 KL then
# explodes); at 1e-4 the adapter still moves by more than 1e-3 and the clip binds in the second pass.
RECIPE_LR = 1e-4
RECIPE_FILE = "recipes.pt"  # rank 0's update and stats for each recipe


def off_policy(policy: Policy, batch: Batch) -> Batch:
    """`batch` with behaviour logprobs near the policy's own (as a sampler one version behind gives them), so
    that the behaviour weights are near 1 and some are truncated."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        own = policy.logprobs(batch)
    noise = 0.3 * torch.randn(own.shape, generator=g)
    return dataclasses.replace(batch, behaviour_logprobs=(own + noise) * batch.completion_mask)


def recipe_step(name: str, rank: int = 0, world_size: int = 1):
    """A fresh policy's step under recipe `name`: its adapter before and after, and the step's figures."""
    grpo, on_policy = RECIPES[name]
    policy = new_policy(shard=world_size > 1)
    before = lora_state(policy)
    batch = episode_batch(SEQUENCES) if name == "episodes" else synthetic_batch(SEQUENCES)
    if world_size > 1:
        batch = with_reference(policy, batch)
    batch = off_policy(policy, batch)
    optimizer = sgd(policy, RECIPE_LR)
    stats = train_step(policy, optimizer, batch, grpo, on_policy=on_policy, rank=rank, world_size=world_size)
    return before, lora_state(policy), stats


# An odd count: rank 0 takes 3 sequences (two micro-batches of 2), rank 1 takes 2 (one), so rank 1 must take
# part in a second micro-batch's collectives with no sequence of its own.
SEQUENCES = 5
RESULT_FILE = "two_ranks.pt"  # rank 0's update, stats and restored adapter


def outcome_file(rank: int) -> str:
    """What restoring the checkpoint with a renamed tensor did on `rank`."""
    return f"renamed-restore-rank-{rank}.txt"


def new_policy(shard: bool = False) -> Policy:
    return Policy(resolve_model("offline:tiny-llama"), SPEC, device=torch.device("cpu"), shard=shard)


def synthetic_batch(size: int = 6) -> Batch:
    g = torch.Generator().manual_seed(0)
    sequences, advantages = [], []
    for i in range(size):  # uneven lengths, so padding and the token-level normaliser matter
        prompt = torch.randint(5, 1000, (4 + i % 3,), generator=g).tolist()
        completion = torch.randint(5, 1000, (3 + 2 * (i % 2),), generator=g).tolist()
        sequences.append((prompt, completion, (-torch.rand(len(completion), generator=g)).tolist()))
        advantages.append(float(torch.randn(1, generator=g)))
    # Groups of 2 (the last may be 1) of uneven lengths: the mean of group means differs from the token mean.
    return dataclasses.replace(build_batch(sequences, advantages, pad_id=0), groups=torch.arange(size) // 2)


def episode_batch(size: int) -> Batch:
    """Episodes as the runner leaves them (EpisodeTokens): an assistant turn, an environment's turn, an assistant
    turn, of uneven lengths; the environment's tokens have logprob 0 and are masked out (scoring.with_loss_masks)."""
    g = torch.Generator().manual_seed(2)
    sequences, advantages, openings, masks = [], [], [], []
    for i in range(size):
        episode = EpisodeTokens(torch.randint(5, 1000, (4 + i % 3,), generator=g).tolist())
        for turn, length in enumerate((2 + i % 2, 3 - i % 2)):
            ids = torch.randint(5, 1000, (length,), generator=g).tolist()
            episode.add_assistant(ids, (-torch.rand(length, generator=g)).tolist(), None)
            if turn == 0:
                episode.add_environment(torch.randint(5, 1000, (2 + i % 3,), generator=g).tolist())
        sequences.append((episode.opening, episode.tokens, episode.logprobs))
        advantages.append(float(torch.randn(1, generator=g)))
        openings.append(len(episode.opening))
        masks.append(episode.mask)
    return with_loss_masks(build_batch(sequences, advantages, pad_id=0), openings, masks)


def with_reference(policy: Policy, batch: Batch) -> Batch:
    """`batch` carrying its reference logprobs, as the replicas give them with grpo.referenceFrom: inference (here
    from the policy's own reference pass, so a step on it must equal a step that computes them)."""
    with torch.no_grad(), policy.reference():
        reference = policy.logprobs(batch) * batch.completion_mask
    return dataclasses.replace(batch, reference_logprobs=reference)


def lora_state(policy: Policy) -> dict[str, torch.Tensor]:
    from grpolora.workers.adapter import lora_tensors

    return {k: v.detach().cpu().clone() for k, v in lora_tensors(policy.model).items()}


def sgd(policy: Policy, lr: float = 1.0) -> torch.optim.Optimizer:
    """SGD with lr 1: the first update is the (clipped) gradient itself (the momentum buffer starts as the gradient
    and gives the checkpoint some optimizer state to carry). Adam would hide a wrong gradient scale, since it
    normalises the update, which is exactly what the rank-equivalence test must catch."""
    return torch.optim.SGD(policy.trainable_parameters(), lr=lr, momentum=0.9)


def tamper(folder: Path, target: Path, edit) -> Path:
    """A copy of checkpoint `folder` at `target` whose adapter tensors went through `edit`."""
    shutil.copytree(folder, target)
    weights = target / checkpoint.ADAPTER_DIR / WEIGHTS_FILE
    save_file(edit(load_file(str(weights))), str(weights))
    return target


def renamed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    first = sorted(tensors)[0]
    return {(k.replace("layers.0.", "layers.1000.") if k == first else k): v for k, v in tensors.items()}


def sharded_rank(rank: int, world_size: int, port: int, out: str) -> None:
    """One rank: a training step on its share of the batch (reference logprobs given), a sharded checkpoint
    restored into a fresh policy, then the same checkpoint with one tensor renamed, which must be refused."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    try:
        policy = new_policy(shard=True)
        optimizer = sgd(policy)
        # The reference logprobs come with the batch (grpo.referenceFrom: inference): rank 1's stand-in micro-batch
        # must then skip the reference pass as rank 0's real one does, or their FSDP all-gathers no longer pair up.
        batch = with_reference(policy, synthetic_batch(SEQUENCES))
        stats = train_step(policy, optimizer, batch, SPEC.grpo, on_policy=True, rank=rank, world_size=world_size)
        state = lora_state(policy)  # a collective: every rank gathers
        folder = checkpoint.save(Path(out) / "ckpt", policy.model, optimizer, checkpoint.Progress(step=1, version=1), 1)
        dist.barrier()
        fresh = new_policy(shard=True)
        fresh_optimizer = sgd(fresh)
        progress = checkpoint.restore(checkpoint.latest(Path(out) / "ckpt"), fresh.model, fresh_optimizer)
        restored = lora_state(fresh)
        if rank == 0:
            torch.save(
                {"state": state, "stats": stats, "restored": restored, "step": progress.step}, Path(out) / RESULT_FILE
            )
            tamper(folder, Path(out) / "renamed", renamed)
        dist.barrier()
        try:
            checkpoint.restore(Path(out) / "renamed", policy.model, optimizer)
            outcome = "loaded"
        except ValueError as exc:
            outcome = str(exc)
        (Path(out) / outcome_file(rank)).write_text(outcome)
        recipes = {name: recipe_step(name, rank, world_size) for name in RECIPES}
        if rank == 0:
            torch.save(recipes, Path(out) / RECIPE_FILE)
    finally:
        dist.destroy_process_group()
