"""The grouped CPU LoRA ops compute what vLLM's own CPU ops compute, for the vLLM version they patch."""

from __future__ import annotations

import importlib

import pytest
import torch

from grpolora.workers.inference import vllm_plugin

lora_ops = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")


@pytest.fixture
def original():
    """vLLM's functions as shipped (a fresh import: register() may have replaced them in this process)."""
    return importlib.reload(lora_ops)


def cases():
    g = torch.Generator().manual_seed(0)
    slots, rank, width, out = 3, 8, 32, 48
    for indices in ([0] * 5, [1, 0, 1, 2, 2, 0], [-1, 0, -1, 1], [2]):
        tokens = len(indices)
        yield {
            "x_in": torch.randn(tokens, width, generator=g),
            "x_rank": torch.randn(tokens, rank, generator=g),
            "a": torch.randn(slots, 1, rank, width, generator=g),
            "b": torch.randn(slots, 1, out, rank, generator=g),
            "indices": torch.tensor(indices),
            "out_dim": out,
        }


@pytest.mark.parametrize("case", list(cases()), ids=lambda c: str(c["indices"].tolist()))
def test_grouped_ops_match_vllms(original, case):
    tokens = case["indices"].numel()
    rank = case["a"].shape[2]
    for dtype in (torch.float32, torch.bfloat16):
        ours, theirs = torch.zeros(tokens, rank, dtype=dtype), torch.zeros(tokens, rank, dtype=dtype)
        vllm_plugin.bgmv_shrink(case["x_in"], case["a"], ours, case["indices"], 0.5)
        original.bgmv_shrink(case["x_in"], case["a"], theirs, case["indices"], 0.5)
        torch.testing.assert_close(ours, theirs)
        for add in (False, True):
            base = torch.randn(tokens, case["out_dim"] + 4).to(dtype)
            ours, theirs = base.clone(), base.clone()
            vllm_plugin.bgmv_expand(case["x_rank"], case["b"], ours, case["indices"], add)
            original.bgmv_expand(case["x_rank"], case["b"], theirs, case["indices"], add)
            torch.testing.assert_close(ours, theirs)
            ours, theirs = base.clone(), base.clone()
            vllm_plugin.bgmv_expand_slice(case["x_rank"], case["b"], ours, case["indices"], 2, case["out_dim"], add)
            original.bgmv_expand_slice(case["x_rank"], case["b"], theirs, case["indices"], 2, case["out_dim"], add)
            torch.testing.assert_close(ours, theirs)


def test_register_patches_only_the_tested_vllm_on_cpu(monkeypatch, original):
    import vllm
    from vllm.lora.punica_wrapper import punica_cpu

    punica_cpu = importlib.reload(punica_cpu)  # vLLM's own functions again
    monkeypatch.setattr(vllm, "__version__", "9.9.9")
    vllm_plugin.register()
    assert punica_cpu.bgmv_shrink is not vllm_plugin.bgmv_shrink
    assert punica_cpu.bgmv_shrink.__module__ == "vllm.lora.ops.torch_ops.lora_ops"
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    vllm_plugin.register()
    assert punica_cpu.bgmv_shrink is vllm_plugin.bgmv_shrink
    assert lora_ops.bgmv_expand is vllm_plugin.bgmv_expand
