"""The HTTP process's end of the sync-group members (its MemberLink and a RemoteMember per tenant); the worker's end
is member_host.py, the messages between them member_messages.py.

The sync-group members of an inference replica live in vLLM's own worker process; the HTTP process keeps the
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
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
from collections.abc import Awaitable, Callable
from multiprocessing import reduction
from multiprocessing.connection import Connection, Listener
from typing import Any, Protocol

from grpolora.workers.inference.member_messages import CONTROL_TIMEOUT_SECONDS, ERRORS, receive, send
from grpolora.workers.inference.payload import Layout
from grpolora.workers.sync.control import JoinRequest, MemberState, MemberUnreachable, PrepareRequest, SyncError
from grpolora.workers.sync.receiver import RoundOutcome

log = logging.getLogger(__name__)


class StagedSink(Protocol):
    """Where a RemoteMember activates a verified round (the job's AdapterBook)."""

    def activate_staged(
        self, version: int, segment: str, size: int, layout: Layout, adapter_config: dict, *, incarnation: int
    ) -> None: ...


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
                send(self._host, attach | {"fingerprint": fingerprint})
                reduction.send_handle(self._host, control_there.fileno(), 0)
                reduction.send_handle(self._host, events_there.fileno(), 0)
                answer = receive(self._host, self.timeout_seconds)
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
        self.lost: str | None = None  # why the control channel was closed on a failed call (tenants.Tenant.member)
        self._events_thread = threading.Thread(target=self._serve_events, name=f"member-events-{name}", daemon=True)
        self._events_thread.start()

    def _call(self, op: str, **body: Any) -> Any:
        with self._lock:
            try:
                send(self._control, {"op": op, **body})
                answer = receive(self._control, self._timeout)
            except (OSError, EOFError, TimeoutError) as exc:
                # A late answer would be read as the next call's: this channel is done (the tenant attaches a new
                # member at its trainer's next join: tenants.Tenant.member).
                self.lost = self.lost or f"{op}: {exc!r}"
                with contextlib.suppress(OSError):
                    self._control.close()
                raise MemberUnreachable(f"the sync member of {self.name} in vLLM's worker: {exc!r}") from None
        if "error" in answer:
            raise ERRORS.get(answer["error"], SyncError)(answer["message"])
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
                    message = receive(self._events)
                except (EOFError, OSError):
                    return
                if message["op"] == "activate":
                    send(self._events, self._activate(message))
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
                message["version"],
                message["segment"],
                message["size"],
                layout,
                message["adapter_config"],
                incarnation=message["incarnation"],
            )
        except Exception as exc:  # the member reports ACTIVATION_FAILED; the older version keeps serving
            log.exception("%s: version %d verified but not activated", self.name, message["version"])
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"ok": True}
