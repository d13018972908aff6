"""The receiving side of adapter sync: one AdapterReceiver per job on each inference replica. It runs in vLLM's TP
rank 0 worker process (at TP=1 the EngineCore), inside the job's WorkerMember (workers/inference/member_host.py),
never in the replica's HTTP process, which reaches it over the member's sockets (member_link.py). Tests run it
in-process, beside the sender.

One worker thread owns the collective: it forms the group when told to join an epoch and takes part in a round
when told to prepare one. A round's buckets are verified against the header's payload MAC before anything is
activated; a corrupted, short or interrupted round activates nothing, and the version already live keeps
serving. Activation itself belongs to the `AdapterSink`, injected so that the protocol is testable without vLLM: in
a replica, the member's StagingSink (member_host.py), which hands the staged round to the job's adapter book in the
HTTP process (inference/adapter_book.py) and returns once that book has the version live.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from grpolora.workers.sync import wire
from grpolora.workers.sync.control import (
    CLOSING_TIMEOUT_SECONDS,
    FingerprintMismatch,
    JoinRequest,
    MemberState,
    PrepareRequest,
    StaleEpoch,
    StaleIncarnation,
)
from grpolora.workers.sync.groups import create_transport
from grpolora.workers.sync.transport import Transport, TransportError, connect_store
from grpolora.workers.sync.watchdog import Watchdog

log = logging.getLogger(__name__)

# What each receiver reports for a round in the closing all-reduce (one slot per rank), sent only after the
# version was activated (or found unusable): the sender counts a replica as serving a version only on VERIFIED.
VERIFIED = 1  # verified, and this version (or a later one) serves new requests
REFUSED = 2  # payload MAC or size mismatch: nothing activated
ACTIVATION_FAILED = 3  # verified, but the engine could not load it: the older version keeps serving
OTHER_WEIGHTS = 4  # verified, but this replica serves that version number under another trainer incarnation's weights


class AdapterSink(Protocol):
    """Where verified adapters go: makes `version` serve new requests, atomically. `incarnation`: of the trainer
    that published it (its version numbers are that trainer's: the job's adapter book leases a version only to it)."""

    @property
    def live_version(self) -> int: ...

    def activate(
        self, version: int, tensors: dict[str, torch.Tensor], adapter_config: dict, *, incarnation: int
    ) -> None: ...


# Where a round's buckets are received: given their sizes and the transport's device, one buffer per bucket. The
# default allocates each on its own; a member inside vLLM's worker receives into one staging segment instead
# (workers/inference/member_host.py), which vLLM's workers then map without another copy.
Allocate = Callable[[Sequence[int], torch.device], list[torch.Tensor]]


def allocate_apart(sizes: Sequence[int], device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]


# The host bytes of a piece that has landed, for the MAC (host work): by default wire.on_host, the piece itself on a
# CPU, else a copy. A member in vLLM's worker on a GPU copies each piece straight into its staging segment instead:
# the round's one host copy.
Land = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class RoundOutcome:
    version: int
    epoch: int
    verified: bool
    activated: bool
    reason: str | None
    bytes: int
    receive_seconds: float
    activate_seconds: float


def receive_round(
    transport: Transport,
    key: bytes,
    announced: PrepareRequest,
    allocate: Allocate = allocate_apart,
    land: Land = wire.on_host,
    progress: Callable[[], None] = lambda: None,
    header_timeout_seconds: float = 600.0,
) -> tuple[wire.RoundHeader, list[torch.Tensor], str | None]:
    """One round on a receiving rank: header, buckets and verification (the closing status is `report_status`,
    once the receiver knows whether the version went live).

    The header is awaited in the group's store (Transport.await_header, up to `header_timeout_seconds`), where the
    sender writes it only once every member has acknowledged the prepare: nothing is posted on the group before the
    sender has committed to the round, and the payload receives are posted only once the header is here.

    Returns the header, the buckets and None if they verified, or a reason if they did not. Raises
    TransportError when the collective breaks, and WireError (after leaving the group) on a header that is
    unreadable, out of bounds, not authenticated by `key`, or for another round than the `announced` one: a rank
    that cannot follow the layout cannot stay in lockstep with the others, and nothing is allocated from it.
    `progress` is called as the header and each piece complete (the round's Watchdog).
    """
    raw = transport.await_header(announced.version, header_timeout_seconds)
    try:
        wire.check_header_length(len(raw))
        progress()
        header = wire.RoundHeader.decode(raw, key)
        said = (header.epoch, header.version, header.incarnation)
        if said != (announced.epoch, announced.version, announced.incarnation):
            raise wire.WireError(
                f"header for version {header.version} of epoch {header.epoch} from trainer incarnation "
                f"{header.incarnation}, but the trainer announced version {announced.version} of epoch "
                f"{announced.epoch} from incarnation {announced.incarnation}"
            )
    except wire.WireError:
        transport.close()
        raise
    try:
        mac: wire.PayloadMac | None = wire.PayloadMac.of(header, key)
        reason = None
    except wire.WireError as exc:  # a genuine header this receiver cannot check: follow the round, refuse it
        mac, reason = None, str(exc)
    buckets = allocate(header.bucket_sizes, transport.device)
    # Every piece is posted at once; each is checked as it lands while the following ones are still arriving.
    pieces = [piece for bucket in buckets for piece in transport.pieces(bucket)]
    pending = [transport.start_broadcast(piece) for piece in pieces]
    for piece, op in zip(pieces, pending, strict=True):
        op.wait()  # on a GPU: the current stream waits for it, so `land`'s copy on that stream follows it
        transport.check_open("a piece of the payload")  # an aborted receive returns normally on NCCL
        landed = land(piece)
        if mac is not None:
            mac.update(landed)
        progress()
    if mac is not None:
        try:
            wire.verify(header, buckets, key, computed=mac.hexdigest())
        except wire.WireError as exc:
            reason = str(exc)
    return header, buckets, reason


def report_status(transport: Transport, code: int) -> None:
    """The round's closing all-reduce: this rank's code in its own slot (the sender's is 0). It waits for the slowest
    replica's activation: the caller gives it CLOSING_TIMEOUT_SECONDS on the round's watchdog, not the per-piece
    progress bound (on gloo each collective keeps that bound too: gloo.GlooTransport.all_reduce_sum)."""
    status = torch.zeros(transport.world_size, dtype=torch.int64, device=transport.device)
    status[transport.rank] = code
    transport.all_reduce_sum(status)
    # Cut (this member's watchdog, a newer join), NCCL's all-reduce returns normally: the member must leave the
    # group, not stay joined to a closed one that the next round then waits on.
    transport.check_open("the closing status")


class AdapterReceiver:
    """The sync-group member of one inference replica for one job (a pool's replica holds one per attached job,
    each in that job's own group, with that job's key)."""

    def __init__(
        self,
        sink: AdapterSink,
        *,
        replica_index: int,
        fingerprint: str,
        key: bytes,
        device: torch.device | None = None,
        on_round: Callable[[RoundOutcome], None] | None = None,
        on_error: Callable[[str], None] | None = None,
        name: str = "job",
        allocate: Allocate = allocate_apart,
        land: Land = wire.on_host,
        thread_context: Callable[[], AbstractContextManager] | None = None,
    ):
        self._sink = sink
        self._allocate = allocate  # where each round lands (the staging segment of a member in vLLM's worker)
        self._land = land
        # Entered by the receiver thread for its whole life: a member on a GPU receives on a CUDA stream of its own.
        self._thread_context = thread_context or contextlib.nullcontext
        self.name = name  # the job, in its log lines (a pool server holds one receiver per job)
        self.replica_index = replica_index
        self.fingerprint = fingerprint
        self._key = key  # the MAC key of this job's rounds (wire.round_key of its token)
        self._device = device
        self._on_round = on_round
        self._on_error = on_error  # called with a short kind: formation, interrupted, refused
        self._commands: queue.Queue[JoinRequest | PrepareRequest | None] = queue.Queue()
        self._lock = threading.Lock()
        self._transport: Transport | None = None
        self._joined: JoinRequest | None = None  # the epoch whose group is formed
        self._pending_join: JoinRequest | None = None
        self._required_version = 0
        # Fencing: the newest trainer incarnation seen (joins, rounds and versions of older ones are refused), and
        # the incarnation of the trainer whose round is live (its version numbers are that trainer's).
        self._incarnation = 0
        self._live_incarnation = 0
        self._has_joined = False
        self._busy = False
        self._last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"adapter-receiver-{name}", daemon=True)
        self._thread.start()

    # ---- control (called from the HTTP handlers) -------------------------------------------------------------

    def state(self) -> MemberState:
        with self._lock:
            joined = self._joined
            return MemberState(
                replica_index=self.replica_index,
                fingerprint=self.fingerprint,
                epoch=joined.epoch if joined else None,
                rank=joined.rank if joined else None,
                live_version=self._sink.live_version,
                live_incarnation=self._live_incarnation,
                incarnation=self._incarnation,
                required_version=self._required_version,
                busy=self._busy,
                last_error=self._last_error,
            )

    @property
    def ready(self) -> bool:
        """Has been in a group and serves at least the version the trainer last called current.

        A replacement replica is not ready before its first adapter arrives; a member whose group is re-forming
        stays ready, since it still serves the current version.
        """
        with self._lock:
            return self._has_joined and self._sink.live_version >= self._required_version

    @property
    def asked(self) -> bool:
        """Its trainer has asked it to join a group at least once (whether or not the group formed)."""
        with self._lock:
            return self._has_joined or self._pending_join is not None

    def join(self, request: JoinRequest) -> None:
        if request.trainer_fingerprint != self.fingerprint:
            raise FingerprintMismatch(
                f"base model fingerprint mismatch: the trainer loaded {request.trainer_fingerprint}, this replica "
                f"(index {self.replica_index}) loaded {self.fingerprint}; both must load the same model, revision "
                "and files"
            )
        with self._lock:
            self._refuse_stale(request.incarnation, f"a join of epoch {request.epoch}")
            self._incarnation = request.incarnation
            self._pending_join = request
            self._required_version = max(self._required_version, request.current_version)
            joined = self._joined
            # A newer epoch means the trainer gave up on the old group (a newer incarnation: another trainer took
            # over). If this member is inside one of that group's rounds, abandoned when another member's prepare
            # failed or a member died, it may wait there for the whole sync.timeoutSeconds: NCCL over P2P/NVLink/SHM
            # does not surface a peer's abort. Close its side now, so the round fails at once and the thread takes
            # this join within sync.joinTimeoutSeconds.
            superseded = joined is not None and (
                joined.epoch < request.epoch or joined.incarnation < request.incarnation
            )
            stale = self._transport if self._busy and superseded else None
        if stale is not None:
            log.warning("adapter sync of %s: leaving epoch %d for %d mid-round", self.name, joined.epoch, request.epoch)
            stale.close()
        self._commands.put(request)

    def _refuse_stale(self, incarnation: int, what: str) -> None:
        """StaleIncarnation for a request of a trainer older than the newest seen (called under the lock)."""
        if incarnation < self._incarnation:
            raise StaleIncarnation(
                f"{what} from trainer incarnation {incarnation} refused: this replica (index {self.replica_index}) "
                f"follows incarnation {self._incarnation}, a newer trainer of this job"
            )

    def prepare(self, request: PrepareRequest) -> None:
        with self._lock:
            self._refuse_stale(request.incarnation, f"the round of version {request.version}")
            target = self._pending_join or self._joined
            if target is None or target.epoch != request.epoch:
                have = target.epoch if target else None
                raise StaleEpoch(f"round for epoch {request.epoch}, but this replica is in epoch {have}")
        self._commands.put(request)

    def close(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=30)
        self._leave()

    # ---- the worker thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        with self._thread_context():
            self._serve()

    def _serve(self) -> None:
        while (command := self._commands.get()) is not None:
            with self._lock:
                self._busy = True
            try:
                if isinstance(command, JoinRequest):
                    self._form(command)
                else:
                    self._round(command)
            except Exception as exc:  # the thread must survive anything and keep the old version serving
                log.exception("adapter sync: %s failed", type(command).__name__)
                kind = "formation" if isinstance(command, JoinRequest) else "interrupted"
                self._fail(kind, f"{type(command).__name__}: {exc}")
            finally:
                with self._lock:
                    self._busy = False

    def _form(self, request: JoinRequest) -> None:
        self._leave()
        with self._lock:
            if self._pending_join is not request:
                return  # a newer join arrived while this one waited in the queue
        store = connect_store(
            request.store_addr, request.store_port, is_master=False, timeout_seconds=request.join_timeout_seconds
        )
        transport = create_transport(
            request.backend,  # type: ignore[arg-type]
            store,
            epoch=request.epoch,
            rank=request.rank,
            world_size=request.world_size,
            timeout_seconds=request.timeout_seconds,
            join_timeout_seconds=request.join_timeout_seconds,
            progress_timeout_seconds=request.progress_timeout_seconds,
            device=self._device,
        )
        with self._lock:
            self._transport, self._joined, self._last_error = transport, request, None
            self._has_joined = True
            if self._pending_join is request:
                self._pending_join = None
        log.info(
            "adapter sync of %s: joined epoch %d as rank %d of %d",
            self.name,
            request.epoch,
            request.rank,
            request.world_size,
        )

    def _round(self, request: PrepareRequest) -> None:
        with self._lock:
            transport, joined = self._transport, self._joined
        if transport is None or joined is None or joined.epoch != request.epoch:
            self._fail("interrupted", f"round for epoch {request.epoch} arrived outside that epoch's group")
            return
        # A round that stops moving is cut here too (watchdog.py): the member leaves the group, whatever the
        # trainer's side does, and takes the next epoch's join.
        what = f"round {request.version} of epoch {request.epoch}"
        with Watchdog(joined.progress_timeout_seconds, transport.close, what=what) as watchdog:
            outcome = self._take_part(request, transport, watchdog, joined.timeout_seconds)
        if outcome is not None and self._on_round is not None:
            self._on_round(outcome)

    def _take_part(
        self, request: PrepareRequest, transport: Transport, watchdog: Watchdog, timeout_seconds: float
    ) -> RoundOutcome | None:
        """Receive, verify, activate and report one round; the outcome, or None if it was interrupted."""
        started = time.perf_counter()
        try:
            header, buckets, reason = receive_round(
                transport,
                self._key,
                request,
                self._allocate,
                self._land,
                progress=watchdog.progress,
                header_timeout_seconds=timeout_seconds,  # the watchdog's cut comes first where it is on
            )
        except (TransportError, wire.WireError) as exc:
            if isinstance(exc, TransportError):
                exc = watchdog.explain(exc)
            self._fail("interrupted", f"round {request.version} of epoch {request.epoch} interrupted: {exc}")
            return None
        received = time.perf_counter()
        outcome = RoundOutcome(
            version=header.version,
            epoch=header.epoch,
            verified=reason is None,
            activated=False,
            reason=reason,
            bytes=header.total_bytes,
            receive_seconds=received - started,
            activate_seconds=0.0,
        )
        code = REFUSED
        if reason is None:
            code = VERIFIED
            with self._lock:
                newer = self._incarnation if header.incarnation < self._incarnation else None
                live_incarnation = self._live_incarnation
            if newer is not None:  # a newer trainer joined while this round ran: its sender is a stale one
                code, reason = REFUSED, f"round from trainer incarnation {header.incarnation}, older than {newer}"
            elif header.version == self._sink.live_version and header.incarnation != live_incarnation:
                # A catch-up of a number this replica already serves from another trainer (one cut off from the
                # sender made it live here): it cannot go live twice, and acknowledged, that trainer would count
                # this replica as serving its weights. Its next version replaces it.
                code = OTHER_WEIGHTS
                reason = (
                    f"version {header.version} is live here from another trainer incarnation ({live_incarnation}), "
                    f"not from {header.incarnation}"
                )
            # Never back to (or again to) a version at or below the live one: versions only grow. A re-sent
            # current version (to catch another member up) verifies and leaves this replica as it is.
            elif header.version > self._sink.live_version:
                watchdog.progress(within=CLOSING_TIMEOUT_SECONDS)  # the activation has its own bound, not progress's
                try:
                    self._sink.activate(
                        header.version,
                        wire.unpack(header, buckets),
                        dict(header.adapter_config),
                        incarnation=header.incarnation,
                    )
                    outcome.activated = True
                    with self._lock:
                        self._live_incarnation = header.incarnation
                except Exception as exc:  # the engine refused it: the older version keeps serving
                    log.exception("adapter sync: version %d verified but not activated", header.version)
                    reason = f"activation failed: {type(exc).__name__}: {exc}"
                    code = ACTIVATION_FAILED
                    with self._lock:  # not ready (readiness probe) until a round brings this version live
                        self._required_version = max(self._required_version, header.version)
                outcome.activate_seconds = time.perf_counter() - received
        else:
            log.error("adapter sync: refused version %d: %s", header.version, reason)
        if reason is not None and self._on_error is not None:
            self._on_error("activation" if code == ACTIVATION_FAILED else "refused")
        with self._lock:
            self._last_error = reason
        # Activated (or refused): the closing status is the round's last piece, and waits for the other replicas'
        # activations.
        watchdog.progress(within=CLOSING_TIMEOUT_SECONDS)
        try:
            report_status(transport, code)  # only now: the sender counts VERIFIED as serving this version
        except TransportError as exc:
            exc = watchdog.explain(exc)
            self._fail("interrupted", f"round {request.version} of epoch {request.epoch} interrupted: {exc}")
            return None
        return outcome

    def _fail(self, kind: str, reason: str) -> None:
        log.error("adapter sync of %s: %s", self.name, reason)
        if self._on_error is not None:
            self._on_error(kind)
        self._leave()
        with self._lock:
            self._last_error = reason

    def _leave(self) -> None:
        with self._lock:
            transport, self._transport, self._joined = self._transport, None, None
        if transport is not None:
            transport.close()
