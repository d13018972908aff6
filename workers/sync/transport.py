"""The transport interface: the three collectives a sync round needs, over a group outside the default one.

Each group is built on the rendezvous store hosted by trainer rank 0, under the key prefix `epoch/<n>/`, so a
re-formed group never meets stale keys of an earlier epoch. Transports are created per epoch and closed when
the group re-forms; they never touch torch.distributed's default process group (which the trainer ranks use).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

Backend = Literal["gloo", "nccl"]
# Large enough for full TCP (or NVLink) throughput, small enough that a receiver copies to the host and MACs one piece
# while the next arrives (one 87 MB piece made those run one after another).
PIECE_BYTES = 4 << 20


class TransportError(RuntimeError):
    """A collective failed or timed out (a peer died, hung or left)."""


class Pending(ABC):
    """A collective in flight."""

    @abstractmethod
    def wait(self) -> None:
        """Raises TransportError on failure or timeout."""


class Transport(ABC):
    """One rank's handle on one epoch of the sync group."""

    rank: int
    world_size: int
    device: torch.device
    # Buffers travel in pieces of at most this many bytes, several in flight at once, so that a receiver checks
    # one piece while the next arrives. None: one piece per buffer.
    piece_bytes: int | None = None

    @abstractmethod
    def start_broadcast(self, tensor: torch.Tensor, src: int = 0) -> Pending:
        """Start an in-place broadcast; operations complete in the order they were started on every rank."""

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In place on every rank; raises TransportError on failure or timeout."""
        self.start_broadcast(tensor, src).wait()

    def pieces(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        if self.piece_bytes is None or buffer.numel() <= self.piece_bytes:
            return [buffer]
        return list(buffer.split(self.piece_bytes))

    @abstractmethod
    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """In place on every rank; raises TransportError on failure or timeout."""

    @abstractmethod
    def close(self) -> None:
        """Leave the group; safe to call after a failure."""


def broadcast_options(src: int, timeout: timedelta | None = None) -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = src, 0
    if timeout is not None:
        options.timeout = timeout
    return options


def sum_options(timeout: timedelta | None = None) -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM
    if timeout is not None:
        options.timeout = timeout
    return options


def epoch_store(store: dist.Store, epoch: int) -> dist.Store:
    return dist.PrefixStore(f"epoch/{epoch}/", store)


def connect_store(addr: str, port: int, *, is_master: bool, timeout_seconds: float) -> dist.TCPStore:
    """The rendezvous store: trainer rank 0 hosts it for the whole run; receivers connect per epoch."""
    return dist.TCPStore(
        addr,
        port,
        None,
        is_master,
        timedelta(seconds=timeout_seconds),
        wait_for_workers=False,
    )
