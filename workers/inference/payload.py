"""The shared-memory payload of an adapter, in one place: its layout (where each tensor lies in one contiguous buffer),
how it is packed, mapped and unpacked, and the staging segments in /dev/shm a sync member receives rounds into
(their names say who made them, so that one nobody will remove is found and removed).

Used by both ends: the HTTP process packs an adapter it has as tensors (`shared_payload`, `grpolora eval`, the
benchmarks); a sync member in vLLM's worker receives a round straight into a staging segment
(member_host.StagingSink); every worker of the engine maps a payload by name and unpacks its tensors
(vllm_worker.AdapterExtension).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import mmap
import os
import socket
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing import shared_memory
from typing import Any

import torch

from grpolora.workers.sync import wire

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # where shm_open puts a segment's name: SharedPayload maps it from there

ALIGN = wire.ALIGN  # every tensor starts aligned, so that a byte view can be reinterpreted as its dtype
Layout = list[tuple[str, str, list[int], int, int]]
"""A payload's layout: the wire's layout (sync/wire.py, TensorEntry) of one bucket, as (name, dtype, shape, byte
offset, nbytes) per tensor: plain types, as vLLM's RPC serialises them. One layout and one packer for both."""


def layout_of(entries: Sequence[wire.TensorEntry]) -> Layout:
    """The plain form of one bucket's entries."""
    return [(e.name, e.dtype, list(e.shape), e.offset, e.nbytes) for e in entries]


def entries_of(layout: Layout) -> list[wire.TensorEntry]:
    """A layout's entries again (bucket 0)."""
    return [wire.TensorEntry(name, dtype, tuple(shape), 0, at, nbytes) for name, dtype, shape, at, nbytes in layout]


def payload_layout(tensors: Mapping[str, torch.Tensor]) -> tuple[Layout, int]:
    """Where each tensor goes in one contiguous payload (the wire's layout of a single bucket), and its size."""
    if not tensors:
        return [], 0
    entries, sizes = wire.plan_buckets(tensors, bucket_bytes=sys.maxsize)
    return layout_of(entries), sizes[0]


def pack_into(buffer: Any, tensors: Mapping[str, torch.Tensor], layout: Layout) -> None:
    """Copy the tensors into `buffer` (any writable buffer of the layout's size) as the layout says (wire's packer)."""
    wire.write_entries([torch.frombuffer(buffer, dtype=torch.uint8)], entries_of(layout), tensors)


def pack_payload(tensors: Mapping[str, torch.Tensor]) -> tuple[bytearray, Layout]:
    """The tensors as one contiguous buffer (one copy) and its layout."""
    layout, size = payload_layout(tensors)
    payload = bytearray(size)
    if size:
        pack_into(payload, tensors, layout)
    return payload, layout


@contextlib.contextmanager
def shared_payload(tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, int, Layout]]:
    """The tensors packed into a shared-memory segment for vLLM's workers to read (its name, size and layout),
    removed on leaving. Shared memory, not vLLM's RPC, carries the bytes: the RPC would serialise them and copy
    them through its sockets and queues several times on the way (about 4x the time on a busy CPU), while the
    workers, on the same host as the server that started them, can read the one packed copy directly."""
    layout, size = payload_layout(tensors)
    segment = shared_memory.SharedMemory(create=True, size=max(size, 1))
    try:
        # Reserve the pages first: a full /dev/shm then fails here with ENOSPC (an activation failure, the old
        # version keeps serving) instead of killing the server with SIGBUS on the first write to a missing page.
        os.posix_fallocate(segment._fd, 0, max(size, 1))  # type: ignore[attr-defined]
        if size:
            pack_into(segment.buf[:size], tensors, layout)
        yield segment.name, size, layout
    finally:
        segment.close()
        segment.unlink()


class SharedPayload:
    """A worker's hold on a shared payload while its LoRA id is loaded: the segment's file, open. The server removes
    the segment's name as soon as the call returns; the open file, and so the bytes, stay until `close` (or this
    process ends, so nothing outlives a crash). Nothing writes to the segment after the server packed it."""

    def __init__(self, name: str, size: int):
        # Opened as the file shm_open made of it, not with shared_memory.SharedMemory: Python 3.11 registers a
        # segment it only opens with the resource tracker, which vLLM's workers share with the server that started
        # them, and unregistering it took the server's own registration away (its unlink then made the tracker print
        # a KeyError traceback). Its creator alone tracks and removes it.
        self._descriptor = os.open(os.path.join(SHM_DIR, name.lstrip("/")), os.O_RDONLY)
        self.size = size

    def private_mapping(self) -> mmap.mmap:
        """The payload mapped copy-on-write (MAP_PRIVATE): reads share the segment's pages, and a write copies only
        the page written, for this mapping alone. The mapping lasts as long as something refers to it."""
        return mmap.mmap(self._descriptor, max(self.size, 1), access=mmap.ACCESS_COPY)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._descriptor)


def unpack_payload(
    payload: bytes | bytearray | SharedPayload, layout: Sequence[Sequence[Any]]
) -> dict[str, torch.Tensor]:
    """Fresh tensors from a payload that no other build's tensors share (vLLM scales them in place): a private
    mapping of a shared payload (copy-on-write: vLLM writes to lora_B alone, so most pages are never copied), or a
    copy of plain bytes."""
    owned = payload.private_mapping() if isinstance(payload, SharedPayload) else bytearray(payload)
    size = payload.size if isinstance(payload, SharedPayload) else len(owned)
    if not size:
        return {name: torch.empty(shape, dtype=wire.dtype_named(dtype)) for name, dtype, shape, _, _ in layout}
    flat = torch.frombuffer(owned, dtype=torch.uint8)[:size]  # the tensors keep the mapping alive
    tensors = {}
    for name, dtype, shape, offset, nbytes in layout:
        if offset < 0 or offset + nbytes > size:
            raise ValueError(f"adapter tensor {name}: bytes {offset}..{offset + nbytes} outside the payload")
        tensors[name] = flat[offset : offset + nbytes].view(wire.dtype_named(dtype)).view(tuple(shape))
    return tensors


STAGE_PREFIX = "grpolora-stage-"  # then the owner (StageOwner), "-", and a random part


@dataclasses.dataclass(frozen=True)
class StageOwner:
    """Who made a staging segment, as its name says. A pid alone names no process: a container restarted in its pod
    keeps the pod's /dev/shm (an emptyDir) under a new pid namespace, where pids start again, so its new worker may
    have the pid of its predecessor's. Hence the container (its hostname, the pod's name, the same across its
    container's restarts; hashed), the pid namespace, and the process by pid and start time."""

    host: str  # 8 hex digits
    pid_namespace: int
    pid: int
    start: int  # clock ticks after boot (/proc/<pid>/stat, field 22)


def process_start(pid: int) -> int | None:
    """When process `pid` (of this pid namespace) started, in clock ticks after boot; None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def stage_owner() -> StageOwner:
    """This process, as the owner of the staging segments it makes."""
    host = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
    return StageOwner(host, os.stat("/proc/self/ns/pid").st_ino, os.getpid(), process_start(os.getpid()) or 0)


def stage_name(owner: StageOwner) -> str:
    """A new segment's name: the prefix, its owner, a random part."""
    return f"{STAGE_PREFIX}{owner.host}-{owner.pid_namespace}-{owner.pid}-{owner.start}-{uuid.uuid4().hex[:16]}"


def _stage_owner_of(name: str) -> StageOwner | None:
    parts = name.removeprefix(STAGE_PREFIX).split("-")
    if not name.startswith(STAGE_PREFIX) or len(parts) != 5 or not all(p.isdigit() for p in parts[1:4]):
        return None
    return StageOwner(parts[0], int(parts[1]), int(parts[2]), int(parts[3]))


def orphaned(owner: StageOwner, me: StageOwner) -> bool:
    """Whether a segment of `owner` is one nobody will remove, seen from `me`: its process is gone (in this pid
    namespace: no process with its pid and start time), or it was made by this container's predecessor (this pod's
    container, another pid namespace). Another container's or pod's segments are never touched."""
    if owner.host != me.host:
        return False
    if owner.pid_namespace != me.pid_namespace:
        return True
    return process_start(owner.pid) != owner.start


def remove_orphaned_stages() -> list[str]:
    """Remove the staging segments nobody will remove (`orphaned`: a worker killed inside a round cannot; in a pod
    they would hold /dev/shm's memory until the pod ends). Returns their names."""
    me, removed = stage_owner(), []
    for name in os.listdir(SHM_DIR):
        owner = _stage_owner_of(name)
        if owner is None or not orphaned(owner, me):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
    if removed:
        log.warning("removed %d staging segments of sync members that died mid-round", len(removed))
    return removed


def new_segment(size: int) -> tuple[str, torch.Tensor]:
    """A new staging segment of `size` bytes in /dev/shm: its name and its bytes, mapped shared."""
    name = stage_name(stage_owner())
    path = os.path.join(SHM_DIR, name)
    descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        # Reserve the pages first: a full /dev/shm fails here (ENOSPC, the round is interrupted and the old version
        # keeps serving) instead of killing the worker with SIGBUS on the first write to a missing page.
        os.posix_fallocate(descriptor, 0, max(size, 1))
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(descriptor)
    return name, torch.from_file(path, shared=True, size=max(size, 1), dtype=torch.uint8)[:size]


def remove_segment(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))
