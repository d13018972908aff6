"""The sending side of adapter sync, on trainer rank 0.

Trainer rank 0 hosts the rendezvous store, decides each epoch's membership, and sends every adapter version in
one round: header, buckets, closing status all-reduce. When a member dies or hangs mid-round, the collective
fails (at once, or after `timeout_seconds`); the sender then re-forms the group under the next epoch with the
members that still answer and sends the same version again. A member that comes back (a replacement pod) is
joined into the next epoch and receives the current adapter at once, before the trainer relies on it.

On a RolloutPool (`member_factory` given) the members follow the pool's replicas as its servers name them
(GET /v1/sync/pool, the newest generation any member reports): a replica a scale-up added becomes a member (and is
caught up like a replacement), one a scale-down removed stops being one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from grpolora.api.pool import PoolReplicas
from grpolora.api.spec import SyncSpec
from grpolora.workers.adapter import lora_b_scales
from grpolora.workers.sync import wire
from grpolora.workers.sync.control import (
    CLOSING_TIMEOUT_SECONDS,
    FingerprintMismatch,
    JoinRequest,
    Member,
    MemberState,
    MemberUnreachable,
    PrepareRequest,
    StaleEpoch,
    StaleIncarnation,
    SyncError,
)
from grpolora.workers.sync.groups import arrived_ranks, create_transport
from grpolora.workers.sync.receiver import ACTIVATION_FAILED, OTHER_WEIGHTS, REFUSED, VERIFIED
from grpolora.workers.sync.transport import Backend, Transport, TransportError
from grpolora.workers.sync.watchdog import Watchdog

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
PROGRESS_TIMEOUT_SECONDS: float = SyncSpec.model_fields["progress_timeout_seconds"].default
# A replica that answers but cannot join is tried again after this, doubling per failure up to the maximum.
REJOIN_BACKOFF_SECONDS = 30.0
MAX_REJOIN_BACKOFF_SECONDS = 600.0
# How long a re-formation waits for a replica to answer when none does: a replaced pod pulls its image and loads
# the model first, as at start (the trainer waits as long for the first group, main.STARTUP_WAIT_SECONDS).
REPLACEMENT_WAIT_SECONDS = 1800.0
REFUSAL_REASONS = {
    REFUSED: "payload MAC or size mismatch",
    ACTIVATION_FAILED: "activation failed: the engine could not load the version (see the replica's log)",
    OTHER_WEIGHTS: "it serves this version number from another trainer incarnation (replaced by the next version)",
}


Packed = tuple[wire.RoundHeader, list[torch.Tensor]]  # a round's header and buckets, as wire.pack makes them


@dataclass(frozen=True)
class RoundReport:
    version: int
    epoch: int
    members: tuple[int, ...]  # replica indices that verified this version
    refused: Mapping[int, str]  # replica index -> why it refused
    bytes: int
    seconds: float  # pack (on the first attempt) + prepare + broadcast + status, the last (successful) attempt
    transport_seconds: float  # header + buckets + status collectives only
    attempts: int
    finished_at: float = field(default_factory=time.time)


def send_round(
    transport: Transport,
    header: wire.RoundHeader,
    buckets: Sequence[torch.Tensor],
    key: bytes,
    on_bucket_sent: Callable[[int], None] | None = None,
    progress_seconds: float | None = None,
    announced: int | None = None,
) -> list[int]:
    """One round from sync rank 0, its header authenticated with `key`, once every member has acknowledged its
    prepare of round `announced` (by default the header's version); returns each rank's status code. A round in which
    no collective completes for `progress_seconds` is cut (Watchdog): TransportError, the transport closed."""
    raw = header.encode(key)
    version = header.version if announced is None else announced
    with Watchdog(progress_seconds, transport.close, what=f"round of version {header.version}") as watchdog:
        try:
            # The commit: called once every member acknowledged the prepare, so a round the sender gives up on (or
            # dies before) leaves no receive posted on a member (transport.py: the header goes through the store).
            transport.commit_header(version, raw)
            watchdog.progress()
            posted = [[transport.start_broadcast(piece) for piece in transport.pieces(bucket)] for bucket in buckets]
            for index, pending in enumerate(posted):
                for op in pending:
                    op.wait()
                    transport.check_open(f"bucket {index}")
                    watchdog.progress()
                if on_bucket_sent is not None:
                    on_bucket_sent(index)
            # Waits for every receiver to have loaded the version: a replica's activation counts as one piece, with
            # the activation's own bound (CLOSING_TIMEOUT_SECONDS) rather than progressTimeoutSeconds.
            watchdog.progress(within=CLOSING_TIMEOUT_SECONDS)
            status = torch.zeros(transport.world_size, dtype=torch.int64, device=transport.device)
            transport.all_reduce_sum(status)
            # Cut by the watchdog, NCCL's all-reduce returns normally with the slots that had arrived (usually
            # none): read as statuses, every replica would have "refused" the version. A lost replica instead.
            transport.check_open("the closing status")
        except TransportError as exc:
            raise watchdog.explain(exc) from None
        finally:
            # Read by every receiver before its first receive, so no longer needed once the round is over, however it
            # ended: left, each round's header stayed in trainer rank 0's store for the whole run.
            with contextlib.suppress(TransportError):
                transport.withdraw_header(version)
    return status.tolist()


class AdapterSender:
    def __init__(
        self,
        members: Sequence[Member],
        *,
        store: dist.Store,
        store_addr: str,
        store_port: int,
        backend: Backend,
        timeout_seconds: float,
        join_timeout_seconds: float,
        bucket_bytes: int,
        fingerprint: str,
        token: str,
        first_epoch: int = 0,
        first_version: int = 0,
        device: torch.device | None = None,
        on_bucket_sent: Callable[[int], None] | None = None,
        rejoin_backoff_seconds: float = REJOIN_BACKOFF_SECONDS,
        replacement_wait_seconds: float = REPLACEMENT_WAIT_SECONDS,
        wire_dtype: torch.dtype | None = None,
        member_factory: Callable[[int, str], Member] | None = None,
        progress_timeout_seconds: float | None = PROGRESS_TIMEOUT_SECONDS,
        incarnation: int = 0,
    ):
        self._members = {m.index: m for m in members}
        # On a pool: how to reach a replica the pool's servers name (index, base URL); None: the members are fixed.
        self._member_factory = member_factory
        self._pool_generation = -1  # of the pool's list of replicas the members follow
        self._store = store
        self._store_addr, self._store_port = store_addr, store_port
        self._backend = backend
        self._timeout = timeout_seconds
        self._join_timeout = join_timeout_seconds
        self._progress_timeout = progress_timeout_seconds  # a round stalled this long is cut (watchdog.py)
        self._bucket_bytes = bucket_bytes
        # The dtype adapters travel in: the model's (vLLM builds the LoRA in the model's dtype anyway, so a bf16 or
        # fp16 model is served the same adapter from half the bytes); None sends each tensor as it is.
        self._wire_dtype = wire_dtype
        self.fingerprint = fingerprint
        # Fencing: this trainer's start among the job's (grpolora.api.contract.TRAINER_INCARNATION). A replica that
        # has seen a newer one refuses this one's joins and rounds (StaleIncarnation: this trainer must stop), and a
        # version a replica holds from another incarnation never counts as this one's.
        self.incarnation = incarnation
        self._key = wire.round_key(token)
        self._device = device or torch.device("cpu")
        self._on_bucket_sent = on_bucket_sent
        self.epoch = first_epoch - 1  # the first formation makes it first_epoch (or later, see form_group)
        self.version = first_version
        self.group: tuple[int, ...] = ()  # replica indices in the current epoch, by sync rank - 1
        # The version each member is known to serve: from its state when the group forms, then from the rounds
        # it acknowledged (after activation). Rollouts go only to members serving the version they ask for.
        self._serving: dict[int, int] = {}
        # Members that answered but could not join: left out until the monotonic time given, then tried again.
        self._benched: dict[int, tuple[float, int]] = {}  # index -> (retry after, failures so far)
        self._rejoin_backoff = rejoin_backoff_seconds
        self._replacement_wait = replacement_wait_seconds
        self._transport: Transport | None = None
        self._last_round: Packed | None = None  # the current version as it was sent, for members behind it
        self._spare_buckets: list[torch.Tensor] = []  # of a round neither kept nor in flight: packed into next
        self._pool = ThreadPoolExecutor(max_workers=max(len(self._members), 1), thread_name_prefix="sync-control")
        self._lock = threading.RLock()  # one round or re-formation at a time, whichever thread asks
        # The live version and the members serving it, published together once a formation or a round has set
        # both (never half-way), and the old members less the lost ones while a re-formation runs: what other
        # threads read (live).
        self._live_changed = threading.Condition()
        self._live: tuple[int, tuple[int, ...]] = (first_version, ())
        self._closed = False

    # ---- membership --------------------------------------------------------------------------------------

    def serving(self, version: int) -> tuple[int, ...]:
        """Members of the group that serve `version` or a later one (rollouts may go to them)."""
        serving = self._serving  # replaced whole, never mutated: readable from any thread
        return tuple(i for i in self.group if serving.get(i, 0) >= version)

    def _set_serving(self, updates: Mapping[int, int]) -> None:
        self._serving = {**self._serving, **updates}

    def live(self, wait_seconds: float | None = None) -> tuple[int, tuple[int, ...]]:
        """(the live version, the members serving it), read together, for a thread other than the one sending (the
        rollout producer). While no member serves it -- the group is re-forming (empty for the joins and up to the
        join timeout), or every member is behind and being caught up -- it waits for one, up to `wait_seconds`
        (by default what re-forming may take: the round timeout plus a join timeout per attempt), then returns
        what there is."""
        if wait_seconds is None:
            wait_seconds = self._timeout + MAX_ATTEMPTS * self._join_timeout
        with self._live_changed:
            self._live_changed.wait_for(lambda: bool(self._live[1]) or self._closed, timeout=wait_seconds)
            return self._live

    def _publish(self, without: Sequence[int] = ()) -> None:
        """Make the current version and its serving members what `live` reads: after a formation or a round; and
        `without` the members found lost when a re-formation starts, so that the others keep serving rollouts
        while it runs (and, when none is left, `live` waits for it)."""
        with self._live_changed:
            self._live = (self.version, tuple(i for i in self.serving(self.version) if i not in without))
            self._live_changed.notify_all()

    def _states(self) -> dict[int, MemberState]:
        """Members that answer (and are not benched), with what they say about themselves."""
        now = time.monotonic()
        candidates = [m for i, m in self._members.items() if self._benched.get(i, (0.0, 0))[0] <= now]

        def probe(member: Member) -> MemberState | None:
            try:
                return member.state()
            except MemberUnreachable:
                return None

        found = dict(zip((m.index for m in candidates), self._pool.map(probe, candidates), strict=True))
        states = {index: state for index, state in found.items() if state is not None}
        if self._follow_pool(states):
            return self._states()
        return states

    def _follow_pool(self, answering: Mapping[int, MemberState]) -> bool:
        """On a pool: make the members the replicas of the newest list the answering members report (a scale-up's
        new ones added, a scale-down's removed ones dropped). True if the members changed."""
        if self._member_factory is None or not answering:
            return False

        def listed(member: Member) -> PoolReplicas | None:
            try:
                return member.pool_replicas()
            except MemberUnreachable:
                return None

        lists = [found for found in self._pool.map(listed, [self._members[i] for i in answering]) if found]
        if not lists:
            return False
        newest = max(lists, key=lambda found: found.generation)
        if newest.generation <= self._pool_generation:
            return False
        self._pool_generation = newest.generation
        # A replica's index names one StatefulSet ordinal (one DNS name, one local port): a member kept keeps its URL.
        wanted = dict(enumerate(newest.endpoints))
        if not wanted or set(wanted) == set(self._members):
            return False
        added, removed = sorted(set(wanted) - set(self._members)), sorted(set(self._members) - set(wanted))
        gone = [self._members[index] for index in removed]
        # Replaced whole, never mutated: the rollout threads read it (endpoint) while this runs.
        self._members = {
            index: self._members[index] if index in self._members else self._member_factory(index, url)
            for index, url in wanted.items()
        }
        for member in gone:
            closing = getattr(member, "close", None)
            if closing is not None:
                closing()
        for index in removed:
            self._benched.pop(index, None)
        log.info(
            "adapter sync: the pool's replicas are %s (generation %d): added %s, removed %s",
            sorted(wanted), newest.generation, added, removed,
        )  # fmt: skip
        return True

    def endpoint(self, index: int) -> str | None:
        """The base URL of member `index` (None: not a member now, or not reached over HTTP)."""
        return getattr(self._members.get(index), "base_url", None)

    def _bench(self, indices: Sequence[int], why: str) -> None:
        for index in indices:
            _, failures = self._benched.get(index, (0.0, 0))
            delay = min(self._rejoin_backoff * 2**failures, MAX_REJOIN_BACKOFF_SECONDS)
            self._benched[index] = (time.monotonic() + delay, failures + 1)
            log.warning("adapter sync: replica %d left out (%s); trying it again in %.0fs", index, why, delay)

    def form_group(self, *, wait_for_all_seconds: float = 0.0, wait_for_any_seconds: float = 0.0) -> tuple[int, ...]:
        """Form the next epoch with every member that answers, waiting up to `wait_for_all_seconds` for all of
        them, and up to `wait_for_any_seconds` for one when none answers (every replica lost at once: their
        replacements are starting).

        A member that answers but does not reach the group within the join timeout is left out (benched, and
        tried again after a back-off), and the epoch forms again without it, so one half-alive replica costs one
        join timeout, never the run."""
        started = time.monotonic()
        longest = max(wait_for_all_seconds, wait_for_any_seconds)
        while True:
            states = self._states()
            waited = time.monotonic() - started
            if len(states) == len(self._members) or waited >= longest or (states and waited >= wait_for_all_seconds):
                break
            time.sleep(0.5)
        if not states:
            raise SyncError(f"no inference replica answers ({len(self._members)} expected) after waiting {longest:g}s")
        for state in states.values():
            if state.incarnation > self.incarnation:
                raise StaleIncarnation(
                    f"inference replica {state.replica_index} follows trainer incarnation {state.incarnation}, newer "
                    f"than this trainer's {self.incarnation}: another trainer of this job has taken over; stopping"
                )
            if state.fingerprint != self.fingerprint:
                raise FingerprintMismatch(
                    f"base model fingerprint mismatch: the trainer loaded {self.fingerprint}, inference replica "
                    f"{state.replica_index} loaded {state.fingerprint}; both must load the same model, revision "
                    "and files"
                )
        # Versions and epochs never go backwards, also across trainer restarts: start past what replicas hold.
        self.version = max([self.version, *(s.live_version for s in states.values())])
        self.epoch = max([self.epoch, *(s.epoch for s in states.values() if s.epoch is not None)])
        candidates = sorted(states)
        for _ in range(MAX_ATTEMPTS):
            self.epoch += 1
            self._leave()
            left_out = self._form(candidates)
            if not left_out:
                self.group = tuple(candidates)
                # A version number means these weights only if this trainer sent it: a restarted trainer (resumed
                # from an older checkpoint) goes on numbering past what replicas hold, and catches them up.
                self._serving = {
                    i: states[i].live_version if states[i].live_incarnation == self.incarnation else 0
                    for i in candidates
                }
                self._publish()
                log.info("adapter sync: epoch %d formed with replicas %s", self.epoch, list(candidates))
                return self.group
            candidates = [i for i in candidates if i not in left_out]
            if not candidates:
                break
        raise SyncError(f"could not form the sync group: no replica of {sorted(states)} joined epoch {self.epoch}")

    def _form(self, candidates: list[int]) -> list[int]:
        """Form this epoch with `candidates`. Returns the members left out (empty: the group formed); raises
        TransportError when it failed without anyone to blame (every member reached it)."""
        world_size = 1 + len(candidates)

        def join(rank: int, index: int) -> int | None:
            try:
                self._members[index].join(
                    JoinRequest(
                        epoch=self.epoch,
                        rank=rank,
                        world_size=world_size,
                        store_addr=self._store_addr,
                        store_port=self._store_port,
                        backend=self._backend,
                        timeout_seconds=self._timeout,
                        join_timeout_seconds=self._join_timeout,
                        progress_timeout_seconds=self._progress_timeout,
                        trainer_fingerprint=self.fingerprint,
                        current_version=self.version,
                        incarnation=self.incarnation,
                    )
                )
            except MemberUnreachable:
                return index
            return None

        refused = [i for i in self._pool.map(join, range(1, world_size), candidates) if i is not None]
        if refused:
            self._bench(refused, "its join request failed")
            return refused
        try:
            self._transport = create_transport(
                self._backend,
                self._store,
                epoch=self.epoch,
                rank=0,
                world_size=world_size,
                timeout_seconds=self._timeout,
                join_timeout_seconds=self._join_timeout,
                progress_timeout_seconds=self._progress_timeout,
                device=self._device,
                free_cached_memory=True,  # this process is the trainer's, never vLLM's
            )
        except TransportError:
            arrived = arrived_ranks(self._store, self.epoch, world_size)
            missing = [index for rank, index in enumerate(candidates, start=1) if rank not in arrived]
            if not missing:
                raise
            self._bench(missing, f"it did not join epoch {self.epoch} within {self._join_timeout:g}s")
            return missing
        return []

    def refresh(self) -> bool:
        """Re-form if membership changed (a member lost, replaced or back); then every member behind the current
        version gets it at once, before rollouts go to it.

        Returns True if the group changed. Cheap when nothing changed: per member, one state request and one for
        the pool's list of replicas (a job's own servers answer that one with 404: they have none).
        """
        with self._lock:
            return self._refresh()

    def _refresh(self) -> bool:
        states = self._states()
        lost = [i for i in self.group if i not in states or states[i].epoch != self.epoch]
        new = [i for i in states if i not in self.group]
        changed = bool(lost or new or self._transport is None)
        if changed:
            log.info("adapter sync: membership changed (lost or replaced %s, new %s); re-forming", lost, new)
            self._publish(without=lost)
            self._form_with_retries()
        self._catch_up()
        return changed

    def _catch_up(self) -> None:
        """Send the current version again if any member of the group does not serve it (a newcomer, a replaced
        replica, one whose activation failed); members that already serve it verify and keep it."""
        if self._last_round is None or len(self.serving(self.version)) == len(self.group):
            return
        self._send_attempts(self._last_round, self.version)

    def _form_with_retries(self) -> None:
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                self.form_group(wait_for_any_seconds=self._replacement_wait)
                return
            except (TransportError, MemberUnreachable, StaleEpoch) as exc:
                log.warning("adapter sync: forming epoch %d failed (attempt %d): %s", self.epoch, attempt, exc)
                self._leave()
        raise SyncError(f"could not form the sync group after {MAX_ATTEMPTS} attempts")

    # ---- rounds ------------------------------------------------------------------------------------------

    def send(self, tensors: Mapping[str, torch.Tensor], adapter_config: Mapping) -> RoundReport:
        """Send the adapter as the next version to every member; re-forms and retries on member failure."""
        with self._lock:
            if self._transport is None:
                self._form_with_retries()
            assert self._transport is not None
            version, started = self.version + 1, time.perf_counter()
            # What cannot travel is refused before any member is told to expect it; the members then prepare (an
            # HTTP round trip each) while the round is packed. Packed once, into a copy in the wire dtype: every
            # attempt, and any later catch-up, sends these bytes.
            wire.plan_buckets(tensors, self._bucket_bytes, self._wire_dtype)
            preparing = self._prepare(version)
            # vLLM multiplies lora_B by the scaling as it builds a LoRA, in place, in the engine's thread between
            # steps; folded here instead, by the multiply that takes the copy's place in the pack, the receivers
            # get an equivalent adapter whose scaling is 1 (per-module scalings travel as they are).
            adapter_config, scales = lora_b_scales(tensors, adapter_config)
            packed = wire.pack(
                tensors,
                key=self._key,
                version=version,
                epoch=self.epoch,
                bucket_bytes=self._bucket_bytes,
                incarnation=self.incarnation,
                device=self._transport.device,
                adapter_config=adapter_config,
                dtype=self._wire_dtype,
                reuse=self._spare_buckets,
                scales=scales,
            )
            self._spare_buckets = []
            try:
                report = self._send_attempts(packed, version, started, preparing)
            except BaseException:
                self._spare_buckets = packed[1]  # never kept: free for the next round
                raise
            # The last round's buckets stay as they are for members behind it; the ones they replace are free.
            replaced, self._last_round = self._last_round, packed
            self._spare_buckets = replaced[1] if replaced is not None else []
            return report

    def _send_attempts(
        self,
        packed: Packed,
        version: int,
        packing_started: float | None = None,
        preparing: list[Future[None]] | None = None,
    ) -> RoundReport:
        """`preparing`: the first attempt's prepare calls, already under way (see send)."""
        # What went wrong, as text: an exception kept here holds its traceback, whose frame holds it (a reference
        # cycle), and with it the failed epoch's transport and pending collectives until some later garbage
        # collection tears that group down, in whatever thread it runs, blocked until gloo gives up on it.
        last_error = ""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                first = attempt == 1
                report = self._send_once(
                    packed, version, attempt, packing_started if first else None, preparing if first else None
                )
            except (TransportError, MemberUnreachable, StaleEpoch) as exc:
                last_error = str(exc)
                log.warning("adapter sync: round %d failed in epoch %d: %s; re-forming", version, self.epoch, exc)
                self._leave()
                self._form_with_retries()
                continue
            self.version = version
            self._set_serving({index: version for index in report.members})
            self._publish()
            if report.refused:
                # Verified nowhere is a failure; verified on some means the others get it next round.
                if not report.members:
                    raise SyncError(f"every replica refused version {version}: {dict(report.refused)}")
                log.error("adapter sync: version %d refused by %s", version, dict(report.refused))
            return report
        raise SyncError(f"version {version} could not be sent after {MAX_ATTEMPTS} attempts: {last_error}")

    def _prepare(self, version: int) -> list[Future[None]]:
        """Tell every member of the group to expect `version` in this epoch (one call each, in parallel)."""
        request = PrepareRequest(epoch=self.epoch, version=version, incarnation=self.incarnation)
        assert self._transport is not None
        try:
            self._transport.withdraw_header(version)  # a catch-up's earlier header of this version is not this one's
        except TransportError as exc:  # raised where the prepares are waited for: the round is tried again
            failed: Future[None] = Future()
            failed.set_exception(exc)
            return [failed]
        return [self._pool.submit(self._members[index].prepare, request) for index in self.group]

    def _send_once(
        self,
        packed: Packed,
        version: int,
        attempt: int,
        started: float | None = None,
        preparing: list[Future[None]] | None = None,
    ) -> RoundReport:
        """One attempt at sending `packed` (the header as packed, in the group's epoch now) as `version`, the version
        the members are told to expect (a header that says otherwise is refused)."""
        assert self._transport is not None
        started = started or time.perf_counter()
        header, buckets = packed
        header = dataclasses.replace(header, epoch=self.epoch)
        for call in preparing if preparing is not None else self._prepare(version):
            call.result()  # the first failure raises, as the calls were made: the round is not sent
        sent = time.perf_counter()
        codes = send_round(
            self._transport, header, buckets, self._key, self._on_bucket_sent, self._progress_timeout, announced=version
        )
        finished = time.perf_counter()
        verified = tuple(index for rank, index in enumerate(self.group, start=1) if codes[rank] == VERIFIED)
        refused = {
            index: REFUSAL_REASONS.get(codes[rank], f"status {codes[rank]}")
            for rank, index in enumerate(self.group, start=1)
            if codes[rank] != VERIFIED
        }
        return RoundReport(
            version=version,
            epoch=self.epoch,
            members=verified,
            refused=refused,
            bytes=header.total_bytes,
            seconds=finished - started,
            transport_seconds=finished - sent,
            attempts=attempt,
        )

    def _leave(self) -> None:
        transport, self._transport = self._transport, None
        self.group = ()
        if transport is not None:
            transport.close()

    def close(self) -> None:
        self._leave()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._live_changed:
            self._closed = True
            self._live_changed.notify_all()
