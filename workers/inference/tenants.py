"""The jobs an inference server serves: a job's own server holds one (the job itself), a RolloutPool's server the
ones its attachment list names. The same code serves both; nothing is forked for the pool.

Each tenant is one job: its bearer token (known only as a SHA-256, `auth`), its adapter book on the shared vLLM
engine (own versions, own LoRA ids and folders), its own sync member (in vLLM's worker: own group with the job's
trainer, own store, epoch and version counter, the job's MAC key, own receiver thread and staging), and its own
in-flight cap.

Readiness (GET /ready) is the conjunction over tenants of `tenant_ready`:
- a tenant whose trainer has asked this replica to join serves at least the version that trainer called current
  (strict, as a job's own server always was): a replacement replica of a pool is thereby not ready until every
  attached job whose trainer reached it has sent it its current adapter, and trainers reach a new replica at their
  next step (AdapterSender.refresh);
- a tenant never asked to join, attached when the server started (a replacement replica, a pool starting), holds
  readiness back for `join_grace_seconds`: long enough for a running job's trainer to find the replica at its next
  step and send it the current adapter, yet bounded, since the job's trainer may not be running at all. A pool's
  grace is its adapterWaitSeconds (how long rollouts wait for an adapter anyway);
- a tenant never asked to join, attached to a server already serving, holds nothing back: the operator attaches a
  job before its trainer runs (pending pods, a slow model download), and that must not take the replica out of
  service for every other job. Its trainer's first join is at version 0, or catches the replica up at once.
A job's own server has no grace (None): it serves nobody else, and is not ready before its trainer has sent it the
current adapter, as before.
Rollouts are never sent to a replica that does not serve the version they ask for (the trainer's sender tracks
that per member), so readiness decides only what the pod reports, never which adapter a rollout runs under.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import hmac
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from grpolora.api.pool import Attachment, Attachments, PoolReplicas, replicas_file
from grpolora.api.spec import RolloutPoolSpec
from grpolora.workers.inference import metrics
from grpolora.workers.inference.adapter_book import AdapterBook
from grpolora.workers.inference.member_link import RemoteMember
from grpolora.workers.inference.vllm_engine import VllmEngine
from grpolora.workers.sync.receiver import AdapterReceiver

SyncMember = AdapterReceiver | RemoteMember
"""A tenant's sync member as the HTTP handlers use it: in a server, a RemoteMember (the member itself is in vLLM's
worker, workers/inference/member_host.py); in tests of the app alone, an AdapterReceiver in this process."""

log = logging.getLogger(__name__)


def tenant_ready(*, asked: bool, current: bool, attached_seconds: float, grace: float | None) -> bool:
    """Whether one tenant lets the server report ready (see the module docstring). `asked`: its trainer has asked
    this replica to join; `current`: it is in the group and serves the version the trainer called current."""
    if asked:
        return current
    return grace is not None and attached_seconds >= grace


class FairGate:
    """At most `limit` sequences of one job in vLLM at once; the job's other prompts wait in arrival order (FIFO).

    vLLM schedules first come, first served: without a cap, a job sending a thousand prompts would fill vLLM's
    queue and every other job's prompts would wait behind all of them. With a cap per job, each job's backlog waits
    in its own queue here and the others' prompts enter vLLM at once (and are batched with it). A prompt asking for
    more sequences than the cap enters alone when nothing of its job runs. `limit` None: no cap (a job's own
    server)."""

    def __init__(self, limit: int | None, on_change: Callable[[int, int], None] | None = None):
        self.limit = limit
        self.in_flight = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        self._on_change = on_change

    @property
    def waiting(self) -> int:
        return sum(n for n, future in self._waiting if not future.done())

    def _fits(self, sequences: int) -> bool:
        return self.limit is None or self.in_flight == 0 or self.in_flight + sequences <= self.limit

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.in_flight, self.waiting)

    def _wake(self) -> None:
        while self._waiting and self._fits(self._waiting[0][0]):
            sequences, future = self._waiting.popleft()
            if future.done():  # its request was cancelled while it waited
                continue
            self.in_flight += sequences
            future.set_result(None)

    @contextlib.asynccontextmanager
    async def admit(self, sequences: int) -> AsyncIterator[None]:
        if not self._waiting and self._fits(sequences):
            self.in_flight += sequences
        else:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append((sequences, future))
            self._changed()
            try:
                await future
            except asyncio.CancelledError:
                if future.done() and not future.cancelled():  # admitted just as it was cancelled: give it back
                    self.in_flight -= sequences
                    self._wake()
                self._changed()
                raise
        self._changed()
        try:
            yield
        finally:
            self.in_flight -= sequences
            self._wake()
            self._changed()


@dataclass
class Tenant:
    """One job served here."""

    job: str  # "<namespace>/<name>" (grpolora.api.pool.job_key): the metrics' label, the pool status's key
    auth: str  # hex SHA-256 of the job's bearer token
    book: AdapterBook
    receiver: SyncMember
    gate: FairGate
    attached_at: float = field(default_factory=time.monotonic)
    awaited: bool = True  # attached as the server started: readiness waits (up to the grace) for its trainer
    remake: Callable[[], SyncMember] | None = None  # a new sync member for this job, made as its first was
    lost: str | None = None  # why its lost member could not be replaced (then /health fails: the replica goes)
    _remaking: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def member(self) -> SyncMember:
        """The job's sync member for its trainer's join. One whose channel to vLLM's worker was lost (RemoteMember
        .lost: a control call timed out, e.g. behind an NCCL abort of the stale group, and its channel was closed)
        answers nothing from then on, while the server stays healthy: it is replaced by a new member first, so
        that the trainer's next join re-forms the group with this replica. When the worker cannot attach a new one
        (a GPU budget still held by the old one, a link that no longer answers), `lost` says why, /health fails and
        the replica is replaced."""
        with self._remaking:
            old = self.receiver
            why = getattr(old, "lost", None)
            if why is None or self.remake is None:
                return old
            log.warning("%s: its sync member's channel was lost (%s); attaching a new member", self.job, why)
            try:
                self.receiver = self.remake()
            except Exception as exc:
                self.lost = f"the sync member of {self.job} was lost ({why}) and could not be attached again: {exc}"
                raise
            self.lost = None
        # The old member's worker end leaves once its own call returns; closing waits for that, off this thread.
        threading.Thread(target=old.close, name=f"member-close-{self.job}", daemon=True).start()
        return self.receiver

    def ready(self, grace: float | None) -> bool:
        return tenant_ready(
            asked=self.receiver.asked,
            current=self.receiver.ready,
            attached_seconds=time.monotonic() - self.attached_at,
            grace=grace if self.awaited else 0,
        )


def token_digest(authorization: bytes) -> str | None:
    """The SHA-256 of the bearer token in an Authorization header, or None if it holds none."""
    scheme, _, token = authorization.partition(b" ")
    if scheme != b"Bearer" or not token:
        return None
    return hashlib.sha256(token).hexdigest()


class Tenants:
    """The jobs served here, found by their bearer token."""

    def __init__(self, *, join_grace_seconds: float | None, default_job: str | None = None):
        self._by_job: dict[str, Tenant] = {}
        self.grace = join_grace_seconds
        self.default_job = default_job  # a job's own server: the job a request that names none is about
        self._releasing: set[asyncio.Task[None]] = set()  # detached jobs whose adapters are being unloaded
        self.started = False  # false while the engine starts: every guarded path answers 503
        self.on_detach: list[Callable[[str], None]] = []  # told a job's name as it is detached (its chat sessions go)

    def __iter__(self):
        return iter(list(self._by_job.values()))

    def __len__(self) -> int:
        return len(self._by_job)

    def get(self, job: str) -> Tenant | None:
        return self._by_job.get(job)

    def find(self, authorization: bytes) -> Tenant | None:
        """The tenant whose token the header presents (compared in constant time against every tenant)."""
        digest = token_digest(authorization)
        if digest is None:
            return None
        found = None
        for tenant in self._by_job.values():
            if hmac.compare_digest(digest, tenant.auth):
                found = tenant
        return found

    def attach(self, tenant: Tenant) -> None:
        assert tenant.job not in self._by_job, f"{tenant.job} is attached already"
        tenant.book.bind()
        tenant.awaited = not self.started
        self._by_job[tenant.job] = tenant
        metrics.ADAPTER_VERSION.labels(job=tenant.job).set(tenant.book.live_version)
        log.info("serving job %s", tenant.job)

    def detach(self, job: str) -> asyncio.Task[None]:
        """Its token is refused from now on. Then, in the background (other jobs attach meanwhile): its receiver
        leaves its group, its requests in flight finish, every adapter version of it is unloaded from vLLM and its
        folder removed. Returns that task."""
        tenant = self._by_job.pop(job)
        log.info("detaching job %s", job)
        for forget in self.on_detach:
            forget(job)
        task = asyncio.create_task(self._release(tenant))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)
        return task

    async def _release(self, tenant: Tenant) -> None:
        await asyncio.to_thread(tenant.receiver.close)
        await tenant.book.close()
        if tenant.job not in self._by_job:  # not attached again meanwhile (under a new token): its series go
            metrics.forget(tenant.job)
        log.info("job %s detached: its adapters are unloaded", tenant.job)

    @property
    def ready(self) -> bool:
        return self.started and all(t.ready(self.grace) for t in self)

    @property
    def lost(self) -> list[str]:
        """Why a tenant's sync member is lost for good (Tenant.member): each fails /health."""
        return [t.lost for t in self if t.lost is not None]


class AttachmentList:
    """A pool server's tenants kept in step with its attachment list (grpolora.api.pool), re-read whenever its
    content changes.

    The file is polled and compared by content, not by modification time: in a cluster it is a Secret volume,
    which the kubelet updates by swapping a symlink (the file's own mtime need not change). A file that cannot be
    read or parsed, names another pool, names a job twice or more jobs than maxJobs (a half-written file, an
    operator bug) is logged and the last good list kept: a bad write never drops every tenant."""

    def __init__(
        self,
        path: Path,
        *,
        pool: str,
        max_jobs: int,
        tenants: Tenants,
        make_tenant: Callable[[Attachment], Tenant],
        poll_seconds: float = 1.0,
    ):
        self.path = path
        self.pool = pool
        self.max_jobs = max_jobs
        self.tenants = tenants
        self._make_tenant = make_tenant
        self.poll_seconds = poll_seconds
        self._text: str | None = None  # the content last read (good or bad), so that each change is read once
        self._entries: dict[str, Attachment] = {}  # the last good list, by job
        self.list_error: str | None = None  # why the file as it is now is not used (None: it is)
        self._refused: dict[str, str] = {}  # listed jobs the member worker refused, with its reason
        self.replicas_path = replicas_file(path)
        self._replicas_text: str | None = None
        self.replicas: PoolReplicas | None = None  # the pool's replicas as last read well (None: none read yet)

    def _parse(self, text: str) -> dict[str, Attachment]:
        try:
            attachments = Attachments.from_json(text)
        except ValueError as exc:
            raise ValueError(f"not a valid attachment list: {exc}") from None
        if attachments.pool != self.pool:
            raise ValueError(f"it is the list of pool {attachments.pool!r}, this server belongs to {self.pool!r}")
        entries = {a.job: a for a in attachments.jobs}
        if len(entries) != len(attachments.jobs):
            raise ValueError("a job is listed twice")
        if len(entries) > self.max_jobs:
            raise ValueError(f"{len(entries)} jobs listed, the pool has slots for {self.max_jobs} (maxJobs)")
        return entries

    async def refresh(self) -> None:
        """Read the files; attach and detach to match the list if its content changed, and keep the pool's
        replicas."""
        await self._refresh_replicas()
        try:
            text = await asyncio.to_thread(self.path.read_text, encoding="utf-8")
        except OSError as exc:
            text = f"<unreadable: {exc}>"
            if text != self._text:
                self._text = text
                self.list_error = f"{self.path}: cannot be read ({exc}); keeping the last good list"
                log.error("attachment list %s", self.list_error)
            return
        if text == self._text:
            if self._refused:
                self._attach_missing()
            return
        self._text = text
        try:
            wanted = self._parse(text)
        except ValueError as exc:
            self.list_error = f"{self.path}: {exc}; keeping the last good list ({len(self._entries)} jobs)"
            log.error("attachment list %s", self.list_error)
            return
        self.list_error = None
        # A job whose token or key changed is another tenant: detached, then attached afresh.
        gone = [j for j, a in self._entries.items() if j not in wanted or _keys(a) != _keys(wanted[j])]
        self._entries = wanted
        for job in gone:
            self.tenants.detach(job)
        for job, entry in wanted.items():
            tenant = self.tenants.get(job)
            if tenant is not None:
                tenant.book.kept_versions = entry.kept_versions
        self._attach_missing()

    def _attach_missing(self) -> None:
        """Attach each job of the last good list not attached yet. One the member worker refuses (on a GPU: its
        member would not fit outside gpuMemoryUtilization, gpu_headroom.py) is left out, the others attached all the
        same, and tried again at every poll: a job detached a moment ago may still hold its member (it leaves in the
        background), and the job that replaces it must not wait for the next change of the list."""
        refused = {}
        for job, entry in self._entries.items():
            if self.tenants.get(job) is not None:
                continue
            try:
                self.tenants.attach(self._make_tenant(entry))
            except RuntimeError as exc:
                refused[job] = f"job {job} not attached: {exc}"
                if self._refused.get(job) != refused[job]:  # logged once, not at every poll
                    log.error("attachment list %s: %s", self.path, refused[job])
        self._refused = refused

    @property
    def error(self) -> str | None:
        """What of the list is not applied, and why (None: all of it is)."""
        refused = f"{self.path}: {'; '.join(self._refused.values())}" if self._refused else None
        return "; ".join(e for e in (self.list_error, refused) if e) or None

    async def _refresh_replicas(self) -> None:
        """The pool's replicas beside the list (absent: a pool of an earlier release; unreadable or invalid: the last
        good ones are kept, logged once per content)."""
        try:
            text = await asyncio.to_thread(self.replicas_path.read_text, encoding="utf-8")
        except FileNotFoundError:
            return
        except OSError as exc:
            text = f"<unreadable: {exc}>"
        if text == self._replicas_text:
            return
        self._replicas_text = text
        try:
            self.replicas = PoolReplicas.model_validate_json(text)
        except ValueError as exc:
            log.error("pool replicas %s: not valid (%s); keeping the last good ones", self.replicas_path, exc)

    async def watch(self) -> None:
        """Poll for changes until cancelled (never ends on an error: a pool outlives any one bad file)."""
        while True:
            await asyncio.sleep(self.poll_seconds)
            try:
                await self.refresh()
            except Exception:
                log.exception("attachment list %s: applying it failed", self.path)


def _keys(entry: Attachment) -> tuple[str, str]:
    return entry.auth, entry.sync_key


def pool_tenants(
    engine: VllmEngine,
    spec: RolloutPoolSpec,
    *,
    pool: str,
    jobs_file: Path,
    receiver: Callable[[AdapterBook, bytes, str], SyncMember],
    join_grace_seconds: float | None = None,
) -> AttachmentList:
    """A pool server's tenants, kept in step with its attachment list: each attached job gets an adapter book on
    the shared engine (its attachment's keptVersions), a receiver with its own key (`receiver`
    makes it from the book, the key and the job) and the pool's in-flight cap. Readiness waits for a job never
    heard from for `join_grace_seconds` (default: the pool's adapterWaitSeconds; see the module docstring)."""
    grace = spec.adapter_wait_seconds if join_grace_seconds is None else join_grace_seconds
    tenants = Tenants(join_grace_seconds=grace)
    incarnations = itertools.count()

    def make_tenant(entry: Attachment) -> Tenant:
        # Every attachment is an instance of its own on the engine (not one per job name): a job re-created under
        # its name (another uid), or detached and attached again, never shares a LoRA name with the earlier one
        # (AdapterBook._lora_name says why the names matter).
        incarnation = next(incarnations)
        book = AdapterBook(
            engine,
            kept_versions=entry.kept_versions,
            job=entry.job,
            instance=f"{entry.uid or 'no-uid'}.{incarnation}",
        )
        member = functools.partial(receiver, book, bytes.fromhex(entry.sync_key), entry.job)  # first, and any later
        return Tenant(
            job=entry.job,
            auth=entry.auth,
            book=book,
            receiver=member(),
            gate=FairGate(spec.max_in_flight_per_job, on_change=in_flight_gauges(entry.job)),
            remake=member,
        )

    return AttachmentList(jobs_file, pool=pool, max_jobs=spec.max_jobs, tenants=tenants, make_tenant=make_tenant)


def in_flight_gauges(job: str) -> Callable[[int, int], None]:
    def update(in_flight: int, waiting: int) -> None:
        metrics.IN_FLIGHT.labels(job=job).set(in_flight)
        metrics.WAITING.labels(job=job).set(waiting)

    return update
