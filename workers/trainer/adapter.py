"""The adapter as it travels: full LoRA tensors in peft's saved-key format, and its peft config as JSON.

Receivers write exactly these as `adapter_model.safetensors` + `adapter_config.json`, the folder layout that peft
and vLLM load, so the synced adapter and a saved checkpoint are the same thing.
"""

from __future__ import annotations

from typing import Any

import torch


def lora_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every LoRA A/B tensor of a peft model, full (gathered if sharded), detached, under peft's saved names."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    result = {}
    for name, tensor in state.items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # FSDP2 shards are DTensors
        result[name] = full.detach()
    return result


def lora_config(model: torch.nn.Module, adapter_name: str = "default") -> dict[str, Any]:
    """The peft LoraConfig as JSON-safe data (sets become sorted lists)."""
    config = model.peft_config[adapter_name].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
