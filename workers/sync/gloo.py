"""gloo transport: CPU tensors over TCP. Used when either role runs on CPUs."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from grpolora.workers.sync.transport import Transport, TransportError


class GlooTransport(Transport):
    def __init__(self, store: dist.Store, *, rank: int, world_size: int, timeout_seconds: float):
        self.rank, self.world_size, self.device = rank, world_size, torch.device("cpu")
        try:
            self._group: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(
                store, rank, world_size, timedelta(seconds=timeout_seconds)
            )
        except RuntimeError as exc:
            raise TransportError(f"gloo group of {world_size} did not form: {exc}") from exc

    def _group_or_fail(self) -> dist.ProcessGroupGloo:
        if self._group is None:
            raise TransportError("the group is closed")
        return self._group

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        self._run(lambda group: group.broadcast([tensor], options), "broadcast")

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        self._run(lambda group: group.allreduce([tensor], options), "all-reduce")

    def _run(self, start, what: str) -> None:
        error = None
        try:
            start(self._group_or_fail()).wait()
        except RuntimeError as exc:
            error = f"gloo {what} failed: {exc}"
        if error is not None:
            # Raised outside the handler so that no traceback keeps the group alive after close() (see there).
            raise TransportError(error)

    def close(self) -> None:
        # Gloo has no abort that interrupts peers; destroying the group closes its TCP pairs, and peers blocked in
        # a collective with this rank then fail at once instead of after the timeout. So hold no other reference.
        self._group = None
