"""The trainer ranks' protocol: rank 0 decides, every rank follows in one order.

Each step rank 0 broadcasts one Instruction (train on a batch, gather the adapter, checkpoint, stop) on a side
channel of its own; every rank does them in that order, so the collectives of the step (FSDP's all-gathers, the
adapter gather, the checkpoint) always meet. Ranks > 0 run `run_follower` until told to stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from grpolora.api.spec import GRPOLoraJobSpec
from grpolora.workers import adapter as adapter_io
from grpolora.workers.trainer import checkpoint
from grpolora.workers.trainer.checkpoint import Progress
from grpolora.workers.trainer.policy import Batch, Policy
from grpolora.workers.trainer.step import make_optimizer, train_step, with_schedule_base


@dataclass
class Instruction:
    """What rank 0 tells every rank to do next (broadcast as one object). Every rank does it in this order:
    train on `batch`, gather the full adapter (a collective; rank 0 then sends or saves it), checkpoint, stop."""

    batch: Batch | None = None
    on_policy: bool = True
    step: int = 0
    """The training step `batch` is (0-based): its learning rate under grpo.lrSchedule."""
    gather: bool = False
    checkpoint: bool = False
    stop: bool = False


@dataclass
class TrainerContext:
    spec: GRPOLoraJobSpec
    policy: Policy
    rank: int
    world_size: int
    checkpoint_dir: Path
    output_dir: Path
    instructions: dist.ProcessGroup | None = None
    """Where rank 0's instructions travel (instruction_group); None with one rank."""
    optimizer: torch.optim.Optimizer = field(init=False)
    progress: Progress = field(default_factory=Progress)

    def __post_init__(self) -> None:
        self.optimizer = make_optimizer(self.policy, self.spec.grpo)

    def resume(self) -> None:
        found = checkpoint.latest(self.checkpoint_dir)
        if found is not None:
            self.progress = checkpoint.restore(found, self.policy.model, self.optimizer)
            with_schedule_base(self.optimizer, self.spec.grpo.learning_rate)

    def save(self) -> None:
        checkpoint.save(
            self.checkpoint_dir, self.policy.model, self.optimizer, self.progress, keep=self.spec.checkpoint.keep
        )


# How long a follower waits for rank 0's next instruction. Rank 0 works alone for long stretches between two
# instructions (forming the sync group at start, up to main.STARTUP_WAIT_SECONDS plus the join timeout, or again
# when every replica was lost, up to sender.REPLACEMENT_WAIT_SECONDS; generating, scoring, evaluating, retrying a
# sync), so this bound is not the collectives' timeout (10 minutes for NCCL, after which its watchdog aborts the
# process): it only has to catch a rank 0 that is hung, not one that has died (gloo sees the peer's socket close at
# once).
INSTRUCTION_TIMEOUT = timedelta(hours=24)


def instruction_group(world_size: int) -> dist.ProcessGroup | None:
    """The side channel rank 0's instructions travel on: a gloo group of all trainer ranks with its own long
    timeout, next to the default group (NCCL on GPUs) that the step's collectives use. Every rank creates it
    right after init_process_group, together."""
    if world_size == 1:
        return None
    return dist.new_group(backend="gloo", timeout=INSTRUCTION_TIMEOUT)


def broadcast_instruction(
    instruction: Instruction | None, world_size: int, group: dist.ProcessGroup | None
) -> Instruction:
    """Rank 0 sends `instruction`; every other rank passes None and waits on `group` (instruction_group) for it."""
    if world_size == 1:
        assert instruction is not None
        return instruction
    holder = [instruction]
    dist.broadcast_object_list(holder, src=0, group=group)
    return holder[0]


def run_follower(ctx: TrainerContext) -> None:
    """Trainer ranks > 0: do what rank 0 says until it says stop, in the order Instruction documents."""
    while True:
        instruction = broadcast_instruction(None, ctx.world_size, ctx.instructions)
        if instruction.batch is not None:
            train_step(
                ctx.policy,
                ctx.optimizer,
                instruction.batch,
                ctx.spec.grpo,
                on_policy=instruction.on_policy,
                rank=ctx.rank,
                world_size=ctx.world_size,
                step=instruction.step,
            )
        if instruction.gather:
            adapter_io.lora_tensors(ctx.policy.model)  # the gather is collective; rank 0 sends or saves the result
        if instruction.checkpoint:
            ctx.save()
        if instruction.stop:
            return
