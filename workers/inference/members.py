"""The sync-group members of an inference replica live in vLLM's own worker process; the HTTP process keeps the
control plane and never holds a collective, a round's bytes or (with `sync.backend: nccl`) a CUDA context.

    HTTP process (server.py, app.py)            vLLM worker of TP rank 0 (vllm_worker.AdapterExtension)
    MemberLink: a Unix socket, one host  ----->  MemberHost: a thread; attaches and detaches tenants
    connection, started by a collective_rpc
    RemoteMember, one per tenant (job)  control  WorkerMember: an AdapterReceiver (the sync-group member, its
      join / prepare / state / close    ------>    own thread, and on a GPU its own CUDA stream), receiving
      activate: the book's collective_rpc  <---    into a StagingSink's shared-memory segment
      round / error: logs and metrics     events

The HTTP handlers of `/v1/sync/*` call a RemoteMember exactly as they called an AdapterReceiver (the same
methods, the same errors); each call is one message over the tenant's own control socket, answered by the
worker's control thread at once (the engine keeps stepping: no call waits for an engine step). A round is received
on the worker's receiver thread into one staging segment in /dev/shm and checked against the header's payload MAC
as it lands (receiver.receive_round); only a verified round asks the HTTP process, over the tenant's events socket,
to activate it, and the book does so with one short collective_rpc between engine steps, in which every worker of
the engine maps the staging segment by name and builds its LoRA (vllm_worker.AdapterExtension.grpolora_add_adapter).
The member then reports the round in the group's closing all-reduce, and removes the segment's name (the workers
keep their mappings for as long as the LoRA id is loaded).

Each tenant has its own sockets (a pair of socketpairs whose worker ends travel over the host connection as file
descriptors), its own receiver thread, key, staging and live version: nothing of one job's rounds, settings or
errors reaches another's. Messages are JSON; the host connection is authenticated with a random key
(multiprocessing's challenge) and the tenant sockets are private socketpairs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Awaitable, Callable, Sequence
from multiprocessing import reduction
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Protocol

import torch

from grpolora.workers.inference.vllm_worker import SHM_DIR, Layout, payload_layout
from grpolora.workers.lifetime import name_this_thread
from grpolora.workers.sync import wire
from grpolora.workers.sync.control import (
    FingerprintMismatch,
    JoinRequest,
    MemberState,
    MemberUnreachable,
    PrepareRequest,
    StaleEpoch,
    StaleIncarnation,
    SyncError,
)
from grpolora.workers.sync.receiver import AdapterReceiver, RoundOutcome, allocate_apart

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_SECONDS = 10.0
_ERRORS: dict[str, type[SyncError]] = {
    error.__name__: error for error in (FingerprintMismatch, StaleEpoch, StaleIncarnation)
}


def _send(connection: Connection, message: dict) -> None:
    connection.send_bytes(json.dumps(message).encode())


def _receive(connection: Connection, timeout: float | None = None) -> dict:
    if timeout is not None and not connection.poll(timeout):
        raise TimeoutError(f"no answer within {timeout:g}s")
    return json.loads(connection.recv_bytes())


# ---- the HTTP process's end ------------------------------------------------------------------------------------


class StagedSink(Protocol):
    """Where a RemoteMember activates a verified round (the job's AdapterBook)."""

    def activate_staged(self, version: int, segment: str, size: int, layout: Layout, adapter_config: dict) -> None: ...


class MemberLink:
    """The HTTP process's end of its engine's member host: a Unix socket in a private folder, which the member
    worker connects to once (`start`), then one RemoteMember per tenant (`attach`)."""

    def __init__(self, *, timeout_seconds: float = CONTROL_TIMEOUT_SECONDS):
        self._folder = tempfile.mkdtemp(prefix="grpolora-members-")  # 0700: only this user reaches the socket
        self.address = os.path.join(self._folder, "host.sock")
        self._authkey = secrets.token_bytes(32)
        self._listener: Listener | None = Listener(self.address, family="AF_UNIX", authkey=self._authkey)
        self._host: Connection | None = None
        self._lock = threading.Lock()
        self.timeout_seconds = timeout_seconds

    async def start(self, connect: Callable[[str, str], Awaitable[Any]]) -> None:
        """`connect(address, authkey_hex)` makes the member worker connect (vLLM's collective_rpc into its workers;
        a plain process in tests); its answer is one value per worker, true where a worker became the host."""
        assert self._listener is not None
        accepted = asyncio.ensure_future(asyncio.to_thread(self._listener.accept))
        try:
            answers = await connect(self.address, self._authkey.hex())
            if answers is not None and not any(answers):
                raise RuntimeError("no vLLM worker became the sync member host (none is TP rank 0?)")
            self._host = await asyncio.wait_for(accepted, self.timeout_seconds)
        except BaseException:
            self._wake_accept()  # also when wait_for gave up on it: cancelling the future does not end the thread
            self.close()
            with contextlib.suppress(BaseException):
                await accepted
            raise

    def _wake_accept(self) -> None:
        """Connect once, and hang up, so that a thread blocked in the listener's accept() returns (its handshake then
        fails): Linux does not wake an accept() when another thread closes the listening socket."""
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as knock:
            knock.connect(self.address)

    def attach(
        self,
        sink: StagedSink,
        *,
        key: bytes,
        replica_index: int,
        fingerprint: str,
        name: str,
        on_round: Callable[[RoundOutcome], None] | None = None,
        on_error: Callable[[str], None] | None = None,
    ) -> RemoteMember:
        """A member for one tenant in the worker: its receiver, with `key`, activating verified rounds in `sink`."""
        if self._host is None:
            raise RuntimeError("the member host is not connected (engine not started)")
        control, control_there = socket.socketpair()
        events, events_there = socket.socketpair()
        try:
            with self._lock:
                attach = {"op": "attach", "name": name, "key": key.hex(), "replica_index": replica_index}
                _send(self._host, attach | {"fingerprint": fingerprint})
                reduction.send_handle(self._host, control_there.fileno(), 0)
                reduction.send_handle(self._host, events_there.fileno(), 0)
                answer = _receive(self._host, self.timeout_seconds)
        except BaseException:
            control.close()
            events.close()
            raise
        finally:
            control_there.close()
            events_there.close()
        if "error" in answer:
            control.close()
            events.close()
            raise RuntimeError(f"the member worker could not attach {name}: {answer['error']}")
        return RemoteMember(
            Connection(control.detach()),
            Connection(events.detach()),
            sink,
            replica_index=replica_index,
            fingerprint=fingerprint,
            name=name,
            on_round=on_round,
            on_error=on_error,
            timeout_seconds=self.timeout_seconds,
        )

    def close(self) -> None:
        """Ends the host connection (the worker then closes every member it holds) and removes the socket."""
        host, self._host = self._host, None
        listener, self._listener = self._listener, None
        for closable in (host, listener):
            if closable is not None:
                with contextlib.suppress(OSError):
                    closable.close()
        shutil.rmtree(self._folder, ignore_errors=True)


class RemoteMember:
    """One tenant's sync member as the HTTP process sees it: the AdapterReceiver's control methods, forwarded to
    the receiver in vLLM's worker, and the activation of its verified rounds in the tenant's book."""

    def __init__(
        self,
        control: Connection,
        events: Connection,
        sink: StagedSink,
        *,
        replica_index: int,
        fingerprint: str,
        name: str,
        on_round: Callable[[RoundOutcome], None] | None,
        on_error: Callable[[str], None] | None,
        timeout_seconds: float,
    ):
        self.replica_index, self.fingerprint, self.name = replica_index, fingerprint, name
        self._control, self._events, self._sink = control, events, sink
        self._on_round, self._on_error = on_round, on_error
        self._timeout = timeout_seconds
        self._lock = threading.Lock()
        self._events_thread = threading.Thread(target=self._serve_events, name=f"member-events-{name}", daemon=True)
        self._events_thread.start()

    def _call(self, op: str, **body: Any) -> Any:
        with self._lock:
            try:
                _send(self._control, {"op": op, **body})
                answer = _receive(self._control, self._timeout)
            except (OSError, EOFError, TimeoutError) as exc:
                # A late answer would be read as the next call's: this channel is done.
                with contextlib.suppress(OSError):
                    self._control.close()
                raise MemberUnreachable(f"the sync member of {self.name} in vLLM's worker: {exc!r}") from None
        if "error" in answer:
            raise _ERRORS.get(answer["error"], SyncError)(answer["message"])
        return answer.get("value")

    def state(self) -> MemberState:
        return MemberState.model_validate(self._call("state"))

    @property
    def ready(self) -> bool:
        with contextlib.suppress(MemberUnreachable):
            return bool(self._call("ready"))
        return False

    @property
    def asked(self) -> bool:
        with contextlib.suppress(MemberUnreachable):
            return bool(self._call("asked"))
        return False

    def join(self, request: JoinRequest) -> None:
        self._call("join", request=request.model_dump())

    def prepare(self, request: PrepareRequest) -> None:
        self._call("prepare", request=request.model_dump())

    def close(self) -> None:
        with contextlib.suppress(MemberUnreachable):
            self._call("close")
        with contextlib.suppress(OSError):
            self._control.close()
        self._events_thread.join(timeout=30)

    def _serve_events(self) -> None:
        try:
            while True:
                try:
                    message = _receive(self._events)
                except (EOFError, OSError):
                    return
                if message["op"] == "activate":
                    _send(self._events, self._activate(message))
                elif message["op"] == "round" and self._on_round is not None:
                    self._on_round(RoundOutcome(**message["outcome"]))
                elif message["op"] == "error" and self._on_error is not None:
                    self._on_error(message["kind"])
        except OSError:
            return
        finally:
            with contextlib.suppress(OSError):
                self._events.close()

    def _activate(self, message: dict) -> dict:
        try:
            layout = [tuple(entry) for entry in message["layout"]]
            self._sink.activate_staged(
                message["version"], message["segment"], message["size"], layout, message["adapter_config"]
            )
        except Exception as exc:  # the member reports ACTIVATION_FAILED; the older version keeps serving
            log.exception("%s: version %d verified but not activated", self.name, message["version"])
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"ok": True}


# ---- the worker's end ------------------------------------------------------------------------------------------


MEMBER_THREAD_NAME = "grpolora-sync"
"""The OS name of the member host's thread in vLLM's worker, and so of the member threads it starts (a new thread
inherits it; gloo renames its own): what `top -H` shows for the sync, apart from vLLM's own threads."""


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


def serve_host(
    address: str, authkey_hex: str, device: torch.device | None = None, cpus: Sequence[int] | None = None
) -> MemberHost:
    """In the member worker: connect to the HTTP process's MemberLink and serve it on a thread of its own, which
    may run on `cpus` (see MemberHost.serve)."""
    remove_orphaned_stages()
    connection = Client(address, family="AF_UNIX", authkey=bytes.fromhex(authkey_hex))
    host = MemberHost(connection, device, cpus)
    threading.Thread(target=host.serve, name="grpolora-member-host", daemon=True).start()
    return host


class MemberHost:
    """The worker's end of a MemberLink: attaches a WorkerMember per tenant; when the HTTP process goes, every
    member leaves its group."""

    def __init__(self, connection: Connection, device: torch.device | None, cpus: Sequence[int] | None = None):
        self._connection = connection
        self._device = device
        self._cpus = cpus
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
                    message = _receive(self._connection)
                except (EOFError, OSError):
                    return
                if message["op"] == "attach":
                    _send(self._connection, self._attach(message))
        finally:
            for member in self.members:
                member.close()
            self.finished.set()

    def _attach(self, message: dict) -> dict:
        control = Connection(reduction.recv_handle(self._connection))
        events = Connection(reduction.recv_handle(self._connection))
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
        self.members = [m for m in self.members if not m.closed] + [member]
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
                    message = _receive(self._control)
                except (EOFError, OSError):
                    return
                op = message["op"]
                try:
                    value = self._answer(op, message)
                except SyncError as exc:
                    _send(self._control, {"error": type(exc).__name__, "message": str(exc)})
                    continue
                _send(self._control, {"value": value})
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
            _send(self._events, message)

    def _activate_remote(self, version: int, segment: str, size: int, layout: Layout, adapter_config: dict) -> None:
        """Ask the HTTP process to activate a verified round staged in `segment`; returns once the book has it live
        (every worker then maps the segment), raises if it could not."""
        message = {"op": "activate", "version": version, "segment": segment, "size": size, "layout": layout}
        try:
            with self._events_lock:
                _send(self._events, message | {"adapter_config": adapter_config})
                answer = _receive(self._events)
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

    def __init__(self, activate_remote: Callable[[int, str, int, Layout, dict], None]):
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
            self._ahead = _new_segment(self._last_size)
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
            _remove(ahead[0])
            ahead = None
        self._staged = ahead or _new_segment(size)
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
        for (_, _, _, start, nbytes), tensor in zip(layout, tensors.values(), strict=True):
            flat[start : start + nbytes].view(tensor.dtype).copy_(tensor.detach().reshape(-1))
        name, _ = self._staged  # type: ignore[misc]
        return name, size, layout

    def activate(self, version: int, tensors: dict[str, torch.Tensor], adapter_config: dict) -> None:
        try:
            segment, size, layout = self._layout(tensors)
            self._activate_remote(version, segment, size, layout, adapter_config)
            self._live_version = version
        finally:
            self.discard()

    def discard(self) -> None:
        """Remove the staged segment's name: the workers that mapped it keep the bytes; its pages go with the last
        mapping (here, once the round's buffers are dropped)."""
        staged, self._staged = self._staged, None
        self._mirrors, self._landed = [], 0
        if staged is not None:
            _remove(staged[0])

    def close(self) -> None:
        """Remove the round's segment and the one staged ahead."""
        self.discard()
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            _remove(ahead[0])


def _new_segment(size: int) -> tuple[str, torch.Tensor]:
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


def _remove(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))
