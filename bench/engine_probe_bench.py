"""The cost of the inference server's health round trip (VllmEngine.round_trip: a collective_rpc of vLLM's
WorkerBase.check_health through the EngineCore to every worker, which /health bounds by ENGINE_PROBE_SECONDS).

    python bench/engine_probe_bench.py [--probes 100] [--batches 4] [--out bench/results/engine_probe.json]

One CPU engine (SmolLM2-135M-Instruct, float32), measured three ways:
- **idle**: round trips one after the other, nothing generating;
- **busy**: round trips while a batch generates (the call waits for the engine step in progress to end);
- **generation with and without probes**: the same batch (8 prompts x 2 samples x 32 tokens), alternately alone
  and with a round trip every 0.1 s beside it (a hundred times the liveness probe's rate), so that a busy machine
  slows both alike.
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
import statistics
import time
from pathlib import Path

from grpolora.workers.inference.vllm_engine import EngineConfig, SamplingRequest, VllmEngine
from grpolora.workers.models import resolve_model

MODEL = "offline:smollm2-135m-instruct"
PROMPTS, SAMPLES, TOKENS = 8, 2, 32


def summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "n": len(ordered),
        "median_ms": round(1000 * statistics.median(ordered), 3),
        "p95_ms": round(1000 * ordered[int(0.95 * (len(ordered) - 1))], 3),
        "max_ms": round(1000 * ordered[-1], 3),
    }


async def timed_round_trip(engine: VllmEngine) -> float:
    started = time.perf_counter()
    await engine.round_trip()
    return time.perf_counter() - started


async def batch(engine: VllmEngine, index: int) -> float:
    request = SamplingRequest(n=SAMPLES, temperature=1.0, top_p=1.0, top_k=0, max_tokens=TOKENS, seed=index)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8 + p] for p in range(PROMPTS)]
    started = time.perf_counter()
    await asyncio.gather(*(engine.generate(prompt, request, None) for prompt in prompts))
    return time.perf_counter() - started


async def measure(engine: VllmEngine, probes: int, batches: int) -> dict:
    await engine.start()
    await batch(engine, -1)  # warm
    idle = [await timed_round_trip(engine) for _ in range(probes)]
    busy: list[float] = []
    alone: list[float] = []
    probed: list[float] = []
    for index in range(batches):
        alone.append(await batch(engine, index))
        generating = asyncio.create_task(batch(engine, 1000 + index))
        while not generating.done():
            busy.append(await timed_round_trip(engine))
            await asyncio.sleep(0.1)
        probed.append(await generating)
    return {
        "idle": summary(idle),
        "busy": summary(busy),
        "batch_alone_s": round(statistics.median(alone), 3),
        "batch_probed_every_0.1s_s": round(statistics.median(probed), 3),
        "batch": f"{PROMPTS} prompts x {SAMPLES} samples x {TOKENS} tokens",
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--probes", type=int, default=100)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--out", default="bench/results/engine_probe.json")
    args = parser.parse_args()
    engine = VllmEngine(
        EngineConfig(
            model_dir=str(resolve_model(MODEL)),
            dtype="float32",
            max_lora_rank=8,
            max_loras=1,
            max_model_len=512,
            gpu_memory_utilization=0.05,
            enforce_eager=True,
            whole_prefills=True,
        )
    )
    try:
        result = asyncio.run(measure(engine, args.probes, args.batches))
    finally:
        engine.shutdown()
    result["model"] = MODEL
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
