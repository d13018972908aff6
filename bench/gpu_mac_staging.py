"""Where the payload MAC's time goes on a GPU, and what the page-locked staging (wire.host_chunks) changed.

    python bench/gpu_mac_staging.py        # one CUDA GPU; writes bench/results/gpu_mac_staging.json (seconds)

On one 87,293,952-byte bucket (Qwen3-8B's LoRA r=16 adapter in bfloat16, BENCHMARKS.md), median of 5 each:
- `.cpu()` of the bucket, whole and in 4 MiB pieces (what the sender's MAC did before: fresh pageable memory);
- a copy into one page-locked buffer, and Poly1305 over the bytes on the host;
- `wire.PayloadMac.update` on the GPU bucket as the code does now (through the reused page-locked staging);
- a receiver's landing copies (member_host.land) of the 4 MiB pieces into a /dev/shm staging segment
  (payload.new_segment), as they are, and after registering the segment with cudaHostRegister.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: the repo's operator/ must not shadow stdlib

import torch

from grpolora.workers.inference.payload import new_segment, remove_segment
from grpolora.workers.sync import transport, wire

BYTES = 87_293_952


def timed(fn: Callable[[], object], reps: int = 5) -> float:
    seconds = []
    for _ in range(reps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/gpu_mac_staging.json")
    args = parser.parse_args()
    bucket = torch.randint(0, 256, (BYTES,), dtype=torch.uint8, device="cuda")
    pinned = torch.empty(BYTES, dtype=torch.uint8, pin_memory=True)
    host = bucket.cpu()
    key = wire.round_key("bench")
    piece = transport.PIECE_BYTES

    def mac(tensor: torch.Tensor) -> None:
        wire.PayloadMac(key, "poly1305", "00" * 16).update(tensor)

    result: dict[str, object] = {
        "bytes": BYTES,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cpu_pageable_whole_seconds": timed(lambda: bucket.cpu()),
        "cpu_pageable_pieces_seconds": timed(lambda: [p.cpu() for p in bucket.split(piece)]),
        "page_locked_copy_seconds": timed(lambda: pinned.copy_(bucket)),
        "poly1305_on_host_seconds": timed(lambda: mac(host)),
        "payload_mac_of_gpu_bucket_seconds": timed(lambda: mac(bucket)),
    }
    os.environ.setdefault("GRPOLORA_STAGE_OWNER", "bench")
    name, segment = new_segment(BYTES)
    try:
        pairs = list(zip(bucket.split(piece), segment.split(piece), strict=True))

        def land() -> None:
            for source, target in pairs:
                target.copy_(source)

        result["land_into_segment_seconds"] = timed(land)
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(segment.data_ptr(), BYTES, 0)) == 0:
            result["land_into_registered_segment_seconds"] = timed(land)
            cudart.cudaHostUnregister(segment.data_ptr())
    finally:
        remove_segment(name)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: round(v * 1e3, 2) if isinstance(v, float) else v for k, v in result.items()}, indent=1))


if __name__ == "__main__":
    main()
