"""GPU risk: torch.cuda.empty_cache() next to a live allocator, as a sync member in vLLM's process would have called it.

    python bench/gpu_probe_empty_cache.py      # one CUDA GPU (GPU only: the caching allocator and the device sync)

The member no longer calls it (workers/sync/nccl.py: only trainer rank 0 frees its cache); this measures what it cost.
An "engine" thread runs vLLM's loop in miniature (a matmul, a small allocation, a host sync per step) while a side
stream holds a kernel "in flight" for a few seconds, as another tenant's receive stuck on a dead sender would; then
empty_cache() runs on the main thread. A pure-Python ticker tells whether the GIL was held meanwhile.
Verdict: HARMFUL when the engine's longest step during empty_cache is over 100 ms and 10x its longest step before
(the member's call would stall vLLM's every allocation behind the slowest kernel), else HARMLESS.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

IN_FLIGHT_SECONDS = 3.0
CYCLES_PER_SECOND = 1.98e9  # an H200's clock, near enough: _sleep spins this many cycles per second


def probe() -> str:
    side = torch.cuda.Stream()
    cached = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
    del cached  # 512 MiB of free blocks in the allocator's cache: what empty_cache hands back
    steps: list[float] = []
    ticks: list[float] = []
    stop = threading.Event()

    def engine() -> None:
        a = torch.randn(2048, 2048, device="cuda")
        while not stop.is_set():
            started = time.perf_counter()
            b = (a @ a).sum()
            torch.empty(1 << 20, device="cuda")
            b.item()
            steps.append(time.perf_counter() - started)

    def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.005)
            now = time.perf_counter()
            ticks.append(now - last)
            last = now

    threads = [threading.Thread(target=f, daemon=True) for f in (engine, ticker)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    before = max(steps)
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(IN_FLIGHT_SECONDS * CYCLES_PER_SECOND))
    marker = len(steps)
    started = time.perf_counter()
    torch.cuda.empty_cache()
    took = time.perf_counter() - started
    time.sleep(0.5)
    stop.set()
    for thread in threads:
        thread.join()
    during = max(steps[marker:] or [0.0])
    harmful = during > 0.1 and during > 10 * before
    return (
        f"empty_cache: {'HARMFUL' if harmful else 'HARMLESS'}: it took {took:.2f}s with a {IN_FLIGHT_SECONDS:g}s "
        f"kernel in flight; the engine's longest step {during * 1e3:.0f} ms during it against {before * 1e3:.0f} ms "
        f"before; longest GIL gap {max(ticks) * 1e3:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: there is no caching allocator or device sync to measure on CPUs")
    print(probe(), flush=True)


if __name__ == "__main__":
    main()
