"""Trainer checkpoints: the adapter (standard peft folder, loadable anywhere), the optimizer, step, sync round,
epoch, RNG state (CPU, Python, and CUDA where present) and the prompt stream's position, every
`checkpoint.everySteps` and at the end.

A checkpoint is a folder `step-<N>` written under a temporary name and renamed when complete, so a trainer killed
mid-write resumes from the previous one. Only trainer rank 0 writes; with several ranks the full optimizer state
is gathered first (a collective all ranks join) and scattered back on resume. The state file is read with
`torch.load(weights_only=True)` (tensors and plain data only, no arbitrary pickled code), and a restore is strict:
the checkpoint's adapter tensors must be exactly the model's, by name, or it fails naming the difference.
"""

from __future__ import annotations

import logging
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from grpolora.workers.adapter import load_adapter, lora_config, lora_tensors, save_adapter

log = logging.getLogger(__name__)

PREFIX = "step-"
STATE_FILE = "trainer_state.pt"
ADAPTER_DIR = "adapter"


@dataclass
class Progress:
    """What must survive a restart besides the weights. step and version never go backwards."""

    step: int = 0
    version: int = 0
    """The adapter version last sent to the inference replicas (what the API calls the sync round)."""
    epoch: int = 0
    prompts_consumed: int = 0
    """Prompts of the stream trained on (not merely drawn: a pipelined step draws the next step's early)."""

    @classmethod
    def from_saved(cls, saved: dict[str, int]) -> Progress:
        """Also reads checkpoints written before the field was renamed from `sync_round` to `version`."""
        saved = dict(saved)
        if "sync_round" in saved:
            saved["version"] = saved.pop("sync_round")
        return cls(**saved)


def latest(root: Path) -> Path | None:
    steps = sorted(
        (p for p in root.glob(f"{PREFIX}*") if p.is_dir() and (p / STATE_FILE).exists()),
        key=lambda p: int(p.name.removeprefix(PREFIX)),
    )
    return steps[-1] if steps else None


def _sharded(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def save(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: Progress, keep: int) -> Path:
    """Called on every rank (gathering is collective); rank 0 writes. Returns the checkpoint folder."""
    tensors = lora_tensors(model)
    optim_state = _full_optimizer_state(model, optimizer)
    target = root / f"{PREFIX}{progress.step:08d}"
    if dist.is_initialized() and dist.get_rank() != 0:
        return target
    staging = root / f".tmp-{target.name}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_adapter(staging / ADAPTER_DIR, tensors, lora_config(model))
    torch.save(
        {
            "progress": asdict(progress),
            "optimizer": optim_state,
            "rng": _rng_state(),
        },
        staging / STATE_FILE,
    )
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    for old in sorted(root.glob(f"{PREFIX}*"), key=lambda p: p.name)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint %s written", target)
    return target


def restore(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Progress:
    """Load a checkpoint into an already built policy and optimizer (every rank calls this)."""
    tensors, _ = load_adapter(folder / ADAPTER_DIR)
    state = torch.load(folder / STATE_FILE, weights_only=True)
    tensors = _with_adapter_names(tensors)
    _check_names(folder, model, tensors)
    if _sharded(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        # strict=False only because the base weights are (rightly) not in the checkpoint; _check_names has made
        # sure that every adapter tensor is there and lands on a parameter.
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, tensors, options=options)
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    else:
        with torch.no_grad():
            parameters = dict(model.named_parameters())
            for name, tensor in tensors.items():
                parameters[name].copy_(tensor)
        optimizer.load_state_dict(state["optimizer"])
    _set_rng_state(state["rng"])
    progress = Progress.from_saved(state["progress"])
    log.info("resumed from %s at step %d (adapter version %d)", folder, progress.step, progress.version)
    return progress


def _full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    if not _sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _with_adapter_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft saves `...lora_A.weight`; the live module names them `...lora_A.default.weight`."""
    return {
        name.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"): t
        for name, t in tensors.items()
    }


def _check_names(folder: Path, model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """The checkpoint's adapter tensors are exactly the model's trainable LoRA parameters, with their shapes: a
    checkpoint of another model or LoRA config must fail here, not load partly or not at all."""
    live = {name: p.shape for name, p in model.named_parameters() if p.requires_grad}
    missing = sorted(live.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - live.keys())
    reshaped = sorted(n for n in live.keys() & tensors.keys() if tuple(tensors[n].shape) != tuple(live[n]))
    if missing or unexpected or reshaped:
        raise ValueError(
            f"checkpoint {folder} does not fit this model's LoRA adapter (spec.model, spec.lora): "
            f"{len(missing)} tensors missing {missing[:2]}, {len(unexpected)} unexpected {unexpected[:2]}, "
            f"{len(reshaped)} of another shape {reshaped[:2]}"
        )


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(state["cuda"]):
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            log.warning("checkpoint: CUDA RNG state of %d devices not restored on this machine", len(state["cuda"]))
