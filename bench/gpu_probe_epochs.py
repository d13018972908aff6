"""GPU risk: re-forming the sync group every epoch leaks nothing and starts no c10d watchdog or heartbeat thread.

    python bench/gpu_probe_epochs.py                  # one CUDA GPU: the NCCL transport, a group of one
    python bench/gpu_probe_epochs.py --backend gloo   # CPU: the same walk over gloo (threads and descriptors only)

A pool re-forms a tenant's group at every scale event and a job at every lost replica, so whatever one epoch leaves
behind grows for the life of a server. Each epoch here goes as the project runs it: create_transport (the trainer's
side: the allocator's cache freed first on NCCL), an adapter's worth of bytes broadcast in the transport's pieces,
close (NCCL: abort). Measured against the state after the first epoch (one-time initialisation excluded): the
process's threads by name, its open file descriptors, and on a GPU its free memory; and each formation's and
close's time. PASS when no pt_nccl_watchdg or pt_nccl_heartbt thread ever runs (TORCH_NCCL_BLOCKING_WAIT=1 creates
none, nccl.py), and threads, descriptors and (GPU) free memory come back within a cached block of the baseline.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: the repo's operator/ must not shadow stdlib

import torch

from grpolora.testing.servers import free_port
from grpolora.workers.sync.groups import create_transport
from grpolora.workers.sync.transport import connect_store

C10D_THREADS = ("pt_nccl_watchdg", "pt_nccl_heartbt")
MIB = 1 << 20


def thread_names() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return sorted(names)


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def free_bytes(gpu: bool) -> int:
    return torch.cuda.mem_get_info()[0] if gpu else 0


def walk(backend: str, epochs: int, payload_bytes: int) -> str:
    gpu = backend == "nccl"
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    store = connect_store("127.0.0.1", free_port(), is_master=True, timeout_seconds=30)
    payload = torch.empty(payload_bytes, dtype=torch.uint8, device=device)
    forming, closing, seen = [], [], set()
    baseline: tuple[int, int, int] | None = None
    for epoch in range(epochs):
        started = time.perf_counter()
        transport = create_transport(
            backend, store, epoch=epoch, rank=0, world_size=1, timeout_seconds=600, join_timeout_seconds=30,
            device=device if gpu else None, free_cached_memory=gpu,
        )  # fmt: skip
        forming.append(time.perf_counter() - started)
        for op in [transport.start_broadcast(piece) for piece in transport.pieces(payload)]:
            op.wait()
        seen.update(thread_names())
        started = time.perf_counter()
        transport.close()
        del transport
        closing.append(time.perf_counter() - started)
        if gpu:
            torch.cuda.synchronize()
        if epoch == 0:
            time.sleep(0.5)  # a formation's own thread ends as it returns
            baseline = (len(thread_names()), descriptors(), free_bytes(gpu))
    time.sleep(0.5)
    assert baseline is not None
    threads, fds, free = len(thread_names()) - baseline[0], descriptors() - baseline[1], free_bytes(gpu) - baseline[2]
    c10d = sorted(seen & set(C10D_THREADS))
    leaked = threads > 0 or fds > 0 or (gpu and free < -64 * MIB)
    verdict = "FAIL" if c10d or leaked else "PASS"
    median = statistics.median
    return (
        f"epochs/{backend}: {verdict}: {epochs} epochs of {payload_bytes / MIB:.0f} MiB; c10d threads seen: "
        f"{c10d or 'none'}; after them against after the first: threads {threads:+d}, descriptors {fds:+d}"
        + (f", GPU free {free / MIB:+.0f} MiB" if gpu else "")
        + f"; form ms median {median(forming) * 1e3:.0f} max {max(forming) * 1e3:.0f}, close ms median "
        f"{median(closing) * 1e3:.0f} max {max(closing) * 1e3:.0f}; threads seen: {sorted(seen)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--payload-mib", type=int, help="default: 83 (an 8B model's r16 adapter) on a GPU, 8 on CPUs")
    args = parser.parse_args()
    if args.backend == "nccl" and not torch.cuda.is_available():
        parser.error("--backend nccl needs a CUDA GPU; --backend gloo walks the same epochs on CPUs")
    if args.epochs < 2:
        parser.error("--epochs: at least 2 (the first is the baseline)")
    mib = args.payload_mib if args.payload_mib is not None else (83 if args.backend == "nccl" else 8)
    print(walk(args.backend, args.epochs, mib * MIB), flush=True)


if __name__ == "__main__":
    main()
