"""GPU risk: a replica that accepted the join and never reaches the group costs trainer rank 0 one join timeout.

    python bench/gpu_probe_formation.py                    # one CUDA GPU: every mode below, each in its own process
    python bench/gpu_probe_formation.py --backend gloo     # CPU: the project's path over gloo (meaningful, no GPU)

ProcessGroupNCCL creates its communicator inside the first collective, and in blocking mode (PyTorch's default)
ncclCommInitRank waits until every rank has reached NCCL's bootstrap; abort() cannot reach a communicator still being
created (workers/sync/nccl.py). Rank 1 here is played by a process that connects to the store, as a member does, and
then never calls NCCL (never arrives). Modes, each run in a fresh process:
- project: the project's create_transport as trainer rank 0 builds its side (nccl.NcclTransport._form). PASS when it
  raises TransportError within the join timeout plus 5 s, and the next epoch then forms in the same process (beside
  the formation's thread NcclTransport abandoned inside NCCL).
- blocking / nonblocking: a bare ProcessGroupNCCL (config.blocking left to PyTorch, or 0), its first all-reduce on a
  thread, then abort() from another thread after 3 join timeouts: whether abort returns and whether the formation's
  thread is freed by it. "freed" under nonblocking would let NcclTransport set config.blocking = 0 and abandon no
  thread; "still blocked" in both is what NcclTransport's design assumes.
Each prints one line starting with its mode and a verdict.
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
from grpolora.workers.sync.transport import TransportError, connect_store, epoch_store

MODES = ("project", "blocking", "nonblocking")


PEER = (
    "import datetime, time, torch.distributed as dist\n"
    "store = dist.TCPStore('127.0.0.1', {port}, None, False, datetime.timedelta(seconds=30))\n"
    "time.sleep(3600)\n"
)


def start_peer(port: int) -> subprocess.Popen:
    """Rank 1: a process that reaches the trainer's store (its join was accepted) and then never reaches the group.
    -P: the repository's operator/ must not shadow the standard library's in it either."""
    return subprocess.Popen([sys.executable, "-P", "-c", PEER.format(port=port)])


def project(backend: str, port: int, join_timeout: float) -> str:
    store = connect_store("127.0.0.1", port, is_master=True, timeout_seconds=30)
    device = torch.device("cuda", 0) if backend == "nccl" else None
    outcome: dict[str, object] = {}

    def form(epoch: int, world_size: int) -> None:
        started = time.monotonic()
        try:
            create_transport(
                backend, store, epoch=epoch, rank=0, world_size=world_size, timeout_seconds=600,
                join_timeout_seconds=join_timeout, device=device, free_cached_memory=backend == "nccl",
            ).close()  # fmt: skip
            outcome[f"formed {epoch}"] = time.monotonic() - started
        except TransportError as exc:
            outcome[f"raised {epoch}"] = (time.monotonic() - started, str(exc).splitlines()[0][:160])

    thread = threading.Thread(target=form, args=(0, 2), daemon=True)
    thread.start()
    thread.join(join_timeout + 30)
    if "raised 0" in outcome:
        seconds, message = outcome["raised 0"]  # type: ignore[misc]
        # The next epoch (here a group of one) forms beside the formation abandoned in NCCL, if one was.
        thread = threading.Thread(target=form, args=(1, 1), daemon=True)
        thread.start()
        thread.join(join_timeout + 30)
        following = outcome.get("formed 1")
        verdict = "PASS" if seconds <= join_timeout + 5 and following is not None else "FAIL"
        bound = f"join timeout {join_timeout:g}s"
        after = f"the next epoch formed in {following:.2f}s" if following is not None else f"the next epoch: {outcome}"
        return f"project/{backend}: {verdict}: TransportError after {seconds:.1f}s ({bound}): {message}; {after}"
    if "formed 0" in outcome:
        return "project: FAIL: formed without rank 1 (impossible: the probe is wrong)"
    return f"project/{backend}: FAIL: still forming after {join_timeout + 30:g}s (the join timeout does not bound it)"


def bare(mode: str, port: int, join_timeout: float) -> str:
    store = connect_store("127.0.0.1", port, is_master=True, timeout_seconds=30)
    os.environ.update(nccl.ERROR_ENVIRONMENT)  # as the project's groups are built
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = dt.timedelta(seconds=600)
    if mode == "nonblocking":
        if not hasattr(options, "config"):
            return f"{mode}: not run: this torch's ProcessGroupNCCL.Options has no config (no per-group blocking)"
        options.config.blocking = 0  # this group only (ProcessGroupNCCL::useNonblocking, 1st priority)
    group = dist.ProcessGroupNCCL(epoch_store(store, 0), 0, 2, options)
    outcome: dict[str, object] = {}

    def form() -> None:
        started = time.monotonic()
        try:
            work = group.allreduce([torch.zeros(1, device="cuda")])
            outcome["allreduce returned"] = round(time.monotonic() - started, 1)
            work.wait(dt.timedelta(seconds=join_timeout))
            outcome["wait returned"] = round(time.monotonic() - started, 1)
        except Exception as exc:  # what the probe reports
            first_line = str(exc).splitlines()[0][:100]
            outcome["raised"] = (round(time.monotonic() - started, 1), type(exc).__name__, first_line)

    forming = threading.Thread(target=form, daemon=True)
    forming.start()
    forming.join(3 * join_timeout)
    before = dict(outcome) or "first all-reduce still blocked (ncclCommInitRank)"
    if not forming.is_alive():
        return f"{mode}: formation ended on its own within {3 * join_timeout:g}s: {before}"
    aborting = threading.Thread(target=group.abort, daemon=True)
    aborting.start()
    aborting.join(30)
    forming.join(15)
    return (
        f"{mode}: after {3 * join_timeout:g}s {before}; abort() from another thread "
        f"{'returned' if not aborting.is_alive() else 'blocked'}; formation's thread "
        f"{'freed: ' + str(outcome) if not forming.is_alive() else 'still blocked (abandoned)'}"
    )


def run_one(mode: str, backend: str, join_timeout: float) -> None:
    port = free_port()
    peer = start_peer(port)
    try:
        line = project(backend, port, join_timeout) if mode == "project" else bare(mode, port, join_timeout)
    finally:
        peer.kill()
    print(line, flush=True)
    os._exit(0)  # an abandoned formation thread may still be inside NCCL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--mode", choices=(*MODES, "all"), default="all")
    parser.add_argument("--join-timeout", type=float, default=10.0)
    args = parser.parse_args()
    if args.backend == "gloo":
        args.mode = "project" if args.mode == "all" else args.mode
        if args.mode != "project":
            parser.error("--backend gloo has only the project mode (the bare modes are NCCL's)")
    elif not torch.cuda.is_available():
        parser.error("--backend nccl needs a CUDA GPU; --backend gloo runs the project's path on CPUs")
    if args.mode != "all":
        run_one(args.mode, args.backend, args.join_timeout)
        return
    for mode in MODES:  # each in a fresh process: an aborted or hung communicator stays behind
        command = [sys.executable, __file__, "--mode", mode, "--join-timeout", str(args.join_timeout)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=6 * args.join_timeout + 90)
            lines = [line for line in done.stdout.splitlines() if line.startswith(mode)]
            print(lines[-1] if lines else f"{mode}: no verdict (exit {done.returncode}): {done.stderr[-400:]}")
        except subprocess.TimeoutExpired:
            print(f"{mode}: FAIL: the probe itself hung past {6 * args.join_timeout + 90:g}s")


if __name__ == "__main__":
    main()
