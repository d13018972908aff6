"""The NCCL transport's error handling, without a GPU: what the group is built with and how NCCL's failures map to
the transport's error (which makes the sender re-form the group) instead of ending the process.

Running NCCL itself needs GPUs, one per rank; these tests stand a recording class in for ProcessGroupNCCL and
check the contract around it: the environment PyTorch reads when it builds the group, and the exceptions."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from grpolora.workers.sync import nccl
from grpolora.workers.sync.receiver import AdapterReceiver
from grpolora.workers.sync.transport import TransportError


class FakeWork:
    def __init__(self, error: Exception | None):
        self.error = error
        self.waited_with: list[timedelta | None] = []

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waited_with.append(timeout)
        if self.error is not None:
            raise self.error
        return True


class FakeGroup:
    """Records the environment at construction, as ProcessGroupNCCL reads it there."""

    built: list[FakeGroup] = []
    fail_with: Exception | None = None

    class Options:
        _timeout: timedelta | None = None
        is_high_priority_stream = False

    def __init__(self, store, rank, world_size, options):
        self.environment = {name: os.environ.get(name) for name in nccl.ERROR_ENVIRONMENT}
        self.options = options
        self.aborted = False
        self.works: list[FakeWork] = []
        FakeGroup.built.append(self)

    def allreduce(self, tensors, options) -> FakeWork:
        self.works.append(FakeWork(FakeGroup.fail_with))
        return self.works[-1]

    def broadcast(self, tensors, options) -> FakeWork:
        self.works.append(FakeWork(FakeGroup.fail_with))
        return self.works[-1]

    def abort(self) -> None:
        self.aborted = True


class FakeStream:
    def synchronize(self) -> None:
        pass


@pytest.fixture
def fake_nccl(monkeypatch):
    FakeGroup.built, FakeGroup.fail_with = [], None
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeGroup, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)  # the formation's thread takes both
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
    for name in nccl.ERROR_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    return FakeGroup


def make(**overrides) -> nccl.NcclTransport:
    options = {"rank": 0, "world_size": 2, "timeout_seconds": 600, "join_timeout_seconds": 30}
    return nccl.NcclTransport(object(), device=torch.device("cpu"), **(options | overrides))


def test_the_group_is_built_to_raise_not_to_kill_the_process(fake_nccl):
    transport = make()
    (group,) = fake_nccl.built
    # wait() blocks and raises on error or timeout, and with it ProcessGroupNCCL's constructor starts no watchdog
    # thread (nor the heartbeat monitor it feeds), whose default handling ends the process (vLLM's engine, in a
    # member); the other two keep that so should a release start the thread anyway (bench/gpu_probe_epochs.py).
    assert group.environment == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "0",
    }
    assert group.options._timeout == timedelta(seconds=600)  # every collective: sync.timeoutSeconds
    assert group.works[0].waited_with == [timedelta(seconds=30)]  # forming: sync.joinTimeoutSeconds
    # Only while the group is built: the trainer's own FSDP group keeps PyTorch's defaults.
    assert all(name not in os.environ for name in nccl.ERROR_ENVIRONMENT)
    transport.close()
    assert group.aborted


def test_a_peer_lost_mid_collective_is_a_transport_error(fake_nccl):
    transport = make()
    fake_nccl.fail_with = dist.DistBackendError("NCCL communicator was aborted: remote process exited")
    with pytest.raises(TransportError, match=r"NCCL all-reduce failed: .*remote process exited"):
        transport.all_reduce_sum(torch.zeros(2))
    with pytest.raises(TransportError, match="NCCL broadcast failed"):
        transport.broadcast(torch.zeros(2))
    transport.close()
    with pytest.raises(TransportError, match="closed"):
        transport.all_reduce_sum(torch.zeros(2))


def test_a_group_that_does_not_form_is_a_transport_error_and_is_torn_down(fake_nccl):
    fake_nccl.fail_with = dist.DistBackendError("Watchdog caught collective operation timeout")
    with pytest.raises(TransportError, match=r"NCCL group of 2 did not form: .*timeout"):
        make()
    assert fake_nccl.built[0].aborted


def test_the_environment_is_put_back_as_it_was(fake_nccl, monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "0")
    make().close()
    assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "0" and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ


def test_groups_formed_at_once_on_two_threads_each_get_the_settings_and_leave_none_behind(fake_nccl, monkeypatch):
    """A pool server's receivers form their jobs' groups each on its own thread, and ProcessGroupNCCL reads the
    error settings from the process environment in its constructor (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:
    `blockingWait_ = getCvarBool(TORCH_NCCL_BLOCKING_WAIT, false)`, `asyncErrorHandling_ = ...`). Two formations
    overlapping there must not undo each other: the second built with PyTorch's defaults would end the server on
    its first failed collective, and values restored out of order would stay set for every later group."""
    first_inside, second_trying, first_done = threading.Event(), threading.Event(), threading.Event()

    class ObservedLock:
        """A lock that tells when a thread has to wait for it (how the second formation shows it is held back)."""

        def __init__(self) -> None:
            self._lock = threading.Lock()

        def __enter__(self) -> None:
            if not self._lock.acquire(blocking=False):
                second_trying.set()
                self._lock.acquire()

        def __exit__(self, *_) -> None:
            self._lock.release()

    class OverlappingGroup(FakeGroup):
        """The first group stays in its constructor until the second formation has begun; the second reads the
        environment only once the first formation is over."""

        def __init__(self, *args) -> None:
            if not first_inside.is_set():
                first_inside.set()
                assert second_trying.wait(20), "the second formation never began"
            else:
                second_trying.set()
                assert first_done.wait(20), "the first formation never ended"
            super().__init__(*args)  # records the environment as the real constructor reads it

    monkeypatch.setattr(dist, "ProcessGroupNCCL", OverlappingGroup, raising=False)
    monkeypatch.setattr(nccl, "_ENVIRONMENT_LOCK", ObservedLock(), raising=False)

    def first() -> nccl.NcclTransport:
        transport = make()
        first_done.set()
        return transport

    with ThreadPoolExecutor(max_workers=2) as pool:
        formed = [pool.submit(first)]
        assert first_inside.wait(20)
        formed.append(pool.submit(make))
        transports = [future.result(timeout=60) for future in formed]
    assert [group.environment for group in fake_nccl.built] == [dict(nccl.ERROR_ENVIRONMENT)] * 2
    assert all(name not in os.environ for name in nccl.ERROR_ENVIRONMENT)
    for transport in transports:
        transport.close()


def test_an_adapter_travels_over_nccl_in_pieces_of_a_few_mib(fake_nccl):
    """One piece for a whole 87 MB adapter made receive, copy to the host and MAC run one after another on a
    receiver; in pieces of a few MiB each is checked while the next arrives, as over gloo."""
    transport = make()
    adapter = torch.empty(87 << 20, dtype=torch.uint8)
    pieces = transport.pieces(adapter)
    assert len(pieces) > 10 and max(p.numel() for p in pieces) <= 8 << 20
    assert sum(p.numel() for p in pieces) == adapter.numel()
    transport.close()


def test_only_the_trainer_frees_its_allocators_cache_before_the_communicator_is_made(fake_nccl, monkeypatch):
    """NCCL's communicator takes its buffers with cudaMalloc, outside PyTorch's caching allocator. On trainer rank 0,
    blocks its allocator caches unused are handed back first, so that they do not make that allocation fail (as
    NeMo-RL does before it builds its refit communicator). Never in a member: there the process is vLLM's, and
    empty_cache() is a device-wide synchronisation under the allocator's lock (every allocation of the engine waits,
    as long as the slowest kernel in flight: another tenant's receive stuck on a dead sender) that hands vLLM's
    profiled activation blocks to NCCL, so that vLLM's next large prefill runs out of memory. A member's fit is the
    member host's budget (gpu_headroom.py), against the memory free as measured."""
    from grpolora.workers.sync import groups

    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    real_init = FakeGroup.__init__

    def recorded(self, *args) -> None:
        events.append("communicator")
        real_init(self, *args)

    monkeypatch.setattr(FakeGroup, "__init__", recorded)
    store = dist.HashStore()
    for rank, trainer in ((1, False), (0, True)):
        options = {"epoch": 0, "rank": rank, "world_size": 2, "timeout_seconds": 600, "device": torch.device("cpu")}
        if trainer:  # as the sender builds its side of each epoch (sender.AdapterSender._form)
            options["free_cached_memory"] = True
        groups.create_transport("nccl", store, **options).close()
    assert events == ["communicator", "empty_cache", "communicator"]


def test_a_sender_and_its_member_over_nccl_free_the_cache_on_the_trainer_only(fake_nccl, monkeypatch):
    """Who asks for it, walked through the real sender and receiver forming two epochs over the fake NCCL group:
    each formation frees the cache once, on trainer rank 0's side, never in the member's (vLLM's) thread."""
    from tests.workers.syncfakes import LocalMember, RecordingSink, gloo_sender

    freed_on: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: freed_on.append(threading.current_thread().name))
    cpu = torch.device("cpu")
    receiver = AdapterReceiver(RecordingSink(), replica_index=0, fingerprint="fp", key=b"k" * 32, device=cpu)
    member = LocalMember(0, receiver)
    sender = gloo_sender([member], token="t", timeout_seconds=10, backend="nccl")
    try:
        for epoch in (0, 1):
            sender.form_group()
            for _ in range(1000):  # the member records its epoch once its side of the formation has returned
                if member.receiver.state().epoch == epoch:
                    break
                threading.Event().wait(0.01)
            assert sender.epoch == epoch and member.receiver.state().epoch == epoch
        assert freed_on == [threading.current_thread().name] * 2
    finally:
        sender.close()
        member.receiver.close()


class AbortedWork(FakeWork):
    """A collective whose peer never comes, waited for as WorkNCCL::wait does with TORCH_NCCL_BLOCKING_WAIT=1
    (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, pytorch/pytorch main at cf1380d, past 2.7.1): it loops on
    isCompleted(), which skips checkAndSetException() once the communicator is aborted; the aborted kernel's end
    event completes, exception() was never set, and wait() returns true. Nothing is raised."""

    def __init__(self, group: FakeGroup) -> None:
        super().__init__(None)
        self.group = group
        self.waiting = threading.Event()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waiting.set()
        while not self.group.aborted:
            threading.Event().wait(0.005)
        return True


@pytest.mark.parametrize("collective", ["all-reduce", "broadcast"])
def test_a_collective_cut_by_an_abort_raises_though_nccls_wait_returns(fake_nccl, collective):
    """The round's watchdog closes (aborts) the transport from its own thread; the thread waiting on the collective
    must get a TransportError, or the sender reads the closing status as all zeros ("every replica refused", the
    trainer exits 1) where a replica was lost."""
    transport = make()
    (group,) = fake_nccl.built
    blocked = AbortedWork(group)
    group.allreduce = group.broadcast = lambda tensors, options: blocked
    raised: list[BaseException] = []

    def run() -> None:
        try:
            if collective == "all-reduce":
                transport.all_reduce_sum(torch.zeros(2))
            else:
                transport.start_broadcast(torch.zeros(2)).wait()
        except BaseException as exc:
            raised.append(exc)

    waiter = threading.Thread(target=run, daemon=True)
    waiter.start()
    assert blocked.waiting.wait(10)
    transport.close()  # what the watchdog does
    waiter.join(10)
    assert not waiter.is_alive()
    assert raised and isinstance(raised[0], TransportError), raised
    assert "closed while" in str(raised[0])


class NeverFormingGroup(FakeGroup):
    """A group whose peer accepted the join and then died before reaching NCCL (its store connection refused, its
    worker gone, out of memory). ProcessGroupNCCL creates the communicator lazily, inside the first collective
    (`collective()` -> `initNCCLComm` -> `NCCLComm::create` -> `ncclCommInitRankConfig`), which in blocking mode
    (PyTorch's default since 2.7.1, `useNonblocking()`) waits until every rank reaches NCCL's bootstrap; the
    communicator enters `inInitializationCommMap_` only after `create` returns, so `abort()` (`abortComms`, over
    that map and `devNCCLCommMap_`) cannot free it (ProcessGroupNCCL.cpp, pytorch/pytorch main at cf1380d). The
    Work's timeout starts once the communicator exists: it bounds nothing here."""

    release = threading.Event()  # the end of the test: lets the abandoned thread go

    def allreduce(self, tensors, options) -> FakeWork:
        NeverFormingGroup.release.wait()
        raise dist.DistBackendError("NCCL error: remote process exited or there was a network error")


@pytest.mark.parametrize("rank", [0, 1], ids=["trainer-rank-0", "member"])
def test_a_group_whose_peer_never_reaches_nccl_fails_within_the_join_timeout(fake_nccl, monkeypatch, rank):
    """A replica that acknowledged the join and then died must cost trainer rank 0 one join timeout, as on gloo, not
    hang it for ever inside the sender's lock (and a member whose trainer died mid-formation must take its next
    join). The same bound, three formations in a row: each one gives up, each aborts its group."""
    monkeypatch.setattr(dist, "ProcessGroupNCCL", NeverFormingGroup, raising=False)
    NeverFormingGroup.release = threading.Event()
    outcomes: list[BaseException | None] = []

    def form_three() -> None:
        for _ in range(3):
            try:
                make(rank=rank, join_timeout_seconds=0.3)
                outcomes.append(None)
            except BaseException as exc:
                outcomes.append(exc)

    try:
        forming = threading.Thread(target=form_three, daemon=True)
        forming.start()
        forming.join(10)  # 3 x 0.3 s
        assert not forming.is_alive(), "formation hung past its join timeout"
    finally:
        NeverFormingGroup.release.set()
    assert len(outcomes) == 3 and all(isinstance(o, TransportError) for o in outcomes), outcomes
    assert "NCCL group of 2 did not form: not every rank reached it within 0.3s" in str(outcomes[0])
    assert [group.aborted for group in fake_nccl.built] == [True] * 3
