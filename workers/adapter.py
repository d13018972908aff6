"""The adapter as it travels and as it is saved: full LoRA tensors under peft's saved names, and its peft config.

Receivers write exactly these as `adapter_model.safetensors` + `adapter_config.json`, the folder layout that peft
and vLLM load, so the synced adapter and a saved checkpoint are the same thing.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


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


def save_adapter(folder: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Write a peft adapter folder atomically (a reader never sees half of one)."""
    from safetensors.torch import save_file

    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(staging / WEIGHTS_FILE))
    (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)


def load_adapter(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file

    return load_file(str(folder / WEIGHTS_FILE)), json.loads((folder / CONFIG_FILE).read_text())


def lora_scaling(adapter_config: Mapping[str, Any]) -> float | None:
    """The factor a LoRA's lora_B output is multiplied by, by vLLM 0.32's formula (`PEFTHelper._scaling`, peft's
    own: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA; tests/workers/test_sync_members.py checks it against
    PEFTHelper), computed here rather than asked of vLLM, which takes seconds to import. None where it is decided
    per module (rank or alpha patterns) or the config is not one vLLM would build (then its build says why)."""
    r, alpha = adapter_config.get("r"), adapter_config.get("lora_alpha")
    if (
        adapter_config.get("rank_pattern")
        or adapter_config.get("alpha_pattern")
        or "target_modules" not in adapter_config
    ):
        return None
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        return None
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        return None
    return alpha / math.sqrt(r) if adapter_config.get("use_rslora") else alpha / r


def folded_scaling(adapter_config: Mapping[str, Any]) -> tuple[dict[str, Any], float | None]:
    """The same adapter with its scaling folded into lora_B: the config whose scaling is 1, and the factor to
    multiply every lora_B by (None, and the config as it is, where the scaling is per module or already 1)."""
    scaling = lora_scaling(adapter_config)
    if scaling is None or scaling == 1:
        return dict(adapter_config), None
    return dict(adapter_config, lora_alpha=adapter_config["r"], use_rslora=False), scaling


def lora_b_scales(names: Iterable[str], adapter_config: Mapping[str, Any]) -> tuple[dict[str, Any], dict | None]:
    """`folded_scaling` for a whole adapter: the config whose scaling is 1, and the factor for each lora_B among the
    tensor `names` (peft's saved names; None where nothing is folded): what a round is packed with (wire.pack's
    `scales`)."""
    config, scaling = folded_scaling(adapter_config)
    if scaling is None:
        return config, None
    return config, {name: scaling for name in names if "lora_B" in name or "lora_embedding_B" in name}
