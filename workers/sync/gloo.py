"""gloo transport: CPU tensors over TCP. Used when either role runs on CPUs."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from grpolora.workers.sync.transport import (
    PIECE_BYTES,
    Pending,
    Transport,
    TransportError,
    broadcast_options,
    sum_options,
)


class _GlooPending(Pending):
    def __init__(self, work: dist.Work | None, what: str, error: str | None = None):
        self._work, self._what, self._error = work, what, error

    def wait(self) -> None:
        error = self._error
        if error is None and self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as exc:
                error = f"gloo {self._what} failed: {exc}"
            self._work = None
        if error is not None:
            # Raised outside the handler so that no traceback keeps the group alive after close() (see there).
            raise TransportError(error)


class GlooTransport(Transport):
    piece_bytes = PIECE_BYTES

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        timeout_seconds: float,
        join_timeout_seconds: float,
        op_timeout_seconds: float | None = None,
    ):
        self.rank, self.world_size, self.device = rank, world_size, torch.device("cpu")
        self.store = store
        # Each collective of a round fails on its own after this (gloo starts its clock as the collective runs,
        # tcp/unbound_buffer.cc): closing the group cannot interrupt one in flight, so a round's watchdog alone
        # would leave the thread waiting on it until the group's timeout.
        self._op_timeout = None
        if op_timeout_seconds is not None:
            self._op_timeout = timedelta(seconds=min(op_timeout_seconds, timeout_seconds))
        try:
            # Formation waits at most the join timeout for every rank; collectives then get the sync timeout.
            group = dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=join_timeout_seconds))
        except RuntimeError as exc:
            raise TransportError(
                f"gloo group of {world_size} did not form within {join_timeout_seconds:g}s: {exc}"
            ) from exc
        group.set_timeout(timedelta(seconds=timeout_seconds))
        self._group: dist.ProcessGroupGloo | None = group

    def _group_or_fail(self) -> dist.ProcessGroupGloo:
        if self._group is None:
            raise TransportError("the group is closed")
        return self._group

    def start_broadcast(self, tensor: torch.Tensor, src: int = 0) -> Pending:
        options = broadcast_options(src, self._op_timeout)
        return self._start(lambda group: group.broadcast([tensor], options), "broadcast")

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        # Even the closing status keeps the per-collective progress bound here (so on CPU replicas an activation
        # must finish within progressTimeoutSeconds): ProcessGroupGloo's destructor waits, holding the GIL, for the
        # collectives still running on it, so a group closed around a long one would stall the whole process.
        options = sum_options(self._op_timeout)
        self._start(lambda group: group.allreduce([tensor], options), "all-reduce").wait()

    def _start(self, start, what: str) -> Pending:
        try:
            return _GlooPending(start(self._group_or_fail()), what)
        except (RuntimeError, TransportError) as exc:
            return _GlooPending(None, what, f"gloo {what} failed: {exc}")

    @property
    def closed(self) -> bool:
        return self._group is None

    def close(self) -> None:
        # Gloo has no abort that interrupts peers; destroying the group closes its TCP pairs, and peers blocked in
        # a collective with this rank then fail at once instead of after the timeout. So hold no other reference.
        self._group = None
