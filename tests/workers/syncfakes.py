"""In-process stand-ins for the parts around the sync protocol: a sink that records activations, and a member
that calls an AdapterReceiver directly instead of over HTTP. The collectives, the store and the wire format
under test are the real ones."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from grpolora.api.pool import PoolReplicas
from grpolora.testing.servers import free_port  # also the port helper the sync tests import from here
from grpolora.workers.sync.control import JoinRequest, MemberState, MemberUnreachable, PrepareRequest
from grpolora.workers.sync.gloo import GlooTransport
from grpolora.workers.sync.receiver import AdapterReceiver
from grpolora.workers.sync.sender import AdapterSender
from grpolora.workers.sync.transport import Pending, TransportError, connect_store

# LoRA configs and the scaling vLLM gives each (None: per module, left to vLLM), for the tests of the sender's fold
# (test_sync_protocol.py) and of its formula against vLLM's PEFTHelper (test_sync_members.py).
LORA_SCALINGS = pytest.mark.parametrize(
    ("config", "scaling"),
    [
        ({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}, 2.0),
        # alpha / sqrt(r); 6 is no power of two, so the sender's float32 multiply then rounding shows in bf16
        ({"r": 16, "lora_alpha": 24, "use_rslora": True, "target_modules": ["q_proj"]}, 6.0),
        ({"r": 8, "lora_alpha": 16, "alpha_pattern": {"q_proj": 4}, "target_modules": ["q_proj"]}, None),
    ],
    ids=["alpha-over-r", "rslora", "per-module-alpha-left-to-vllm"],
)


def gloo_sender(members, *, token: str, timeout_seconds: float, **options) -> AdapterSender:
    """Trainer rank 0's sender to `members` over gloo (base model fingerprint "fp"), hosting a store of its own on a
    free port, as each trainer (incarnation) does; `options`: more of AdapterSender's keywords."""
    port = free_port()
    return AdapterSender(
        members,
        store=connect_store("127.0.0.1", port, is_master=True, timeout_seconds=timeout_seconds),
        store_addr="127.0.0.1",
        store_port=port,
        timeout_seconds=timeout_seconds,
        join_timeout_seconds=timeout_seconds,
        fingerprint="fp",
        token=token,
        **{"backend": "gloo", "bucket_bytes": 1 << 20} | options,
    )


class RecordingSink:
    def __init__(self) -> None:
        self._version = 0
        self.adapters: dict[int, dict[str, torch.Tensor]] = {}
        self.configs: dict[int, dict] = {}
        self.incarnations: dict[int, int] = {}  # version -> the incarnation of the trainer that published it
        self.activated = threading.Event()

    @property
    def live_version(self) -> int:
        return self._version

    def activate(
        self, version: int, tensors: dict[str, torch.Tensor], adapter_config: dict, *, incarnation: int = 0
    ) -> None:
        self.adapters[version] = {k: v.clone() for k, v in tensors.items()}
        self.configs[version] = dict(adapter_config)
        self.incarnations[version] = incarnation
        self._version = version
        self.activated.set()


class LocalMember:
    def __init__(self, index: int, receiver: AdapterReceiver):
        self.index = index
        self.receiver = receiver
        self.down = False  # simulates a replica that no longer answers its control endpoint

    def _check(self) -> None:
        if self.down:
            raise MemberUnreachable(f"replica {self.index} is down")

    def state(self) -> MemberState:
        self._check()
        return self.receiver.state()

    def join(self, request: JoinRequest) -> None:
        self._check()
        self.receiver.join(request)

    def prepare(self, request: PrepareRequest) -> None:
        self._check()
        self.receiver.prepare(request)

    def pool_replicas(self) -> PoolReplicas | None:
        self._check()
        return None  # a job's own replica


class _ReturnsWhenAborted(Pending):
    """A collective as ProcessGroupNCCL's Work waits for it with TORCH_NCCL_BLOCKING_WAIT=1, read in
    torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp (pytorch/pytorch main at cf1380d, past 2.7.1; the 2.13.0 wheel
    the project installs ships no C++ source), `WorkNCCL::wait` and `WorkNCCL::isCompleted`:
    - it returns once the collective completed on every rank;
    - a peer that died or left is not seen over P2P/NVLink/SHM: the collective just never completes;
    - once this rank's communicator is aborted (`ProcessGroupNCCL::abort`, what the transport's close does),
      `isCompleted()` skips its error check (`if (!ncclComm_->isAborted()) checkAndSetException()`), the aborted
      kernel's end event completes, `exception()` was never set, and `wait()` returns true: the tensor holds
      whatever had arrived, and nothing is raised;
    - past the group's timeout `checkTimeout` sets the exception, and `wait()` aborts and raises DistBackendError.
    """

    def __init__(self, work: dist.Work, transport: NcclAbortSemantics, what: str) -> None:
        self._work, self._transport, self._what = work, transport, what

    def wait(self) -> None:
        deadline = time.monotonic() + self._transport.timeout_seconds
        peer_failed = False
        while True:
            if not peer_failed and self._work.is_completed():
                try:
                    self._work.wait()
                    return  # finished for real, on every rank
                except RuntimeError:  # gloo saw a peer leave; NCCL over P2P/SHM would not: still "in flight"
                    peer_failed = True
            if self._transport.closed:
                return  # aborted: wait() returns normally
            if time.monotonic() >= deadline:
                raise TransportError(f"NCCL {self._what} failed: timed out in blocking wait")
            time.sleep(0.002)


class NcclAbortSemantics(GlooTransport):
    """gloo carries the bytes (on CPU, between threads); each collective is waited for as NCCL's is, above all
    after an abort (_ReturnsWhenAborted), and bounded only by the group's timeout (NCCL has no per-collective progress
    bound: gloo's op_timeout is not passed on). Formation stays gloo's, bounded by the join timeout."""

    def __init__(self, store, *, timeout_seconds: float, op_timeout_seconds: float | None = None, **kwargs) -> None:
        self.timeout_seconds = timeout_seconds
        super().__init__(store, timeout_seconds=timeout_seconds, **kwargs)

    def _start(self, start, what: str) -> Pending:
        group = self._group_or_fail()  # NcclTransport too raises at once on a closed group
        return _ReturnsWhenAborted(start(group), self, what)


@pytest.fixture
def nccl_abort_semantics(monkeypatch):
    """Every sync group of the test formed as gloo, its collectives waited for as NCCL's (NcclAbortSemantics)."""
    from grpolora.workers.sync import groups

    monkeypatch.setattr(groups, "GlooTransport", NcclAbortSemantics)
