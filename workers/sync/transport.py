"""The transport interface: the three collectives a sync round needs, over a group outside the default one, and the
round's header, which goes through the group's store instead.

Each group is built on the rendezvous store hosted by trainer rank 0, under the key prefix `epoch/<n>/`, so a
re-formed group never meets stale keys of an earlier epoch. Transports are created per epoch and closed when
the group re-forms; they never touch torch.distributed's default process group (which the trainer ranks use).

Why the header goes through the store (TCP) and not the group: a receiver is told of a round (prepare) before the
sender commits to it, and the sender may never do so (another member's prepare failed, the trainer died while it
packed). A collective posted then (NCCL: a kernel waiting on the member's stream in vLLM's process) would hold every
device-wide synchronisation of vLLM's (`empty_cache`, `synchronize`) until the round's watchdog or the next join cut
it. Waiting on the store posts nothing on the device: a receiver posts its first receive once the header is there,
and the sender writes it only after every member acknowledged the prepare, right before the payload.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

Backend = Literal["gloo", "nccl"]
# Large enough for full TCP (or NVLink) throughput, small enough that a receiver copies to the host and MACs one piece
# while the next arrives (one 87 MB piece made those run one after another).
PIECE_BYTES = 4 << 20
HEADER_POLL_SECONDS = 0.002
"""How often a receiver looks for the round's header in the store (a TCP round trip, microseconds on loopback):
polled, since a store wait that times out cannot be told apart from a lost connection without c10d logging each."""


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

    @property
    @abstractmethod
    def closed(self) -> bool:
        """This rank has left the group (close)."""

    def check_open(self, what: str) -> None:
        """Called after every wait: TransportError if this rank closed the group meanwhile. On NCCL a collective
        whose communicator was aborted (the round's watchdog, a newer join) returns from wait() normally, with the
        tensor holding whatever had arrived (ProcessGroupNCCL.cpp, WorkNCCL::isCompleted skips its error check once
        the communicator is aborted): the rank's own "closed" is the only sign that the collective never finished."""
        if self.closed:
            raise TransportError(f"the group was closed while {what} was waited for: the collective did not finish")

    # The epoch's store (epoch_store), where a round's header goes (see the module docstring); set by each backend.
    store: dist.Store

    def withdraw_header(self, version: int) -> None:
        """Sender, once round `version` is over (every receiver read the header before its first receive), and
        before it announces one: an earlier round's header of that version (a catch-up sends the current version
        again in the same epoch) is not this round's commit."""
        self._store_call(lambda: self.store.delete_key(_header_key(version)))

    def commit_header(self, version: int, raw: bytes) -> None:
        """Sender, once every member acknowledged the prepare of round `version`: its header, for every receiver."""
        self._store_call(lambda: self.store.set(_header_key(version), raw))

    def await_header(self, version: int, timeout_seconds: float) -> bytes:
        """Receiver: the header of round `version` once the sender committed it, with nothing posted on the group
        meanwhile. Raises TransportError when this rank leaves the group meanwhile (a newer join, the round's
        watchdog), when the store fails (the sender's process is gone: it hosts the store), or after
        `timeout_seconds`."""
        key, deadline = _header_key(version), time.monotonic() + timeout_seconds
        while not self._store_call(lambda: self.store.check([key])):
            if self.closed:
                raise TransportError("the group is closed")
            if time.monotonic() >= deadline:
                raise TransportError(f"no header for round {version} within {timeout_seconds:g}s")
            time.sleep(HEADER_POLL_SECONDS)
        return bytes(self._store_call(lambda: self.store.get(key)))

    def _store_call(self, call):
        try:
            return call()
        except RuntimeError as exc:  # DistStoreError and the store's socket errors (their C++ trace after line 1)
            raise TransportError(f"the sync store failed: {str(exc).splitlines()[0]}") from None


def _header_key(version: int) -> str:
    return f"header/{version}"


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
