"""Activation of a synced adapter in one vLLM engine, from memory vs from a tmpfs peft folder, interleaved.

    python bench/activation_bench.py [--rounds 10] [--out bench/results/activation.json]

The part of a sync round that issue 22 replaced, alone and side by side in one run, so that a busy machine slows
both alike: the quickstart's adapter (SmolLM2-135M-Instruct, float32, LoRA r=16 on all linear layers, 19.5 MB)
made live in one CPU engine, alternately
- **memory** (today): `VllmEngine.add_lora`, the payload through shared memory into vLLM's worker, built there
  with `LoRAModel.from_lora_tensors`;
- **folder** (before): the peft folder written to /dev/shm (`save_adapter`), then vLLM's public
  `add_lora(LoRARequest(path))`, which reads it back in its worker.
Each activation is timed from the call to its return (the version is loaded in vLLM's workers), and the LoRA
removed again before the next one.
"""

from __future__ import annotations

import os

# Set before torch is imported: see workers/inference/vllm_engine.py, cpu_engine_env.
os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from grpolora.workers.adapter import lora_config, lora_tensors, save_adapter
from grpolora.workers.inference.vllm_engine import EngineConfig, VllmEngine
from grpolora.workers.inference.vllm_worker import lora_request
from grpolora.workers.models import resolve_model

MODEL = "offline:smollm2-135m-instruct"


def build_policy(model_dir: Path):
    """bench/sync_bench.py's adapter: r=16 on all linear layers, lora_B nonzero."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default="bench/results/activation.json")
    args = parser.parse_args()
    model_dir = resolve_model(MODEL)
    policy = build_policy(model_dir)
    tensors, config = lora_tensors(policy), lora_config(policy)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    folder_root = Path(tempfile.mkdtemp(prefix="activation-bench-", dir="/dev/shm"))
    engine = VllmEngine(
        EngineConfig(
            model_dir=str(model_dir),
            dtype="float32",
            max_lora_rank=16,
            max_loras=2,
            max_model_len=512,
            gpu_memory_utilization=0.05,
            enforce_eager=True,
            whole_prefills=True,
        )
    )

    async def run() -> dict[str, list[float]]:
        from vllm.lora.request import LoRARequest

        await engine.start()
        seconds: dict[str, list[float]] = {"memory": [], "folder": []}
        try:
            for _ in range(args.rounds):
                for kind in ("memory", "folder"):
                    lora_id = engine.new_lora_id()
                    name = f"{kind}/v{lora_id}"
                    started = time.perf_counter()
                    if kind == "memory":
                        await engine.add_lora(lora_request(name, lora_id), tensors, config)
                    else:
                        folder = folder_root / str(lora_id)
                        await asyncio.to_thread(save_adapter, folder, tensors, config)
                        await engine._engine.add_lora(LoRARequest(name, lora_id, str(folder)))
                    seconds[kind].append(time.perf_counter() - started)
                    await engine.remove_lora(lora_id)
                    if kind == "folder":
                        shutil.rmtree(folder_root / str(lora_id))
        finally:
            engine.shutdown()
            shutil.rmtree(folder_root, ignore_errors=True)
        return seconds

    seconds = asyncio.run(run())
    summary = {
        "adapter_bytes": nbytes,
        "rounds": args.rounds,
        "memory_median_s": statistics.median(seconds["memory"]),
        "folder_median_s": statistics.median(seconds["folder"]),
        "memory_min_s": min(seconds["memory"]),
        "folder_min_s": min(seconds["folder"]),
    }
    summary["folder_over_memory"] = summary["folder_median_s"] / summary["memory_median_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "seconds": seconds}, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
