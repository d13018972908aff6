"""The headroom a GPU replica's sync members need outside gpuMemoryUtilization (issue 36), hand-computed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from grpolora.workers.inference.gpu_headroom import (
    COMMUNICATOR_BYTES,
    MIB,
    TenantBudget,
    adapter_bytes_bound,
    headroom,
)

GIB = 1 << 30

# Qwen3-8B's config.json sizes (bench/gpu_scale.py's QWEN3_8B), written out: the numbers below are computed by hand.
EIGHT_B = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


def test_the_communicator_allowance_is_ncclS_default_buffers_over_sixteen_channels():
    # 16 channels x 2 ring peers x (Simple's 4 MiB + as much for LL/LL128 and state)
    assert COMMUNICATOR_BYTES == 256 * MIB


def test_an_adapter_bound_of_the_8b_configuration_is_the_87_mb_a_round():
    # per layer and rank: q, o (4096 + 4096) x 2 = 16384; k, v (4096 + 1024) x 2 = 10240;
    # gate, up, down (4096 + 12288) x 3 = 49152; 75776 x 16 x 36 layers x 2 bytes (bf16)
    assert adapter_bytes_bound(EIGHT_B, rank=16, dtype_bytes=2) == 87_293_952


def test_an_adapter_bound_reads_a_multimodal_configs_language_model_and_derives_head_dim():
    text = {k: v for k, v in EIGHT_B.items() if k not in ("head_dim", "num_key_value_heads")}
    # no KV heads: as many as heads (4096 + 4096) x 4 = 32768, + 49152 = 81920 per layer and rank
    assert adapter_bytes_bound({"text_config": text}, rank=1, dtype_bytes=4) == 81920 * 36 * 4


def test_a_config_without_its_sizes_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="no intermediate_size"):
        adapter_bytes_bound({"hidden_size": 8}, rank=1, dtype_bytes=2)


def test_an_80_gib_gpu_at_0_85_leaves_room_for_how_many_8b_tenants():
    # outside: 80 GiB - ceil(80 GiB x 0.85) = 12 GiB = 12288 MiB; per tenant 87,293,952 + 268,435,456 bytes
    one = headroom(total_bytes=80 * GIB, gpu_memory_utilization=0.85, adapter_bytes=87_293_952, tenants=1)
    assert one.outside_bytes == 12 * GIB
    assert one.per_tenant_bytes == 355_729_408
    # 12 GiB / 355,729,408 = 36.2: 36 fit, 37 do not
    assert headroom(total_bytes=80 * GIB, gpu_memory_utilization=0.85, adapter_bytes=87_293_952, tenants=36).fits
    assert not headroom(total_bytes=80 * GIB, gpu_memory_utilization=0.85, adapter_bytes=87_293_952, tenants=37).fits


def test_a_refusal_names_the_numbers_and_the_utilization_that_would_fit():
    room = headroom(total_bytes=4 * GIB, gpu_memory_utilization=0.75, adapter_bytes=300 * MIB, tenants=2)
    # outside 1024 MiB; need 2 x (300 + 256) = 1112 MiB; 1 - 1112/4096 = 0.7285 -> 0.72
    assert room.outside_bytes == 1024 * MIB and room.needed_bytes == 1112 * MIB and not room.fits
    assert room.utilization_that_fits == 0.72
    assert room.refusal("ns/b") == (
        "job ns/b not attached: 2 tenants' sync members need 2 x (300 MiB adapter receive buffer + 256 MiB NCCL "
        "communicator) = 1112 MiB outside gpuMemoryUtilization 0.75, which leaves 1024 MiB of the GPU's 4096 MiB; "
        "set gpuMemoryUtilization (a RolloutPool's spec, a job's inference) to at most 0.72, or lower maxJobs"
    )
    assert headroom(total_bytes=4 * GIB, gpu_memory_utilization=0.72, adapter_bytes=300 * MIB, tenants=2).fits


def test_a_budget_reads_the_memory_at_each_check():
    readings = iter([4 * GIB, 8 * GIB])
    budget = TenantBudget(total_bytes=lambda: next(readings), gpu_memory_utilization=0.75, adapter_bytes=300 * MIB)
    assert not budget.with_tenants(2).fits
    assert budget.with_tenants(2).outside_bytes == 2048 * MIB


@pytest.mark.parametrize(
    ("field", "value"), [("total_bytes", 0), ("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.5)]
)
def test_bad_numbers_are_errors_naming_the_field(field, value):
    numbers = {"total_bytes": GIB, "gpu_memory_utilization": 0.9, "adapter_bytes": 1, "tenants": 1} | {field: value}
    with pytest.raises(ValueError, match=field):
        headroom(**numbers)


def test_a_gpu_workers_budget_is_its_engines_utilization_and_adapter_bound():
    """vllm_worker.gpu_budget reads vLLM's config as its Worker holds it (vllm_config.cache_config
    .gpu_memory_utilization, .lora_config.max_lora_rank, .model_config.hf_config and .dtype); the memory is read
    only when an attachment is checked (no CUDA here)."""
    import torch

    from grpolora.workers.inference.vllm_worker import gpu_budget

    hf_config = SimpleNamespace(to_dict=lambda: dict(EIGHT_B))
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(gpu_memory_utilization=0.9),
        lora_config=SimpleNamespace(max_lora_rank=16),
        model_config=SimpleNamespace(hf_config=hf_config, dtype=torch.bfloat16),
    )
    budget = gpu_budget(vllm_config, torch.device("cuda", 0))
    assert (budget.gpu_memory_utilization, budget.adapter_bytes) == (0.9, 87_293_952)
    assert budget.communicator_bytes == COMMUNICATOR_BYTES


def test_a_tenant_must_also_fit_in_the_memory_free_now_not_only_in_the_nominal_headroom():
    """(1 - util) x total is what vLLM leaves by its own count, but its CUDA graphs, the other tenants' communicators
    and anything else outside that count already live there, and the member no longer empties the allocator's cache
    into it (nccl.py): the new tenant's receive buffer and communicator must fit in the memory free as measured
    (torch.cuda.mem_get_info's free), with the numbers in the refusal."""
    budget = TenantBudget(
        total_bytes=lambda: 4 * GIB, gpu_memory_utilization=0.75, adapter_bytes=300 * MIB, free_bytes=lambda: 500 * MIB
    )
    room = budget.with_tenants(1)  # nominally 556 MiB of 1024 MiB: fits; measured: 556 MiB of 500 MiB free
    assert room.needed_bytes <= room.outside_bytes and not room.fits
    assert "556 MiB" in room.refusal("ns/a") and "500 MiB free on the GPU now" in room.refusal("ns/a")
    roomy = TenantBudget(
        total_bytes=lambda: 4 * GIB, gpu_memory_utilization=0.75, adapter_bytes=300 * MIB, free_bytes=lambda: GIB
    )
    assert roomy.with_tenants(1).fits
