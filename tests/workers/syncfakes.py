"""In-process stand-ins for the parts around the sync protocol: a sink that records activations, and a member
that calls an AdapterReceiver directly instead of over HTTP. The collectives, the store and the wire format
under test are the real ones."""

from __future__ import annotations

import threading

import pytest
import torch

from grpolora.api.pool import PoolReplicas
from grpolora.testing.servers import free_port  # also the port helper the sync tests import from here
from grpolora.workers.sync.control import JoinRequest, MemberState, MemberUnreachable, PrepareRequest
from grpolora.workers.sync.receiver import AdapterReceiver
from grpolora.workers.sync.sender import AdapterSender
from grpolora.workers.sync.transport import connect_store

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
        backend="gloo",
        timeout_seconds=timeout_seconds,
        join_timeout_seconds=timeout_seconds,
        fingerprint="fp",
        token=token,
        **{"bucket_bytes": 1 << 20} | options,
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
