"""NCCL transport: GPU tensors over NVLink/InfiniBand/TCP. Used when both roles have GPUs.

A ProcessGroupNCCL built directly on the epoch's store: a communicator of its own, outside torch.distributed's
default group (which the trainer ranks use for FSDP), with NCCL's own timeout watchdog, and `abort()` to tear it
down when a peer is lost so that the group can re-form under the next epoch.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist

from grpolora.workers.sync.transport import Pending, Transport, TransportError, broadcast_options, sum_options


class _NcclPending(Pending):
    def __init__(self, work: dist.Work, device: torch.device, what: str):
        self._work, self._device, self._what = work, device, what

    def wait(self) -> None:
        try:
            self._work.wait()
            torch.cuda.current_stream(self._device).synchronize()
        except RuntimeError as exc:
            raise TransportError(f"NCCL {self._what} failed: {exc}") from exc


class NcclTransport(Transport):
    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        timeout_seconds: float,
        device: torch.device | None,
    ):
        if not torch.cuda.is_available():
            raise TransportError("the nccl sync backend needs a GPU in this process; use gloo on CPUs")
        self.rank, self.world_size = rank, world_size
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_seconds)
        options.is_high_priority_stream = True  # sync overlaps with generation on inference GPUs
        try:
            self._group: dist.ProcessGroupNCCL | None = dist.ProcessGroupNCCL(store, rank, world_size, options)
            # NCCL communicators are created lazily; a first tiny collective makes "formed" mean formed.
            self.all_reduce_sum(torch.zeros(1, device=self.device))
        except RuntimeError as exc:
            raise TransportError(f"NCCL group of {world_size} did not form: {exc}") from exc

    def _group_or_fail(self) -> dist.ProcessGroupNCCL:
        if self._group is None:
            raise TransportError("the group is closed")
        return self._group

    def start_broadcast(self, tensor: torch.Tensor, src: int = 0) -> Pending:
        options = broadcast_options(src)
        try:
            return _NcclPending(self._group_or_fail().broadcast([tensor], options), self.device, "broadcast")
        except RuntimeError as exc:
            raise TransportError(f"NCCL broadcast failed: {exc}") from exc

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        options = sum_options()
        try:
            work = self._group_or_fail().allreduce([tensor], options)
        except RuntimeError as exc:
            raise TransportError(f"NCCL all-reduce failed: {exc}") from exc
        _NcclPending(work, self.device, "all-reduce").wait()

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(RuntimeError):
                group.abort()  # frees a communicator that may be stuck on a dead peer
