"""The sync members inside vLLM's worker (workers/inference/member_host.py; the HTTP process's end: member_link.py),
without vLLM: the worker's end runs in a process of its own (what `AdapterExtension.grpolora_member_host` starts
there), this process is the HTTP process's end with a recording book. The sender, the gloo collectives, the store
and the wire format are the real ones; tests/workers/test_inference_sync.py runs the same path inside real vLLM
engines."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

import pytest
import torch

from grpolora.workers.adapter import folded_scaling, lora_scaling
from grpolora.workers.inference.gpu_headroom import TenantBudget
from grpolora.workers.inference.member_host import StagingSink, serve_host
from grpolora.workers.inference.member_link import MemberLink, RemoteMember
from grpolora.workers.inference.payload import (
    SHM_DIR,
    STAGE_PREFIX,
    SharedPayload,
    StageOwner,
    process_start,
    stage_name,
    stage_owner,
    unpack_payload,
)
from grpolora.workers.inference.server import sync_member_factory
from grpolora.workers.sync import wire
from grpolora.workers.sync.control import FingerprintMismatch, JoinRequest, PrepareRequest, StaleEpoch, SyncError
from grpolora.workers.sync.sender import AdapterSender
from grpolora.workers.sync.transport import connect_store
from tests.workers.syncfakes import LORA_SCALINGS, LocalMember, free_port

TOKEN = "job-token"
KEY = wire.round_key(TOKEN)
TIMEOUT = 5.0
# How long a spawned worker end may take to start and connect (it imports torch: seconds on a machine under load).
LINK_TIMEOUT = 60.0


def worker_end(address: str, authkey_hex: str) -> None:
    """The member worker's end, as vLLM's first worker runs it: serves until the HTTP process's link closes."""
    serve_host(address, authkey_hex).finished.wait()


class RecordingBook:
    """The HTTP process's book: records what each staged activation mapped (as vLLM's workers map it)."""

    def __init__(self, fail: bool = False):
        self.adapters: dict[int, dict[str, torch.Tensor]] = {}
        self.configs: dict[int, dict] = {}
        self.segments: list[str] = []
        self.incarnations: dict[int, int] = {}
        self.fail = fail

    def activate_staged(self, version, segment, size, layout, adapter_config, *, incarnation: int) -> None:
        if self.fail:
            raise RuntimeError("the engine refused it")
        held = SharedPayload(segment, size)
        self.adapters[version] = unpack_payload(held, layout)
        self.configs[version] = adapter_config
        self.incarnations[version] = incarnation
        held.close()
        self.segments.append(segment)


def started_link(worker: Callable[[str, str], None] = worker_end) -> tuple[MemberLink, BaseProcess]:
    """A started MemberLink whose worker end `worker` is a process of its own (spawned: nothing of this process is
    inherited), and that process."""
    made = MemberLink(timeout_seconds=LINK_TIMEOUT)
    processes = []

    async def connect(address: str, authkey_hex: str) -> list[bool]:
        process = mp.get_context("spawn").Process(target=worker, args=(address, authkey_hex), daemon=True)
        process.start()
        processes.append(process)
        return [True]

    asyncio.run(made.start(connect))
    return made, processes[0]


@pytest.fixture
def link():
    made, process = started_link()
    yield made
    made.close()
    process.join(30)
    assert process.exitcode == 0, "the worker end did not leave when the HTTP process's link closed"


def adapter(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.q_proj.lora_A.weight": torch.randn(8, 64, generator=g),
        "layers.0.q_proj.lora_B.weight": torch.randn(64, 8, generator=g),
        "layers.1.q_proj.lora_A.weight": torch.randn(8, 64, generator=g).to(torch.bfloat16),
    }


def sender_for(members, port, store, **options) -> AdapterSender:
    return AdapterSender(
        members,
        store=store,
        store_addr="127.0.0.1",
        store_port=port,
        backend="gloo",
        bucket_bytes=1 << 12,  # several buckets, one staging segment
        fingerprint="fp",
        token=TOKEN,
        timeout_seconds=TIMEOUT,
        join_timeout_seconds=TIMEOUT,
        **options,
    )


def one_member(link: MemberLink) -> tuple[RecordingBook, RemoteMember, AdapterSender]:
    """Job "a"'s member on `link`, its recording book, and a sender whose group it is the only member of."""
    port = free_port()
    store = connect_store("127.0.0.1", port, is_master=True, timeout_seconds=TIMEOUT)
    book = RecordingBook()
    member = sync_member_factory(lambda: link, replica_index=0, fingerprint=lambda: "fp")(book, KEY, "a")
    return book, member, sender_for([LocalMember(0, member)], port, store)


def staged_names() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if name.startswith(STAGE_PREFIX)}


def staged_ahead(before: set[str], count: int = 1) -> dict[str, bytes]:
    """The segments staged for the next rounds (named since `before`), once `count` of them exist (each is made on
    its member's receiver thread after its round's closing all-reduce, which is when send() returns), and their
    bytes."""
    deadline = time.monotonic() + TIMEOUT
    while len(new := staged_names() - before) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(new) == count, f"staged ahead: {sorted(new)}, wanted {count}"
    contents = {}
    for name in new:
        with open(os.path.join(SHM_DIR, name), "rb") as segment:
            contents[name] = segment.read()
    return contents


def assert_unstaged_eventually(before: set[str]) -> None:
    """A closed member's worker end removes what it staged ahead (after answering the close: wait for it)."""
    deadline = time.monotonic() + TIMEOUT
    while staged_names() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert staged_names() == before, f"left in {SHM_DIR}: {sorted(staged_names() - before)}"


def test_rounds_are_received_in_the_worker_and_activated_from_its_staging_segment(link):
    """Two tenants on one link (two jobs on one engine): each round lands in the worker, verified, and the book
    maps the very segment it was received into, knowing which trainer incarnation published it (its leases are
    fenced by it, test_lease_fencing.py); each tenant's own key; nothing staged is left behind."""
    before = staged_names()
    port = free_port()
    store = connect_store("127.0.0.1", port, is_master=True, timeout_seconds=TIMEOUT)
    books = {"a": RecordingBook(), "b": RecordingBook()}
    rounds = []
    make = sync_member_factory(lambda: link, replica_index=0, fingerprint=lambda: "fp")
    remote = {job: make(book, KEY, job) for job, book in books.items()}
    remote["a"]._on_round = rounds.append
    senders = {}
    try:
        for job in ("a", "b"):
            # Each job its own group (a store of its own, as each job's trainer hosts one).
            job_port = port if job == "a" else free_port()
            job_store = (
                store if job == "a" else connect_store("127.0.0.1", job_port, is_master=True, timeout_seconds=TIMEOUT)
            )
            incarnation = {"a": 4, "b": 7}[job]
            senders[job] = sender_for([LocalMember(0, remote[job])], job_port, job_store, incarnation=incarnation)
            senders[job].form_group(wait_for_all_seconds=TIMEOUT)
        sent = {"a": adapter(1), "b": adapter(2)}
        for job in ("a", "b"):
            report = senders[job].send(sent[job], {"r": 8})
            assert report.version == 1
        for job, book in books.items():
            assert book.incarnations == {1: {"a": 4, "b": 7}[job]}
            assert set(book.adapters[1]) == set(sent[job])
            for name, tensor in sent[job].items():
                assert torch.equal(book.adapters[1][name], tensor)
            state = remote[job].state()
            assert state.live_version == 1 and state.rank == 1 and remote[job].ready
        assert [r.version for r in rounds] == [1] and rounds[0].activated
        # Every round's segment name removed once activated; what stays is each tenant's next segment, empty.
        ahead = staged_ahead(before, count=2)
        assert set(ahead).isdisjoint(segment for book in books.values() for segment in book.segments)
        assert all(not any(content) for content in ahead.values())
    finally:
        for sender in senders.values():
            sender.close()
        for member in remote.values():
            member.close()
    assert_unstaged_eventually(before)


def test_a_round_lands_in_the_segment_staged_for_it_between_rounds(link):
    """Making a round's staging segment and faulting its pages in as the bytes land took ~5-7 ms of each
    receiver's part of the round (BENCHMARKS.md): once a round has ended, the member makes the next one, of the
    same size, and touches its pages, so the next round lands in memory that is there. A round of another size
    makes its own; none of them is left named once the member has closed."""
    before = staged_names()
    book, member, sender = one_member(link)
    try:
        sender.form_group(wait_for_all_seconds=TIMEOUT)
        sender.send(adapter(1), {"r": 8})
        (first_ahead,) = staged_ahead(before)
        sender.send(adapter(2), {"r": 8})
        assert book.segments[1] == first_ahead, "round 2 landed in the segment staged after round 1"
        (second_ahead,) = staged_ahead(before)
        assert second_ahead not in book.segments, "a new one for round 3, never a segment that held a round"
        bigger = adapter(3) | {"layers.2.q_proj.lora_A.weight": torch.ones(8, 64)}
        sender.send(bigger, {"r": 8})
        assert book.segments[2] != second_ahead, "a round of another size gets a segment of its size"
        for name, tensor in bigger.items():
            assert torch.equal(book.adapters[3][name], tensor), name
        assert len(staged_ahead(before)) == 1, "the smaller one went"
    finally:
        sender.close()
        member.close()
    assert_unstaged_eventually(before)


def test_control_errors_come_back_as_the_receivers_own(link):
    member = sync_member_factory(lambda: link, replica_index=3, fingerprint=lambda: "fp")(RecordingBook(), KEY, "a")
    try:
        with pytest.raises(StaleEpoch):
            member.prepare(PrepareRequest(epoch=0, version=1))
        request = JoinRequest(
            epoch=0,
            rank=1,
            world_size=2,
            store_addr="127.0.0.1",
            store_port=free_port(),
            backend="gloo",
            timeout_seconds=1,
            join_timeout_seconds=1,
            trainer_fingerprint="other",
            current_version=0,
        )
        with pytest.raises(FingerprintMismatch):
            member.join(request)
        assert not member.asked and member.state().replica_index == 3
    finally:
        member.close()


def four_gib() -> int:
    """The fake GPU memory reading of the budgeted worker end (module level: the spawned process unpickles it)."""
    return 4 << 30


def budgeted_worker_end(address: str, authkey_hex: str) -> None:
    """A GPU replica's member worker end, its memory read as 4 GiB: at gpuMemoryUtilization 0.75, 1024 MiB are left
    outside vLLM's budget, where one tenant's 300 MiB adapter buffer and 256 MiB communicator fit and two do not."""
    budget = TenantBudget(total_bytes=four_gib, gpu_memory_utilization=0.75, adapter_bytes=300 << 20)
    serve_host(address, authkey_hex, budget=budget).finished.wait()


def test_a_gpu_replica_refuses_a_tenant_whose_sync_member_would_not_fit_outside_vllms_budget():
    """Issue 36: each tenant's member keeps a communicator and an adapter-sized buffer outside gpuMemoryUtilization;
    the worker refuses the attachment that would not fit, with the numbers, and keeps serving the tenants it has."""
    made, process = started_link(budgeted_worker_end)
    members = sync_member_factory(lambda: made, replica_index=0, fingerprint=lambda: "fp")
    first = members(RecordingBook(), KEY, "ns/a")
    try:
        with pytest.raises(RuntimeError) as refused:
            members(RecordingBook(), KEY, "ns/b")
        assert str(refused.value) == (
            "the member worker could not attach ns/b: job ns/b not attached: 2 tenants' sync members need 2 x "
            "(300 MiB adapter receive buffer + 256 MiB NCCL communicator) = 1112 MiB outside gpuMemoryUtilization "
            "0.75, which leaves 1024 MiB of the GPU's 4096 MiB; set gpuMemoryUtilization (a RolloutPool's spec, a "
            "job's inference) to at most 0.72, or lower maxJobs"
        )
        assert first.state().replica_index == 0  # the attached tenant's member still answers
    finally:
        first.close()
        made.close()
        process.join(30)
    assert process.exitcode == 0


def test_a_failed_activation_is_reported_and_the_old_version_keeps_serving(link):
    port = free_port()
    store = connect_store("127.0.0.1", port, is_master=True, timeout_seconds=TIMEOUT)
    book = RecordingBook(fail=True)
    member = sync_member_factory(lambda: link, replica_index=0, fingerprint=lambda: "fp")(book, KEY, "a")
    sender = sender_for([LocalMember(0, member)], port, store)
    try:
        sender.form_group(wait_for_all_seconds=TIMEOUT)
        with pytest.raises(SyncError, match="activation failed"):  # its only replica could not load it
            sender.send(adapter(1), {"r": 8})
        state = member.state()
        assert state.live_version == 0 and "the engine refused it" in (state.last_error or "")
        assert not member.ready
    finally:
        sender.close()
        member.close()


FORBIDDEN = ("_lazy_init", "init", "is_available", "device_count", "current_device", "set_device", "Stream")


def test_the_http_process_of_an_nccl_replica_never_initialises_cuda(link, monkeypatch):
    """sync.backend nccl: the HTTP process's member (server.sync_member_factory) forwards the join to the worker,
    which forms the NCCL group there (here it has no GPU, so the formation fails in the worker, and says so); the
    HTTP process calls nothing of torch.cuda and creates no CUDA tensor."""
    calls: list[str] = []

    def forbidden(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"torch.cuda.{name} called in the HTTP process")

        return call

    for name in FORBIDDEN:
        monkeypatch.setattr(torch.cuda, name, forbidden(name))
    made_on: list[str] = []
    empty = torch.empty

    def watched_empty(*args, **kwargs):
        made_on.append(str(kwargs.get("device", "cpu")))
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", watched_empty)
    store = connect_store("127.0.0.1", (port := free_port()), is_master=True, timeout_seconds=TIMEOUT)
    member = sync_member_factory(lambda: link, replica_index=0, fingerprint=lambda: "fp")(RecordingBook(), KEY, "a")
    try:
        member.join(
            JoinRequest(
                epoch=0,
                rank=1,
                world_size=2,
                store_addr="127.0.0.1",
                store_port=port,
                backend="nccl",
                timeout_seconds=2,
                join_timeout_seconds=2,
                trainer_fingerprint="fp",
                current_version=0,
            )
        )
        deadline = time.monotonic() + 30
        while "GPU" not in (member.state().last_error or ""):
            assert time.monotonic() < deadline, member.state()
            time.sleep(0.05)
        # The worker tried NCCL (and has no GPU); the HTTP process never touched CUDA.
        assert calls == [] and not torch.cuda.is_initialized()
        assert not any("cuda" in device for device in made_on)
    finally:
        member.close()
        del store


def test_a_member_host_removes_the_staging_segments_of_members_killed_mid_round(tmp_path):
    """A worker killed inside a round (SIGKILL, OOM) cannot remove its staging segment's name; the next member
    host on the machine does: of a process gone, or of its container's predecessor (a restarted container keeps the
    pod's /dev/shm emptyDir, under a new pid namespace where pids start again, so a pid alone names no process),
    and leaves those of live processes and of other containers alone."""
    dead = mp.get_context("spawn").Process(target=int)
    dead.start()
    dead.join()
    me, start = os.getpid(), process_start(os.getpid())
    pidns, host = stage_owner().pid_namespace, stage_owner().host

    def segment(**owner) -> str:
        fields = {"host": host, "pid_namespace": pidns, "pid": me, "start": start} | owner
        return os.path.join(SHM_DIR, stage_name(StageOwner(**fields)))

    gone = [
        segment(pid=dead.pid),
        segment(start=start + 1),  # this pid, another process: the pid was reused
        segment(pid_namespace=pidns + 1, pid=1),  # the predecessor of this container: same pod, other pid namespace
    ]
    kept = [segment(), segment(host="0" * 8, pid=dead.pid)]  # live; another pod's or container's
    stale, live = gone[0], kept[0]
    for path in gone + kept:
        open(path, "wb").close()
    try:
        made, process = started_link()
        made.close()
        process.join(30)
        assert not os.path.exists(stale) and os.path.exists(live)
        assert [path for path in gone if os.path.exists(path)] == []
        assert [path for path in kept if not os.path.exists(path)] == []
    finally:
        for path in gone + kept:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def test_a_full_dev_shm_between_rounds_costs_nothing_but_the_head_start(monkeypatch):
    """The next round's segment is made after a round has ended, on the receiver thread: where /dev/shm is full
    then, the member says so and goes on (a raise there would end the round as interrupted, and the member would
    leave its group), and the next round makes its own segment, or is refused as full then."""
    from grpolora.workers.inference import member_host

    book, before = RecordingBook(), staged_names()
    sink = StagingSink(book.activate_staged)
    sink.allocate([1000, 24], torch.device("cpu"))
    sink.discard()
    real = member_host.new_segment

    def full(size: int):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(member_host, "new_segment", full)
    sink.stage_ahead()
    assert staged_names() == before
    monkeypatch.setattr(member_host, "new_segment", real)
    (bucket,) = sink.allocate([1024], torch.device("cpu"))
    assert bucket.numel() == 1024 and len(staged_names() - before) == 1
    sink.close()
    assert staged_names() == before


def test_a_corrupted_round_is_refused_in_the_worker_and_leaves_no_staging_segment(link, monkeypatch):
    """The payload MAC is checked where the bytes land, in the worker, before any activation: the book sees
    nothing of a corrupted round, and the segment it landed in is removed at the round's end, not left for the
    next round to find (the next round lands in a new one)."""
    before = staged_names()
    book, member, sender = one_member(link)
    real_pack = wire.pack

    def corrupting_pack(*args, **kwargs):
        header, buckets = real_pack(*args, **kwargs)
        buckets[0][3] ^= 0xFF  # after the MAC was computed
        return header, buckets

    try:
        sender.form_group(wait_for_all_seconds=TIMEOUT)
        monkeypatch.setattr(wire, "pack", corrupting_pack)
        with pytest.raises(SyncError, match="every replica refused version 1"):
            sender.send(adapter(1), {"r": 8})
        assert "payload MAC does not verify" in (member.state().last_error or "")
        assert book.adapters == {} and member.state().live_version == 0
        # The corrupted bytes' segment is gone; the next round's segment is a new one, empty.
        assert all(not any(content) for content in staged_ahead(before).values())
    finally:
        sender.close()
        member.close()
    assert_unstaged_eventually(before)


def test_a_link_whose_worker_never_connects_fails_to_start_and_leaves_no_thread():
    """vLLM's workers answered, but none became the host (or the call failed): start() raises at once, and the
    thread that waited to accept the worker ends."""
    made = MemberLink(timeout_seconds=TIMEOUT)

    async def nobody(address: str, authkey_hex: str) -> list[bool]:
        return [False]

    threads_before = threading.active_count()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="no vLLM worker became the sync member host"):
        asyncio.run(made.start(nobody))
    assert time.monotonic() - started < TIMEOUT
    assert_left_nothing(made, threads_before)


def assert_left_nothing(link: MemberLink, threads_before: int) -> None:
    """A link that failed to start: the thread that waited in accept() ends, and its socket is gone."""
    deadline = time.monotonic() + 5
    while threading.active_count() > threads_before:
        assert time.monotonic() < deadline, "the accepting thread is still blocked"
        time.sleep(0.05)
    assert not os.path.exists(link.address)


@pytest.mark.parametrize("worker", ["call-fails", "never-connects"])
def test_a_link_whose_worker_fails_after_accept_began_raises_and_leaves_no_thread(worker):
    """The link had begun to wait for the worker to connect when the member host's call failed in vLLM's worker
    (seen: a worker of another code version refusing the call's arguments), or the worker said it became the host
    but never connected. start() raises (the worker's error; a timeout) and the thread that waited in accept()
    ends. Before, closing the listener did not wake that thread (Linux does not wake an accept() when another
    thread closes its socket) and start() waited for it: the server hung at start, neither exiting nor logging."""
    made = MemberLink(timeout_seconds=1.0)
    threads_before = threading.active_count()

    async def connect(address: str, authkey_hex: str) -> list[bool]:
        while threading.active_count() == threads_before:  # the accepting thread has started
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # and is blocked in accept()
        if worker == "call-fails":
            raise RuntimeError("Worker failed with error 'grpolora_member_host() takes 3 positional arguments'")
        return [True]

    raised: list[BaseException] = []

    def start() -> None:
        try:
            asyncio.run(made.start(connect))
        except BaseException as exc:
            raised.append(exc)

    starting = threading.Thread(target=start, daemon=True)
    starting.start()
    starting.join(3 * TIMEOUT)
    assert not starting.is_alive(), "start() hung"
    expected = RuntimeError if worker == "call-fails" else TimeoutError
    assert len(raised) == 1 and isinstance(raised[0], expected), raised
    assert_left_nothing(made, threads_before)


class DeviceBufferStaging(StagingSink):
    """A member's staging as on a GPU, run on CPUs (the seam): the round's buckets are buffers of their own, as
    device buffers are, so only `land` brings their bytes into the staging segment."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.segments_made = 0

    def _apart(self, device: torch.device) -> bool:
        return True

    def _stage(self, size: int) -> torch.Tensor:
        self.segments_made += 1
        return super()._stage(size)


def receive_into(
    sink: StagingSink, header: wire.RoundHeader, sent: list[torch.Tensor], *, skip: int | None = None
) -> tuple[list[torch.Tensor], str]:
    """What receive_round does with a round's bytes: each piece lands in the sink's buffers and is MAC'd from what
    `land` gives (piece `skip` arrives but is not landed)."""
    buckets = sink.allocate([b.numel() for b in sent], torch.device("cpu"))
    mac, index = wire.PayloadMac.of(header, KEY), 0
    for bucket, source in zip(buckets, sent, strict=True):
        for piece, arrived in zip(bucket.split(1000), source.split(1000), strict=True):
            piece.copy_(arrived)
            mac.update(piece if index == skip else sink.land(piece))
            index += 1
    return buckets, mac.hexdigest()


@pytest.mark.parametrize("skip", [None, 3], ids=["every-piece-landed", "a-piece-not-landed"])
def test_a_round_in_device_buffers_reaches_the_host_once_into_its_staging_segment(skip):
    """On a GPU the buckets are device buffers and the MAC is host work: each piece is copied once, straight into
    the staging segment, and MAC'd there; activation hands that segment over without a second copy. A round whose
    pieces did not all land that way is copied whole at activation instead (never a segment with holes)."""
    book, before = RecordingBook(), staged_names()
    sink = DeviceBufferStaging(book.activate_staged)
    tensors = adapter(1)
    header, sent = wire.pack(tensors, key=KEY, version=1, epoch=1, bucket_bytes=1 << 12)
    buckets, mac = receive_into(sink, header, sent, skip=skip)
    wire.verify(header, buckets, KEY, computed=mac)
    sink.activate(1, wire.unpack(header, buckets), {})
    assert sink.segments_made == (1 if skip is None else 2)
    assert set(book.adapters[1]) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(book.adapters[1][name], tensor), name
    assert staged_names() == before, "every segment's name is gone once activated"


@LORA_SCALINGS
def test_the_folded_scaling_is_vllms_own_and_leaves_vllm_scaling_by_1(config, scaling):
    """The sender folds the LoRA's scaling into lora_B as it packs (test_sync_protocol.py), so that vLLM, which
    would multiply lora_B in place as it builds the LoRA, in the engine's thread, scales by 1. Both numbers are
    vLLM's own: its PEFTHelper reads the scaling of the config the trainer has, and 1 for the one the round carries.
    Per-module alphas are left to vLLM, which resolves their patterns."""
    from vllm.lora.peft_helper import PEFTHelper

    folded, factor = folded_scaling(config)
    assert lora_scaling(config) == factor
    if scaling is None:
        assert folded == config and factor is None
        return
    assert PEFTHelper.from_dict(config).vllm_lora_scaling_factor == pytest.approx(scaling) == factor
    assert PEFTHelper.from_dict(folded).vllm_lora_scaling_factor == 1.0


def test_folding_the_scaling_imports_nothing_of_vllm():
    """The fold once ran inside a round, in a member whose process had not loaded vLLM, and asking vLLM's
    PEFTHelper there imported it (5.9 s on this machine): on a loaded CI machine the sender's all-reduce timed out
    waiting. The fold is now the sender's, in the trainer, which never loads vLLM; its formula is vLLM's, checked
    against PEFTHelper in the test above."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from grpolora.workers.adapter import folded_scaling\n"
        "from grpolora.workers.sync.sender import AdapterSender\n"
        "config, factor = folded_scaling({'r': 8, 'lora_alpha': 16, 'target_modules': ['m']})\n"
        "assert config['lora_alpha'] == 8 and factor == 2, config\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))\n"
    )
    result = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def test_the_payload_layout_is_the_wire_layout_of_one_bucket_and_packs_every_wire_dtype():
    """One layout and one packer (wire.py): a shared payload is a round's single bucket, as plain types for vLLM's
    RPC. payload.py had its own dtype table (without float64, which the wire carries), alignment and packer, and the
    staging fallback copied by hand: an adapter the wire sent in float64 verified and then could not be staged."""
    from grpolora.workers.inference import payload

    tensors = {
        "b": torch.randn(7).to(torch.bfloat16),
        "a": torch.randn(3, 5, dtype=torch.float64),
        "c": torch.randn(2, 3).to(torch.float16),
    }
    layout, size = payload.payload_layout(tensors)
    entries, sizes = wire.plan_buckets(tensors, bucket_bytes=size)
    assert sizes == [size]
    assert layout == [(e.name, e.dtype, list(e.shape), e.offset, e.nbytes) for e in entries]
    packed, layout = payload.pack_payload(tensors)
    _, buckets = wire.pack(tensors, key=b"k" * 32, version=1, epoch=0, bucket_bytes=size)
    for raw in (bytes(packed), bytes(buckets[0].numpy())):  # packed here, or a round's bucket as it arrived
        unpacked = payload.unpack_payload(raw, layout)
        assert all(torch.equal(unpacked[name], tensor) for name, tensor in tensors.items())
    assert not hasattr(payload, "_DTYPES")


def test_a_version_not_received_into_the_segment_is_staged_by_the_one_packer():
    """StagingSink's fallback (tensors that are not views of a staged segment) packs with wire's packer into a new
    segment, in the payload layout every worker unpacks; float64 included, as the wire carries it."""
    from grpolora.workers.inference.payload import SharedPayload

    seen: list[dict[str, torch.Tensor]] = []

    def activate_remote(version, segment, size, layout, adapter_config, *, incarnation):
        held = SharedPayload(segment, size)  # a worker maps it while the call runs
        seen.append(unpack_payload(held, layout))
        held.close()

    sink = StagingSink(activate_remote)
    tensors = {"z": torch.randn(3, 4, dtype=torch.float64), "a": torch.randn(5).to(torch.bfloat16)}
    sink.activate(1, tensors, {})
    (unpacked,) = seen
    assert sink.live_version == 1 and all(torch.equal(unpacked[k], v) for k, v in tensors.items())
    sink.close()
