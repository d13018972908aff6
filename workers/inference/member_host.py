"""vLLM's worker's end of the sync-group members of an inference replica: the member host that the HTTP process's
MemberLink (member_link.py) connects, and per tenant a WorkerMember, its AdapterReceiver and the StagingSink its
rounds land in (payload.py: the segments). It runs in the worker of TP rank 0 (vllm_worker.AdapterExtension
.grpolora_member_host); nothing here runs in the HTTP process.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Sequence
from multiprocessing import reduction
from multiprocessing.connection import Client, Connection
from typing import Any

import torch

from grpolora.workers.inference.gpu_headroom import TenantBudget
from grpolora.workers.inference.member_messages import receive, send
from grpolora.workers.inference.payload import (
    Layout,
    entries_of,
    new_segment,
    payload_layout,
    remove_orphaned_stages,
    remove_segment,
)
from grpolora.workers.lifetime import name_this_thread
from grpolora.workers.sync import wire
from grpolora.workers.sync.control import JoinRequest, PrepareRequest, SyncError
from grpolora.workers.sync.receiver import AdapterReceiver, RoundOutcome, allocate_apart

log = logging.getLogger(__name__)


MEMBER_THREAD_NAME = "grpolora-sync"
"""The OS name of the member host's thread in vLLM's worker, and so of the member threads it starts (a new thread
inherits it; gloo renames its own): what `top -H` shows for the sync, apart from vLLM's own threads."""


def serve_host(
    address: str,
    authkey_hex: str,
    device: torch.device | None = None,
    cpus: Sequence[int] | None = None,
    budget: TenantBudget | None = None,
) -> MemberHost:
    """In the member worker: connect to the HTTP process's MemberLink and serve it on a thread of its own, which
    may run on `cpus` (see MemberHost.serve). `budget`: a GPU replica's, which each attachment must fit."""
    remove_orphaned_stages()
    connection = Client(address, family="AF_UNIX", authkey=bytes.fromhex(authkey_hex))
    host = MemberHost(connection, device, cpus, budget)
    threading.Thread(target=host.serve, name="grpolora-member-host", daemon=True).start()
    return host


class MemberHost:
    """The worker's end of a MemberLink: attaches a WorkerMember per tenant; when the HTTP process goes, every
    member leaves its group.

    On a GPU replica each attachment must fit `budget` (gpu_headroom.py: every member keeps a communicator and an
    adapter-sized receive buffer outside vLLM's gpuMemoryUtilization), or it is refused with the numbers. A CPU
    replica has no budget (None): its members' buffers are in /dev/shm and gloo's, not in vLLM's device memory."""

    def __init__(
        self,
        connection: Connection,
        device: torch.device | None,
        cpus: Sequence[int] | None = None,
        budget: TenantBudget | None = None,
    ):
        self._connection = connection
        self._device = device
        self._cpus = cpus
        self._budget = budget
        self.members: list[WorkerMember] = []
        self.finished = threading.Event()  # set once the HTTP process has gone and every member has left

    def serve(self) -> None:
        if self._cpus and (self._device is None or self._device.type == "cpu"):
            # vLLM binds a CPU worker's OpenMP threads one per core, its main thread (which starts this one) to the
            # first (OMP_PROC_BIND, vllm/utils/ompmultiprocessing.py), and a thread inherits the CPUs of the thread
            # that starts it. Left so, every member thread and gloo's would share that core with generation while
            # others idle (with two replicas on one machine, both members shared core 0). This thread, and every
            # thread started from it (members, receivers, gloo's), may run on the CPUs the server may.
            os.sched_setaffinity(0, self._cpus)  # 0: the calling thread only (Linux)
        name_this_thread(MEMBER_THREAD_NAME)
        try:
            while True:
                try:
                    message = receive(self._connection)
                except (EOFError, OSError):
                    return
                if message["op"] == "attach":
                    send(self._connection, self._attach(message))
        finally:
            for member in self.members:
                member.close()
            self.finished.set()

    def _attach(self, message: dict) -> dict:
        control = Connection(reduction.recv_handle(self._connection))
        events = Connection(reduction.recv_handle(self._connection))
        self.members = [m for m in self.members if not m.closed]
        if self._budget is not None:
            # A member closing still counts until its control thread has closed it: never more than fits.
            room = self._budget.with_tenants(len(self.members) + 1)
            if not room.fits:
                control.close()
                events.close()
                log.error("%s", room.refusal(message["name"]))
                return {"error": room.refusal(message["name"])}
        try:
            member = WorkerMember(
                control,
                events,
                key=bytes.fromhex(message["key"]),
                replica_index=message["replica_index"],
                fingerprint=message["fingerprint"],
                name=message["name"],
                device=self._device,
            )
        except Exception as exc:
            control.close()
            events.close()
            return {"error": f"{type(exc).__name__}: {exc}"}
        self.members.append(member)
        return {"ok": True}


def _cuda_stream(device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """The receiver thread's own CUDA stream: its copies never queue behind the engine's kernels."""
    return lambda: torch.cuda.stream(torch.cuda.Stream(device))


class WorkerMember:
    """One tenant's sync member inside vLLM's worker: the AdapterReceiver, its staging, and the tenant's two
    sockets to the HTTP process (control: answered by a thread of its own; events: activation and outcomes)."""

    def __init__(
        self,
        control: Connection,
        events: Connection,
        *,
        key: bytes,
        replica_index: int,
        fingerprint: str,
        name: str,
        device: torch.device | None,
    ):
        self.name = name
        self._control, self._events = control, events
        self._events_lock = threading.Lock()
        self.closed = False
        gpu = device is not None and device.type == "cuda"
        self.sink = StagingSink(self._activate_remote)
        self.receiver = AdapterReceiver(
            self.sink,
            replica_index=replica_index,
            fingerprint=fingerprint,
            key=key,
            device=device if gpu else None,
            on_round=self._round_ended,
            on_error=self._failed,
            name=name,
            allocate=self.sink.allocate,
            land=self.sink.land,
            thread_context=_cuda_stream(device) if gpu else None,
        )
        threading.Thread(target=self._serve_control, name=f"member-control-{name}", daemon=True).start()

    def _serve_control(self) -> None:
        try:
            while True:
                try:
                    message = receive(self._control)
                except (EOFError, OSError):
                    return
                op = message["op"]
                try:
                    value = self._answer(op, message)
                except SyncError as exc:
                    send(self._control, {"error": type(exc).__name__, "message": str(exc)})
                    continue
                send(self._control, {"value": value})
                if op == "close":
                    return
        except OSError:
            return
        finally:
            self.close()

    def _answer(self, op: str, message: dict) -> Any:
        if op == "state":
            return self.receiver.state().model_dump()
        if op == "ready":
            return self.receiver.ready
        if op == "asked":
            return self.receiver.asked
        if op == "join":
            return self.receiver.join(JoinRequest.model_validate(message["request"]))
        if op == "prepare":
            return self.receiver.prepare(PrepareRequest.model_validate(message["request"]))
        if op == "close":
            return None  # answered first; the control thread then closes this member
        raise SyncError(f"unknown member call {op!r}")

    # Both on the receiver thread, as a round ends: a refused or interrupted round's segment goes at once (an
    # activated one went as it was activated), so no round's bytes stay named in /dev/shm until the next; then,
    # with the round's closing all-reduce behind, the next round's segment is made (StagingSink.stage_ahead).
    def _round_ended(self, outcome: RoundOutcome) -> None:
        self.sink.discard()
        self._event({"op": "round", "outcome": dataclasses.asdict(outcome)})
        self.sink.stage_ahead()

    def _failed(self, kind: str) -> None:
        self.sink.discard()
        self._event({"op": "error", "kind": kind})
        self.sink.stage_ahead()

    def _event(self, message: dict) -> None:
        with self._events_lock, contextlib.suppress(OSError):
            send(self._events, message)

    def _activate_remote(
        self, version: int, segment: str, size: int, layout: Layout, adapter_config: dict, *, incarnation: int
    ) -> None:
        """Ask the HTTP process to activate a verified round staged in `segment`, published by trainer `incarnation`;
        returns once the book has it live (every worker then maps the segment), raises if it could not."""
        message = {"op": "activate", "version": version, "segment": segment, "size": size, "layout": layout}
        message["incarnation"] = incarnation
        try:
            with self._events_lock:
                send(self._events, message | {"adapter_config": adapter_config})
                answer = receive(self._events)
        except (OSError, EOFError) as exc:
            raise RuntimeError(f"the HTTP process did not answer the activation: {exc!r}") from None
        if "error" in answer:
            raise RuntimeError(answer["error"])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.receiver.close()
        self.sink.close()
        for connection in (self._control, self._events):
            with contextlib.suppress(OSError):
                connection.close()


class StagingSink:
    """Where one tenant's rounds land in the worker: a shared-memory segment per round, whose buckets the receiver
    fills and verifies, and whose name the activation hands to every worker of the engine. Its live version mirrors
    the tenant's book (only this member activates that book).

    On a CPU the buckets are views of the segment. On a GPU they are device buffers (NCCL receives into device
    memory), and each piece is copied once into its place in the segment as it lands (`land`), where the MAC reads
    it: the round's one trip to the host.

    A segment is new each round and never written once its round is activated: the workers' builds map it
    copy-on-write (vllm_worker.SharedPayload), and a page of such a mapping that no build has written to shows what
    the segment holds now, so the adapter's tensors read it for as long as the LoRA is loaded.

    It is made between rounds, though: once a round has ended, `stage_ahead` makes the next round's segment, of the
    size of the last, and touches every page of it. Making it and faulting its pages in as the bytes arrived took
    ~5-7 ms of each receiver's part of a 19.5 MB round, on the round's path (the sender waits for the slowest
    receiver); between rounds that CPU is spent while nothing waits on it (BENCHMARKS.md). It costs one adapter's
    size of /dev/shm per tenant while no round runs; `close` removes it."""

    def __init__(self, activate_remote: Callable[..., None]):
        self._activate_remote = activate_remote
        self._live_version = 0
        self._staged: tuple[str, torch.Tensor] | None = None  # the segment's name and its bytes (mapped)
        self._mirrors: list[tuple[torch.Tensor, torch.Tensor]] = []  # device bucket -> its bytes in the segment
        self._landed = 0  # bytes of the device buckets copied into the segment this round
        self._ahead: tuple[str, torch.Tensor] | None = None  # the next round's segment, its pages touched
        self._last_size = 0  # of the last round's segment: the size the next one is staged at

    @property
    def live_version(self) -> int:
        return self._live_version

    def _apart(self, device: torch.device) -> bool:
        """Whether the round is received into buffers of its own rather than into the segment (device memory)."""
        return device.type != "cpu"

    def allocate(self, sizes: Sequence[int], device: torch.device) -> list[torch.Tensor]:
        """The round's buckets: views of one new staging segment, or device buffers that `land` copies into it."""
        self.discard()  # a round that never reached activation (refused, interrupted) leaves its segment here
        flat = self._stage(sum(sizes))
        hosts = list(flat.split(list(sizes)))
        if not self._apart(device):
            return hosts
        buckets = allocate_apart(sizes, device)
        self._mirrors = list(zip(buckets, hosts, strict=True))
        return buckets

    def stage_ahead(self) -> None:
        """Make the next round's segment now, between rounds, the size of the last round's (see the class)."""
        if self._ahead is not None or not self._last_size:
            return
        try:
            self._ahead = new_segment(self._last_size)
        except OSError as exc:  # /dev/shm full: the next round makes its own, or is interrupted then
            log.warning("could not stage the next round's %d bytes ahead: %s", self._last_size, exc)
            return
        # posix_fallocate gave the pages; writing maps each into this process. A plain memset, not a torch op:
        # nothing of torch's OpenMP pool starts on a member's thread beside the engine's forward passes.
        ctypes.memset(self._ahead[1].data_ptr(), 0, self._ahead[1].numel())

    def _stage(self, size: int) -> torch.Tensor:
        """A segment of `size` bytes for this round: the one staged ahead if it has that size, else a new one."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[1].numel() != size:
            remove_segment(ahead[0])
            ahead = None
        self._staged = ahead or new_segment(size)
        self._last_size = size
        return self._staged[1]

    def land(self, piece: torch.Tensor) -> torch.Tensor:
        """The host bytes of a piece just received (see receiver.Land): itself when it is in the segment already;
        else copied into its place there (on the receiving thread's stream, after the piece's receive)."""
        if not self._mirrors:
            return wire.on_host(piece)
        host = self._in_segment(piece)
        if host is None:
            return wire.on_host(piece)
        host.copy_(piece.reshape(-1).view(torch.uint8))
        self._landed += host.numel()
        return host

    def _in_segment(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The bytes of the segment that mirror `tensor`, a view of one of the round's device buckets."""
        for bucket, host in self._mirrors:
            start = tensor.data_ptr() - bucket.data_ptr()
            nbytes = tensor.numel() * tensor.element_size()
            if tensor.is_contiguous() and start >= 0 and start + nbytes <= bucket.numel():
                return host[start : start + nbytes]
        return None

    def _layout(self, tensors: dict[str, torch.Tensor]) -> tuple[str, int, Layout]:
        """The staged segment holding `tensors` (views of it, or of device buckets every byte of which has landed
        in it), or a new one they are copied into."""
        complete = not self._mirrors or self._landed == sum(bucket.numel() for bucket, _ in self._mirrors)
        if self._staged is not None and complete:
            name, flat = self._staged
            base, size = flat.data_ptr(), flat.numel()
            layout: Layout = []
            for tensor_name, tensor in tensors.items():
                host = self._in_segment(tensor) if self._mirrors else tensor
                nbytes = tensor.numel() * tensor.element_size()
                if host is None or host.device.type != "cpu" or not tensor.is_contiguous():
                    break
                offset = host.data_ptr() - base
                if not (offset >= 0 and offset + nbytes <= size):
                    break
                layout.append(
                    (tensor_name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes)
                )
            else:
                return name, size, layout
        layout, size = payload_layout(tensors)  # not all in the segment: one copy to the host, into a new one
        self.discard()  # the round's own segment, if any, goes (what maps it keeps its bytes)
        flat = self._stage(size)
        if size:
            wire.write_entries([flat], entries_of(layout), tensors)  # the one packer (wire.py)
        name, _ = self._staged  # type: ignore[misc]
        return name, size, layout

    def activate(
        self, version: int, tensors: dict[str, torch.Tensor], adapter_config: dict, *, incarnation: int = 0
    ) -> None:
        try:
            segment, size, layout = self._layout(tensors)
            self._activate_remote(version, segment, size, layout, adapter_config, incarnation=incarnation)
            self._live_version = version
        finally:
            self.discard()

    def discard(self) -> None:
        """Remove the staged segment's name: the workers that mapped it keep the bytes; its pages go with the last
        mapping (here, once the round's buffers are dropped)."""
        staged, self._staged = self._staged, None
        self._mirrors, self._landed = [], 0
        if staged is not None:
            remove_segment(staged[0])

    def close(self) -> None:
        """Remove the round's segment and the one staged ahead."""
        self.discard()
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            remove_segment(ahead[0])
