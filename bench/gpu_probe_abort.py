"""GPU risk: a collective cut by an abort from another thread is never taken for a finished one.

    python bench/gpu_probe_abort.py        # one CUDA GPU; both modes, each in its own process (GPU only: these are
                                           # NCCL's semantics, which gloo does not have)

Read in ProcessGroupNCCL.cpp, WorkNCCL::wait returns normally once another thread aborted the communicator
(isCompleted skips its error check when aborted, and no exception is set); the project therefore checks its own
"closed" state after every wait (Transport.check_open). One GPU holds a group of one: the collective is held "in
flight" by a kernel queued before it on the current stream (torch.cuda._sleep), which NCCL's stream waits for, as a
receive waits for a peer that never sends. Modes:
- bare: a bare ProcessGroupNCCL; the thread blocked in wait() while another aborts. "returned normally" confirms the
  reading (the project's check is needed); "raised" would make the check a second line of defence only. Then
  whether the CUDA context is still usable after aborting with queued work.
- project: the project's NcclTransport; its all_reduce_sum blocked, the transport closed (what the round's watchdog
  does). PASS when it raises TransportError; FAIL when it returns (the sender would read all-zero statuses).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: the repo's operator/ must not shadow stdlib

import torch
import torch.distributed as dist

from grpolora.testing.servers import free_port
from grpolora.workers.sync import nccl
from grpolora.workers.sync.groups import create_transport
from grpolora.workers.sync.transport import TransportError, connect_store

SLEEP_SECONDS = 8.0
CYCLES_PER_SECOND = 1.98e9  # an H200's clock, near enough: _sleep spins this many cycles per second


def blocked_wait(wait, close) -> tuple[str, float]:
    """`wait` on a thread, `close` from this one a second later: what the waiting thread saw, and how long it took."""
    seen: dict[str, object] = {}

    def waiter() -> None:
        started = time.monotonic()
        try:
            wait()
            seen["what"] = "returned normally"
        except Exception as exc:  # what the probe reports
            seen["what"] = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        seen["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    time.sleep(1.0)
    close()
    thread.join(SLEEP_SECONDS + 30)
    if thread.is_alive():
        return f"still blocked {SLEEP_SECONDS + 30:g}s after the abort", -1.0
    return str(seen["what"]), float(seen["seconds"])  # type: ignore[arg-type]


def bare() -> str:
    os.environ.update(nccl.ERROR_ENVIRONMENT)
    store = connect_store("127.0.0.1", free_port(), is_master=True, timeout_seconds=30)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = dt.timedelta(seconds=600)
    group = dist.ProcessGroupNCCL(store, 0, 1, options)
    x = torch.ones(1 << 20, device="cuda")
    group.allreduce([x]).wait()  # the communicator formed
    torch.cuda._sleep(int(SLEEP_SECONDS * CYCLES_PER_SECOND))  # NCCL's stream waits for it: "in flight"
    work = group.allreduce([x])
    aborted: list[float] = []

    def abort() -> None:
        started = time.monotonic()
        group.abort()
        aborted.append(time.monotonic() - started)

    what, seconds = blocked_wait(work.wait, abort)
    try:
        torch.cuda.synchronize()
        context = "usable"
    except Exception as exc:  # what the probe reports
        context = f"poisoned ({str(exc).splitlines()[0][:80]})"
    verdict = "CONFIRMED: the project's closed check is needed" if what == "returned normally" else "NOT CONFIRMED"
    return (
        f"bare: {verdict}: wait() {what} after {seconds:.1f}s; abort() took "
        f"{aborted[0] if aborted else float('nan'):.2f}s; CUDA context after it: {context}"
    )


def project() -> str:
    store = connect_store("127.0.0.1", free_port(), is_master=True, timeout_seconds=30)
    transport = create_transport(
        "nccl", store, epoch=0, rank=0, world_size=1, timeout_seconds=600, join_timeout_seconds=30,
        device=torch.device("cuda", 0), free_cached_memory=True,
    )  # fmt: skip
    torch.cuda._sleep(int(SLEEP_SECONDS * CYCLES_PER_SECOND))
    status = torch.zeros(1, dtype=torch.int64, device="cuda")
    what, seconds = blocked_wait(lambda: transport.all_reduce_sum(status), transport.close)
    passed = what.startswith(f"raised {TransportError.__name__}")
    return f"project: {'PASS' if passed else 'FAIL'}: the cut all-reduce {what} after {seconds:.1f}s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("bare", "project", "all"), default="all")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: an abort's semantics are NCCL's (the suite plays them: syncfakes.py)")
    if args.mode != "all":
        print(bare() if args.mode == "bare" else project(), flush=True)
        os._exit(0)  # an aborted communicator stays behind
    for mode in ("bare", "project"):  # each in a fresh process
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--mode", mode], capture_output=True, text=True, timeout=SLEEP_SECONDS + 90
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith(mode)]
            print(lines[-1] if lines else f"{mode}: no verdict (exit {done.returncode}): {done.stderr[-400:]}")
        except subprocess.TimeoutExpired:
            print(f"{mode}: FAIL: the probe itself hung past {SLEEP_SECONDS + 90:g}s")


if __name__ == "__main__":
    main()
