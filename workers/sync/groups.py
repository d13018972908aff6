"""Forming one epoch's sync group: the arrival marks in the store and the transport of the chosen backend (gloo.py,
nccl.py). Apart from the transport interface (transport.py), which the backends implement: they import it, and
this module imports them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from grpolora.workers.sync.gloo import GlooTransport
from grpolora.workers.sync.nccl import NcclTransport
from grpolora.workers.sync.transport import Backend, Transport, epoch_store


def _arrival_key(rank: int) -> str:
    return f"arrived/{rank}"


def arrived_ranks(store: dist.Store, epoch: int, world_size: int) -> set[int]:
    """The ranks that reached epoch `epoch`'s store to join its group (whether or not the group then formed)."""
    prefixed = epoch_store(store, epoch)
    return {rank for rank in range(world_size) if prefixed.check([_arrival_key(rank)])}


def create_transport(
    backend: Backend,
    store: dist.Store,
    *,
    epoch: int,
    rank: int,
    world_size: int,
    timeout_seconds: float,
    join_timeout_seconds: float | None = None,
    progress_timeout_seconds: float | None = None,
    device: torch.device | None = None,
    free_cached_memory: bool = False,
) -> Transport:
    """Join epoch `epoch` of the group as `rank`: blocks until all `world_size` ranks have joined, or raises
    TransportError after `join_timeout_seconds` (default: `timeout_seconds`, which bounds every collective).
    `progress_timeout_seconds`: a round's watchdog (watchdog.py) cuts a collective stalled this long by closing the
    transport; gloo, whose close cannot interrupt a collective in flight, also gives each collective that timeout.
    `free_cached_memory`: NCCL only, trainer rank 0 only (nccl.NcclTransport): hand the allocator's cache back first.

    A rank marks its arrival in the store first, so that after a formation that timed out the sender can tell
    the replicas that never reached the group from a formation that failed for everyone."""
    prefixed = epoch_store(store, epoch)
    join_timeout = timeout_seconds if join_timeout_seconds is None else join_timeout_seconds
    prefixed.set(_arrival_key(rank), b"1")
    if backend == "gloo":
        return GlooTransport(
            prefixed,
            rank=rank,
            world_size=world_size,
            timeout_seconds=timeout_seconds,
            join_timeout_seconds=join_timeout,
            op_timeout_seconds=progress_timeout_seconds,
        )
    if backend == "nccl":
        return NcclTransport(
            prefixed,
            rank=rank,
            world_size=world_size,
            timeout_seconds=timeout_seconds,
            join_timeout_seconds=join_timeout,
            device=device,
            free_cached_memory=free_cached_memory,
        )
    raise ValueError(f"unknown sync backend {backend!r}; expected gloo or nccl")
