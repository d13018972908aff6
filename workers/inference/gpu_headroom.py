"""Whether one more tenant's sync member fits in a GPU replica's memory outside vLLM's `gpuMemoryUtilization`.

vLLM sizes its KV cache so that everything it allocates (weights, activations, the preallocated LoRA slots, its own
CUDA context) stays within `gpuMemoryUtilization x` the GPU's memory. A tenant's sync member lives in vLLM's worker
process but outside that budget, and keeps what it takes for the tenant's life:
- its NCCL communicator (workers/sync/nccl.py), whose buffers NCCL cudaMallocs itself, outside PyTorch's allocator;
- one adapter-sized receive buffer (the round's device buckets, StagingSink.allocate): PyTorch's caching allocator
  keeps the blocks for the next round, which has the same size.
So a replica with N tenants needs N x (adapter + communicator) of the `(1 - gpuMemoryUtilization) x total` that vLLM
leaves, and the tenant being attached needs its share free as measured then (vLLM's CUDA graphs and other memory it
does not count live in that headroom too; the member never empties vLLM's allocator cache to make room); a member
that does not fit would make the next allocation of vLLM's engine, or of the member, fail with a
CUDA out-of-memory error in the engine's process. The member host refuses such an attachment instead, naming the
numbers (member_host.MemberHost). On CPU replicas nothing of this applies (gloo, buffers in /dev/shm): no budget.

Torch-free, pure: the reading of the GPU's memory is given (member_host takes a callable)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20

NCCL_BUFFSIZE = 4 * MIB
"""NCCL's default NCCL_BUFFSIZE: the buffer of the Simple protocol per channel and peer connection ("NCCL_BUFFSIZE:
the size of the buffer used by NCCL when communicating data between pairs of GPUs ... default 4194304", NCCL's
environment-variable documentation, docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html)."""

NCCL_CHANNELS = 16
"""Channels a communicator may open (NCCL picks them from the topology, bounded by NCCL_MAX_NCHANNELS; 16 is what it
opens on an NVLink node for a ring, fewer across nodes): the allowance is sized for the many-channel case."""

COMMUNICATOR_BYTES = NCCL_CHANNELS * 2 * 2 * NCCL_BUFFSIZE
"""The allowance for one member's communicator: per channel, a ring's two peer connections (the rank before and
after: a broadcast receives from one and forwards to the other), each with Simple's NCCL_BUFFSIZE and, about as much
again, the LL and LL128 protocols' buffers and NCCL's own per-connection state: 16 x 2 x 2 x 4 MiB = 256 MiB. An
allowance, not a measurement: docs/design.md's GPU risks table says how the first GPU run checks it."""


@dataclass(frozen=True)
class Headroom:
    """The memory a replica's sync members need outside `gpuMemoryUtilization`, against what vLLM leaves there."""

    total_bytes: int  # the GPU's memory
    gpu_memory_utilization: float
    adapter_bytes: int  # one tenant's receive buffer: its adapter's size (an upper bound)
    communicator_bytes: int
    tenants: int  # counting the one being attached
    free_bytes: int | None = None  # the GPU's memory free as measured now (None: not measured)

    @property
    def outside_bytes(self) -> int:
        """What vLLM leaves outside its budget."""
        return self.total_bytes - math.ceil(self.total_bytes * self.gpu_memory_utilization)

    @property
    def per_tenant_bytes(self) -> int:
        return self.adapter_bytes + self.communicator_bytes

    @property
    def needed_bytes(self) -> int:
        return self.tenants * self.per_tenant_bytes

    @property
    def fits_free(self) -> bool:
        """The new tenant's buffer and communicator fit in the memory free now: the nominal headroom already holds
        what vLLM does not count (its CUDA graphs, the other tenants' communicators)."""
        return self.free_bytes is None or self.per_tenant_bytes <= self.free_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.outside_bytes and self.fits_free

    @property
    def utilization_that_fits(self) -> float:
        """The highest gpuMemoryUtilization (in hundredths, as the spec is written) that leaves room for all."""
        return math.floor((1 - self.needed_bytes / self.total_bytes) * 100) / 100

    def refusal(self, job: str) -> str:
        """Why `job` is not attached, with the numbers and what would make it fit."""
        if self.needed_bytes <= self.outside_bytes and not self.fits_free:
            return (
                f"job {job} not attached: its sync member needs {_mib(self.adapter_bytes)} adapter receive buffer + "
                f"{_mib(self.communicator_bytes)} NCCL communicator = {_mib(self.per_tenant_bytes)}, but only "
                f"{_mib(self.free_bytes or 0)} free on the GPU now (of the {_mib(self.outside_bytes)} "
                f"gpuMemoryUtilization {self.gpu_memory_utilization} leaves); lower gpuMemoryUtilization or maxJobs"
            )
        return (
            f"job {job} not attached: {self.tenants} tenants' sync members need {self.tenants} x "
            f"({_mib(self.adapter_bytes)} adapter receive buffer + {_mib(self.communicator_bytes)} NCCL communicator)"
            f" = {_mib(self.needed_bytes)} outside gpuMemoryUtilization {self.gpu_memory_utilization}, which leaves "
            f"{_mib(self.outside_bytes)} of the GPU's {_mib(self.total_bytes)}; set gpuMemoryUtilization (a "
            f"RolloutPool's spec, a job's inference) to at most {self.utilization_that_fits}, or lower maxJobs"
        )


def _mib(count: int) -> str:
    return f"{count / MIB:.0f} MiB"


def headroom(
    *,
    total_bytes: int,
    gpu_memory_utilization: float,
    adapter_bytes: int,
    tenants: int,
    communicator_bytes: int = COMMUNICATOR_BYTES,
    free_bytes: int | None = None,
) -> Headroom:
    """The headroom of a replica with `tenants` sync members (see the module docstring)."""
    if total_bytes <= 0:
        raise ValueError(f"total_bytes: the GPU's memory must be positive, got {total_bytes}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if adapter_bytes < 0 or communicator_bytes < 0 or tenants < 0:
        raise ValueError("adapter_bytes, communicator_bytes and tenants must not be negative")
    return Headroom(total_bytes, gpu_memory_utilization, adapter_bytes, communicator_bytes, tenants, free_bytes)


def adapter_bytes_bound(hf_config: Mapping[str, Any], rank: int, dtype_bytes: int) -> int:
    """An upper bound on one adapter's size for a decoder of `hf_config` (a Hugging Face config.json) at LoRA
    `rank`: every projection of every layer (q, k, v, o, gate, up, down) adapted, each adding rank x (in + out)
    parameters. A multimodal config's language model is its `text_config`. The 8B configuration (hidden 4096,
    intermediate 12288, 36 layers, 32 heads, 8 KV heads) at rank 16 in bf16: 87,293,952 bytes, the 87 MB a round."""
    config = hf_config.get("text_config") or hf_config
    try:
        hidden = int(config["hidden_size"])
        intermediate = int(config["intermediate_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
    except KeyError as exc:
        raise ValueError(f"the model's config.json has no {exc.args[0]}: cannot bound its adapters' size") from None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    per_rank = (hidden + q) * 2 + (hidden + kv) * 2 + (hidden + intermediate) * 3  # q, o; k, v; gate, up, down
    return per_rank * rank * layers * dtype_bytes


@dataclass(frozen=True)
class TenantBudget:
    """What a GPU replica's member host checks each attachment against: the GPU's memory as read when it attaches
    (`total_bytes`, e.g. torch.cuda.mem_get_info's total), vLLM's utilization and the bound on one adapter."""

    total_bytes: Callable[[], int]
    gpu_memory_utilization: float
    adapter_bytes: int
    communicator_bytes: int = COMMUNICATOR_BYTES
    free_bytes: Callable[[], int] | None = None  # the memory free now (torch.cuda.mem_get_info's free)

    def with_tenants(self, tenants: int) -> Headroom:
        return headroom(
            total_bytes=self.total_bytes(),
            gpu_memory_utilization=self.gpu_memory_utilization,
            adapter_bytes=self.adapter_bytes,
            tenants=tenants,
            communicator_bytes=self.communicator_bytes,
            free_bytes=self.free_bytes() if self.free_bytes is not None else None,
        )
