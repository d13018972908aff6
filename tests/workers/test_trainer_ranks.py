"""Several trainer ranks train one model: two gloo ranks with FSDP2 give the same update as one rank, and a
checkpoint written by sharded ranks restores exactly."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpolora.api.load import parse_job
from grpolora.workers.models import resolve_model
from grpolora.workers.trainer import checkpoint
from grpolora.workers.trainer.policy import Batch, Policy, build_batch
from grpolora.workers.trainer.step import make_optimizer, train_step
from tests.helpers import job_doc
from tests.workers.syncfakes import free_port

SPEC = parse_job(
    job_doc(
        model={"name": "offline:tiny-llama", "dtype": "float32"},
        lora={"rank": 8, "alpha": 16},
        # No gradient clipping: a clip to 1.0 would rescale a wrong gradient scale across ranks away.
        grpo={"learningRate": 1e-2, "microBatchSize": 2, "klCoef": 0.05, "temperature": 0.8, "maxGradNorm": 1e6},
        trainer={"gpusPerReplica": 0},
        inference={"gpusPerReplica": 0},
    )
).spec


def synthetic_batch(size: int = 6) -> Batch:
    g = torch.Generator().manual_seed(0)
    sequences, advantages = [], []
    for i in range(size):  # uneven lengths, so padding and the token-level normaliser matter
        prompt = torch.randint(5, 1000, (4 + i % 3,), generator=g).tolist()
        completion = torch.randint(5, 1000, (3 + 2 * (i % 2),), generator=g).tolist()
        sequences.append((prompt, completion, (-torch.rand(len(completion), generator=g)).tolist()))
        advantages.append(float(torch.randn(1, generator=g)))
    return build_batch(sequences, advantages, pad_id=0)


def lora_state(policy: Policy) -> dict[str, torch.Tensor]:
    from grpolora.workers.adapter import lora_tensors

    return {k: v.detach().cpu().clone() for k, v in lora_tensors(policy.model).items()}


# An odd count: rank 0 takes 3 sequences (two micro-batches of 2), rank 1 takes 2 (one), so rank 1 must take
# part in a second micro-batch's collectives with no sequence of its own.
SEQUENCES = 5


def _rank(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    try:
        policy = Policy(resolve_model("offline:tiny-llama"), SPEC, device=torch.device("cpu"), shard=True)
        optimizer = sgd(policy)
        stats = train_step(
            policy, optimizer, synthetic_batch(SEQUENCES), SPEC.grpo, on_policy=True, rank=rank, world_size=world_size
        )
        state = lora_state(policy)  # a collective: every rank gathers
        folder = Path(out) / "ckpt"
        checkpoint.save(folder, policy.model, optimizer, checkpoint.Progress(step=1, sync_round=1), keep=1)
        dist.barrier()
        fresh = Policy(resolve_model("offline:tiny-llama"), SPEC, device=torch.device("cpu"), shard=True)
        fresh_optimizer = sgd(fresh)
        progress = checkpoint.restore(checkpoint.latest(folder), fresh.model, fresh_optimizer)
        restored = lora_state(fresh)
        if rank == 0:
            torch.save(
                {"state": state, "stats": stats, "restored": restored, "step": progress.step},
                Path(out) / "two_ranks.pt",
            )
    finally:
        dist.destroy_process_group()


def sgd(policy: Policy) -> torch.optim.Optimizer:
    """SGD with lr 1: the first update is the (clipped) gradient itself (the momentum buffer starts as the gradient
    and gives the checkpoint some optimizer state to carry). Adam would hide a wrong gradient scale, since it
    normalises the update, which is exactly what the rank-equivalence test must catch."""
    return torch.optim.SGD(policy.trainable_parameters(), lr=1.0, momentum=0.9)


@pytest.fixture(scope="module")
def one_rank():
    policy = Policy(resolve_model("offline:tiny-llama"), SPEC, device=torch.device("cpu"))
    before = lora_state(policy)
    optimizer = sgd(policy)
    stats = train_step(policy, optimizer, synthetic_batch(SEQUENCES), SPEC.grpo, on_policy=True)
    return before, lora_state(policy), stats


def test_two_fsdp_ranks_give_the_same_update_as_one(one_rank, tmp_path):
    before, after_one, stats_one = one_rank
    mp.start_processes(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    result = torch.load(tmp_path / "two_ranks.pt", weights_only=False)
    after_two, stats_two = result["state"], result["stats"]
    assert after_two.keys() == after_one.keys()
    moved = max((after_one[k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-3  # the step really changed the adapter, so agreement below means something
    worst = max((after_two[k] - after_one[k]).abs().max().item() for k in after_one)
    assert worst < 1e-4 * moved, f"two ranks differ from one by {worst} (the update is {moved})"
    # The gradient before any clipping: a scale error across ranks (a lost `/ world_size`, a per-micro-batch
    # normaliser) shows here even where the update would hide it.
    assert stats_two.grad_norm == pytest.approx(stats_one.grad_norm, rel=1e-4)
    assert stats_two.tokens == stats_one.tokens
    assert stats_two.loss == pytest.approx(stats_one.loss, rel=1e-4, abs=1e-6)
    assert stats_two.kl == pytest.approx(stats_one.kl, rel=1e-4, abs=1e-7)
    # The sharded checkpoint restores the very same adapter.
    assert result["step"] == 1
    assert all(torch.equal(result["restored"][k], after_two[k]) for k in after_two)


def test_single_rank_checkpoint_round_trip(one_rank, tmp_path):
    policy = Policy(resolve_model("offline:tiny-llama"), SPEC, device=torch.device("cpu"))
    optimizer = make_optimizer(policy, SPEC.grpo)
    train_step(policy, optimizer, synthetic_batch(), SPEC.grpo, on_policy=True)
    checkpoint.save(
        tmp_path,
        policy.model,
        optimizer,
        checkpoint.Progress(step=7, sync_round=9, epoch=2, prompts_consumed=28),
        keep=2,
    )
    fresh = Policy(resolve_model("offline:tiny-llama"), SPEC, device=torch.device("cpu"))
    fresh_optimizer = make_optimizer(fresh, SPEC.grpo)
    progress = checkpoint.restore(checkpoint.latest(tmp_path), fresh.model, fresh_optimizer)
    assert (progress.step, progress.sync_round, progress.epoch, progress.prompts_consumed) == (7, 9, 2, 28)
    saved, restored = lora_state(policy), lora_state(fresh)
    assert all(torch.equal(saved[k], restored[k]) for k in saved)
    assert fresh_optimizer.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()
    # A second step from either gives the same result: the optimizer moments came back too.
    train_step(policy, optimizer, synthetic_batch(), SPEC.grpo, on_policy=True)
    train_step(fresh, fresh_optimizer, synthetic_batch(), SPEC.grpo, on_policy=True)
    again, again_fresh = lora_state(policy), lora_state(fresh)
    assert all(torch.allclose(again[k], again_fresh[k], atol=1e-6) for k in again)


def test_old_checkpoints_are_pruned_and_a_partial_one_is_ignored(one_rank, tmp_path):
    policy = Policy(resolve_model("offline:tiny-llama"), SPEC, device=torch.device("cpu"))
    optimizer = make_optimizer(policy, SPEC.grpo)
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, policy.model, optimizer, checkpoint.Progress(step=step), keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000003"]
    (tmp_path / "step-00000009").mkdir()  # a folder without its state file: a crash mid-write
    assert checkpoint.latest(tmp_path).name == "step-00000003"
