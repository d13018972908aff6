"""Adapters built from memory inside vLLM's own worker processes: no folder between a sync round and vLLM.

Runs in two processes. `AdapterExtension`, `gpu_budget`, `build_lora_model` and `hook_loader` run in every vLLM
worker process (each TP rank; at TP=1 the EngineCore), which imports this module as vLLM's `worker_extension_cls`.
`lora_request` and `memory_path` are also imported by the replica's HTTP process (adapter_book.py): they name an
adapter from memory as vLLM's requests carry it there. Nothing of the member host (member_host.py, worker only) is
imported at module level.

vLLM's public `add_lora` loads an adapter from a folder. A synced adapter reaches the workers instead as one
contiguous payload in a shared-memory segment, named with its layout in a `collective_rpc` (vLLM's call into its
workers between engine steps), and becomes a LoRA model there with vLLM's `LoRAModel.from_lora_tensors`.
`AdapterExtension` is the worker extension class (`worker_extension_cls`) that vLLM mixes into its worker class: it
keeps each adapter's payload for as long as the LoRA id is in use and answers vLLM's own (re)loads of that id from
it. Its first worker (TP rank 0) is also the sync-group member of the replica (`grpolora_member_host`,
workers/inference/member_host.py): the segment a synced adapter arrives in is the one that member received and
verified it into.

vLLM 0.32 folds a LoRA's scaling into lora_B in place when it adds a model (`LoRALayerWeights.optimize`; a synced
adapter arrives with its scaling folded in by the sender and a config whose scaling is 1, but one with per-module
alphas or ranks is scaled here), and its LRU cache drops LoRA models beyond `max_cpu_loras` and builds them again
from the request when they are asked for. Each build therefore gets tensors of its own, fresh from the payload
(which is immutable bytes): built twice from one tensor, an adapter would be scaled twice
(tests/workers/test_inference_sync.py evicts and re-adds).

The hook into vLLM's loader (`WorkerLoRAManager._load_adapter`) is private, so it applies only to the vLLM
versions it was tested against (vllm_plugin.TESTED_VLLM); with any other the extension refuses to load.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from grpolora.workers.inference.gpu_headroom import TenantBudget, adapter_bytes_bound
from grpolora.workers.inference.payload import Layout, SharedPayload, unpack_payload

log = logging.getLogger(__name__)


def gpu_budget(vllm_config: Any, device: torch.device) -> TenantBudget:
    """What each tenant's sync member must fit in on this GPU: its memory as CUDA reports it, the engine's
    gpu_memory_utilization and the bound on an adapter of this model at the engine's max_lora_rank, in its dtype."""
    model = vllm_config.model_config
    return TenantBudget(
        total_bytes=lambda: torch.cuda.mem_get_info(device)[1],
        free_bytes=lambda: torch.cuda.mem_get_info(device)[0],
        gpu_memory_utilization=vllm_config.cache_config.gpu_memory_utilization,
        adapter_bytes=adapter_bytes_bound(
            model.hf_config.to_dict(), vllm_config.lora_config.max_lora_rank, model.dtype.itemsize
        ),
    )


MEMORY_PATH_PREFIX = "grpolora-memory:"  # LoRARequest.lora_path of an adapter built from memory (never a path)


@dataclass(frozen=True)
class HeldAdapter:
    """What a worker keeps of an adapter while its LoRA id may be (re)loaded: the payload and its config."""

    payload: SharedPayload
    layout: Layout
    adapter_config: dict


def build_lora_model(manager: Any, lora_id: int, held: HeldAdapter) -> Any:
    """vLLM's LoRA model for `held` (what WorkerLoRAManager._load_adapter makes from a folder), from memory."""
    from vllm.lora.peft_helper import PEFTHelper

    config = dict(held.adapter_config, vllm_max_position_embeddings=manager.max_position_embeddings)
    peft_helper = PEFTHelper.from_dict(config)
    peft_helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return manager._lora_model_cls.from_lora_tensors(
        lora_id,
        unpack_payload(held.payload, held.layout),
        peft_helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )


class AdapterExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); its methods are called with `collective_rpc`.
    Every name starts with `grpolora_` so that none can collide with a worker attribute (vLLM asserts it)."""

    def grpolora_add_adapter(
        self, name: str, lora_id: int, segment: str, size: int, layout: Layout, adapter_config: dict
    ) -> bool:
        """Hold the adapter in shared-memory `segment` under `lora_id` and load it into vLLM's LoRA cache (as
        `add_lora` would)."""
        held = self._grpolora_held()
        held[lora_id] = HeldAdapter(SharedPayload(segment, size), [tuple(entry) for entry in layout], adapter_config)
        try:
            return self.add_lora(lora_request(name, lora_id))  # type: ignore[attr-defined]
        except BaseException:
            held.pop(lora_id).payload.close()
            raise

    def grpolora_remove_adapter(self, lora_id: int) -> bool:
        """Unload `lora_id` from vLLM and forget its payload."""
        removed = self.remove_lora(lora_id)  # type: ignore[attr-defined]
        adapter = self._grpolora_held().pop(lora_id, None)
        if adapter is not None:
            adapter.payload.close()
        return removed

    def grpolora_member_host(self, address: str, authkey_hex: str, cpus: list[int] | None = None) -> bool:
        """Become the sync-group member host of this engine if this is its first worker (TP rank 0): connect to
        the HTTP process at `address` and receive the tenants' rounds here (workers/inference/member_host.py), on
        threads that may use `cpus` (the server's). The other workers answer False: they get each adapter by
        mapping the segment the member staged it in."""
        if getattr(self, "rank", 0) != 0:
            return False
        from grpolora.workers.inference.member_host import serve_host

        device = getattr(self, "device", None)
        device = device if isinstance(device, torch.device) else None
        # Only a GPU replica's members take memory vLLM does not count (gpu_headroom.py); on CPUs nothing to check.
        budget = gpu_budget(self.vllm_config, device) if device is not None and device.type == "cuda" else None  # type: ignore[attr-defined]
        self._grpolora_member_host = serve_host(address, authkey_hex, device, cpus, budget)
        return True

    def grpolora_held_adapters(self) -> list[int]:
        """The LoRA ids whose payloads this worker holds (for tests: none is kept after its removal)."""
        return sorted(self._grpolora_held())

    def _grpolora_held(self) -> dict[int, HeldAdapter]:
        """The payloads by LoRA id, made on first use, when vLLM's loader is also hooked to read them."""
        held = getattr(self, "_grpolora_adapters", None)
        if held is None:
            held = self._grpolora_adapters = {}
            hook_loader(self.model_runner.lora_manager, held)  # type: ignore[attr-defined]
        return held


def memory_path(name: str) -> str:
    """The LoRARequest path of an adapter from memory: unique per name, as vLLM's prefix cache keys on it."""
    return f"{MEMORY_PATH_PREFIX}{name}"


def lora_request(name: str, lora_id: int):
    """The LoRARequest of an adapter loaded from memory (AdapterExtension.grpolora_add_adapter)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id, memory_path(name))


def hook_loader(manager: Any, held: Mapping[int, HeldAdapter]) -> None:
    """Make `manager` (vLLM's WorkerLoRAManager) build the LoRA ids in `held` from memory, the first time and each
    time its LRU cache dropped them; any other id loads as vLLM would."""
    import vllm

    from grpolora.workers.inference.vllm_plugin import TESTED_VLLM

    if not vllm.__version__.startswith(TESTED_VLLM):
        raise RuntimeError(
            f"adapters from memory hook vLLM's private LoRA loader, tested with vLLM {TESTED_VLLM}, not "
            f"{vllm.__version__}"
        )
    from_folder = manager._load_adapter

    def load(lora_request):
        adapter = held.get(lora_request.lora_int_id)
        if adapter is None:
            return from_folder(lora_request)
        return build_lora_model(manager, lora_request.lora_int_id, adapter)

    manager._load_adapter = load
