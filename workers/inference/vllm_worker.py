"""Adapters built from memory inside vLLM's own worker processes: no folder between a sync round and vLLM.

vLLM's public `add_lora` loads an adapter from a folder. A synced adapter reaches the workers instead as one
contiguous payload in a shared-memory segment, named with its layout in a `collective_rpc` (vLLM's call into its
workers between engine steps), and becomes a LoRA model there with vLLM's `LoRAModel.from_lora_tensors`.
`AdapterExtension` is the worker extension class (`worker_extension_cls`) that vLLM mixes into its worker class: it
keeps each adapter's payload for as long as the LoRA id is in use and answers vLLM's own (re)loads of that id from
it. Its first worker (TP rank 0) is also the sync-group member of the replica (`grpolora_member_host`,
workers/inference/members.py): the segment a synced adapter arrives in is the one that member received and
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

import contextlib
import logging
import mmap
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import torch

log = logging.getLogger(__name__)

MEMORY_PATH_PREFIX = "grpolora-memory:"  # LoRARequest.lora_path of an adapter built from memory (never a path)
SHM_DIR = "/dev/shm"  # where shm_open puts a segment's name: SharedPayload maps it from there

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

ALIGN = 64  # bytes; every tensor starts aligned, so that a byte view can be reinterpreted as its dtype
# (name, dtype, shape, byte offset, nbytes) per tensor: plain types, as vLLM's RPC serialises them.
Layout = list[tuple[str, str, list[int], int, int]]


def payload_layout(tensors: Mapping[str, torch.Tensor]) -> tuple[Layout, int]:
    """Where each tensor goes in one contiguous payload, and the payload's size."""
    layout: Layout = []
    offset = 0
    for name, tensor in tensors.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ValueError(f"adapter tensor {name}: dtype {dtype} not one of {sorted(_DTYPES)}")
        nbytes = tensor.numel() * tensor.element_size()
        layout.append((name, dtype, list(tensor.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return layout, offset


def pack_into(buffer: Any, tensors: Mapping[str, torch.Tensor], layout: Layout) -> None:
    """Copy the tensors into `buffer` (any writable buffer of the layout's size) as the layout says."""
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    for (_, _, _, start, nbytes), tensor in zip(layout, tensors.values(), strict=True):
        # Copied as the tensor's own dtype into an aligned view: a byte-wise copy is ~100x slower on CPUs.
        flat[start : start + nbytes].view(tensor.dtype).copy_(tensor.detach().reshape(-1))


def pack_payload(tensors: Mapping[str, torch.Tensor]) -> tuple[bytearray, Layout]:
    """The tensors as one contiguous buffer (one copy) and its layout."""
    layout, size = payload_layout(tensors)
    payload = bytearray(size)
    if size:
        pack_into(payload, tensors, layout)
    return payload, layout


@contextlib.contextmanager
def shared_payload(tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, int, Layout]]:
    """The tensors packed into a shared-memory segment for vLLM's workers to read (its name, size and layout),
    removed on leaving. Shared memory, not vLLM's RPC, carries the bytes: the RPC would serialise them and copy
    them through its sockets and queues several times on the way (about 4x the time on a busy CPU), while the
    workers, on the same host as the server that started them, can read the one packed copy directly."""
    layout, size = payload_layout(tensors)
    segment = shared_memory.SharedMemory(create=True, size=max(size, 1))
    try:
        # Reserve the pages first: a full /dev/shm then fails here with ENOSPC (an activation failure, the old
        # version keeps serving) instead of killing the server with SIGBUS on the first write to a missing page.
        os.posix_fallocate(segment._fd, 0, max(size, 1))  # type: ignore[attr-defined]
        if size:
            pack_into(segment.buf[:size], tensors, layout)
        yield segment.name, size, layout
    finally:
        segment.close()
        segment.unlink()


class SharedPayload:
    """A worker's hold on a shared payload while its LoRA id is loaded: the segment's file, open. The server removes
    the segment's name as soon as the call returns; the open file, and so the bytes, stay until `close` (or this
    process ends, so nothing outlives a crash). Nothing writes to the segment after the server packed it."""

    def __init__(self, name: str, size: int):
        # Opened as the file shm_open made of it, not with shared_memory.SharedMemory: Python 3.11 registers a
        # segment it only opens with the resource tracker, which vLLM's workers share with the server that started
        # them, and unregistering it took the server's own registration away (its unlink then made the tracker print
        # a KeyError traceback). Its creator alone tracks and removes it.
        self._descriptor = os.open(os.path.join(SHM_DIR, name.lstrip("/")), os.O_RDONLY)
        self.size = size

    def private_mapping(self) -> mmap.mmap:
        """The payload mapped copy-on-write (MAP_PRIVATE): reads share the segment's pages, and a write copies only
        the page written, for this mapping alone. The mapping lasts as long as something refers to it."""
        return mmap.mmap(self._descriptor, max(self.size, 1), access=mmap.ACCESS_COPY)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._descriptor)


def unpack_payload(
    payload: bytes | bytearray | SharedPayload, layout: Sequence[Sequence[Any]]
) -> dict[str, torch.Tensor]:
    """Fresh tensors from a payload that no other build's tensors share (vLLM scales them in place): a private
    mapping of a shared payload (copy-on-write: vLLM writes to lora_B alone, so most pages are never copied), or a
    copy of plain bytes."""
    owned = payload.private_mapping() if isinstance(payload, SharedPayload) else bytearray(payload)
    size = payload.size if isinstance(payload, SharedPayload) else len(owned)
    if not size:
        return {name: torch.empty(shape, dtype=_DTYPES[dtype]) for name, dtype, shape, _, _ in layout}
    flat = torch.frombuffer(owned, dtype=torch.uint8)[:size]  # the tensors keep the mapping alive
    tensors = {}
    for name, dtype, shape, offset, nbytes in layout:
        if offset < 0 or offset + nbytes > size:
            raise ValueError(f"adapter tensor {name}: bytes {offset}..{offset + nbytes} outside the payload")
        tensors[name] = flat[offset : offset + nbytes].view(_DTYPES[dtype]).view(tuple(shape))
    return tensors


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
        the HTTP process at `address` and receive the tenants' rounds here (workers/inference/members.py), on
        threads that may use `cpus` (the server's). The other workers answer False: they get each adapter by
        mapping the segment the member staged it in."""
        if getattr(self, "rank", 0) != 0:
            return False
        from grpolora.workers.inference.members import serve_host

        device = getattr(self, "device", None)
        self._grpolora_member_host = serve_host(
            address, authkey_hex, device if isinstance(device, torch.device) else None, cpus
        )
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
