"""NCCL transport: GPU tensors over NVLink/InfiniBand/TCP. Used when both roles have GPUs. Runs in both processes of
a group: trainer rank 0 (the sender) and each replica's member (vLLM's TP rank 0 worker; at TP=1 the EngineCore).

A ProcessGroupNCCL built directly on the epoch's store: a communicator of its own, outside torch.distributed's
default group (which the trainer ranks use for FSDP), and `abort()` to tear it down when a peer is lost so that
the group can re-form under the next epoch.

Error handling is set explicitly for this group (ERROR_ENVIRONMENT, read by ProcessGroupNCCL's constructor),
because PyTorch's default is the wrong one for a group whose peers may die: its watchdog thread tears the whole
process down on a failed or timed-out collective (TORCH_NCCL_ASYNC_ERROR_HANDLING=3), and on a replica that process
is vLLM's engine. With TORCH_NCCL_BLOCKING_WAIT=1 the constructor starts no watchdog thread at all ("NO watchdog
thread is created", ProcessGroupNCCL.cpp), and with it no heartbeat monitor (which only that thread feeds): `wait()`
blocks in the calling thread and raises DistBackendError when the collective failed or ran past the group's timeout
(`sync.timeoutSeconds`), which becomes a TransportError. ASYNC_ERROR_HANDLING=2 and ENABLE_MONITORING=0 are set as
well, so that the group stays safe if a PyTorch release starts that thread under blocking wait again
(bench/gpu_probe_epochs.py lists the process's threads to check).

Three rules of NCCL that the code does not leave to it:
- Formation: the communicator is created inside the first collective, which blocks until every rank arrives, and
  abort() cannot reach it meanwhile. Formation runs on a thread of its own, bounded by `sync.joinTimeoutSeconds`
  (NcclTransport._form).
- A collective whose communicator this rank aborted (the round's watchdog, watchdog.py, or a newer join) returns
  from `wait()` normally. Every wait checks the transport's own closed state (Transport.check_open).
- The round's own watchdog cuts a stalled round; over P2P/NVLink/SHM NCCL never reports a dead peer.
Chosen over receiving with vLLM's stateless NCCL communicator (PyNcclCommunicator, as TRL's and NeMo-RL's weight sync
do): that one has no abort, so a receive posted to a dead sender could only end with the process.
The trainer's own FSDP group keeps PyTorch's defaults: a lost trainer rank ends the trainer, and the operator
restarts the whole group.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from grpolora.workers.sync.transport import (
    PIECE_BYTES,
    Pending,
    Transport,
    TransportError,
    broadcast_options,
    sum_options,
)

ERROR_ENVIRONMENT: Mapping[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_BLOCKING_WAIT": "1",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
}


# One group construction at a time sets and reads the environment. os.environ is the process's, and a pool's
# server forms one group per attached job, each on its receiver's thread: unserialised, a second formation saved
# the first's values and the first restored the old ones while the second's group was being built (with PyTorch's
# defaults, so its first failed collective would end the server), then the second's restore left the values set
# for every later group. Held only while the constructor runs (it reads them there and does not communicate).
_ENVIRONMENT_LOCK = threading.Lock()


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """`values` in os.environ while a process group reads them at construction; then as they were."""
    with _ENVIRONMENT_LOCK:
        saved = {name: os.environ.get(name) for name in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


class _NcclPending(Pending):
    def __init__(self, work: dist.Work, transport: NcclTransport, what: str, timeout: timedelta | None = None):
        self._work, self._transport, self._what, self._timeout = work, transport, what, timeout

    def wait(self) -> None:
        try:
            if self._timeout is None:
                self._work.wait()
            else:
                self._work.wait(self._timeout)
            torch.cuda.current_stream(self._transport.device).synchronize()
        except RuntimeError as exc:  # DistBackendError: a peer failed, or the collective timed out
            raise TransportError(f"NCCL {self._what} failed: {exc}") from exc
        # A collective whose communicator this rank aborted (close: the round's watchdog, a newer join) returns from
        # wait() normally: WorkNCCL::isCompleted skips its error check once the communicator is aborted, the aborted
        # kernel's end event completes, and no exception was set (ProcessGroupNCCL.cpp). Not a finished collective.
        self._transport.check_open(f"the {self._what}")


class NcclTransport(Transport):
    piece_bytes = PIECE_BYTES

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        timeout_seconds: float,
        join_timeout_seconds: float,
        device: torch.device | None,
        free_cached_memory: bool = False,
    ):
        if not torch.cuda.is_available():
            raise TransportError("the nccl sync backend needs a GPU in this process; use gloo on CPUs")
        self.rank, self.world_size = rank, world_size
        self.store = store
        self.device = device or torch.device("cuda")
        if self.device.type == "cuda" and self.device.index is None:  # named by index: formation runs on another thread
            self.device = torch.device("cuda", torch.cuda.current_device())
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_seconds)
        options.is_high_priority_stream = True  # sync overlaps with generation on inference GPUs
        self._group: dist.ProcessGroupNCCL | None = None
        if free_cached_memory:
            # The communicator's buffers are cudaMalloc'd outside PyTorch's allocator: on trainer rank 0 the blocks
            # its allocator caches unused go back first, as NeMo-RL does before building its refit communicator. Never
            # in a member, whose process is vLLM's: there it is a device-wide synchronisation under the allocator's
            # lock that stalls the engine's every allocation, and it hands vLLM's activation blocks to NCCL (the
            # member host's budget, gpu_headroom.py, checks the memory actually free instead).
            torch.cuda.empty_cache()
        try:
            with _environment(ERROR_ENVIRONMENT):
                self._group = dist.ProcessGroupNCCL(store, rank, world_size, options)
            self._form(self._group, join_timeout_seconds)
        except (RuntimeError, TransportError) as exc:
            self.close()
            raise TransportError(f"NCCL group of {world_size} did not form: {exc}") from exc

    def _form(self, group: dist.ProcessGroupNCCL, join_timeout_seconds: float) -> None:
        """A first tiny collective makes "formed" mean formed, within the join timeout.

        NCCL communicators are created lazily, inside the first collective (initNCCLComm -> ncclCommInitRankConfig),
        which in blocking mode (PyTorch's default) waits until every rank has reached NCCL's bootstrap: a replica that
        accepted the join and then died would hold this thread there for ever, and abort() cannot reach a
        communicator still being created (it enters the group's maps only once ncclCommInitRank returns). So the
        collective runs on a thread of its own, and this one waits at most the join timeout for it; past that the
        group is aborted and the formation's thread, if still inside ncclCommInitRank, is abandoned (a daemon; one
        per formation that a dead peer left, which the sender's back-off makes rare)."""
        stream = torch.cuda.current_stream(self.device)  # the caller's (a member's own stream), not the default one
        outcome: list[BaseException | None] = []
        done = threading.Event()

        def form() -> None:
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)  # device and stream are per thread
                torch.cuda.set_stream(stream)
                work = group.allreduce([torch.zeros(1, device=self.device)], sum_options())
                _NcclPending(work, self, "group formation", timedelta(seconds=join_timeout_seconds)).wait()
                outcome.append(None)
            except BaseException as exc:  # handed to the waiting thread
                outcome.append(exc)
            finally:
                done.set()

        threading.Thread(target=form, name="nccl-formation", daemon=True).start()
        if not done.wait(join_timeout_seconds):
            bound = f"{join_timeout_seconds:g}s (sync.joinTimeoutSeconds)"
            raise TransportError(f"not every rank reached it within {bound}")
        if outcome[0] is not None:
            raise TransportError(str(outcome[0])) from outcome[0]

    def _group_or_fail(self) -> dist.ProcessGroupNCCL:
        if self._group is None:
            raise TransportError("the group is closed")
        return self._group

    def start_broadcast(self, tensor: torch.Tensor, src: int = 0) -> Pending:
        options = broadcast_options(src)
        try:
            return _NcclPending(self._group_or_fail().broadcast([tensor], options), self, "broadcast")
        except RuntimeError as exc:
            raise TransportError(f"NCCL broadcast failed: {exc}") from exc

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        # Bounded by the group's timeout and the round's watchdog (NCCL has no per-collective progress bound here).
        options = sum_options()
        try:
            work = self._group_or_fail().allreduce([tensor], options)
        except RuntimeError as exc:
            raise TransportError(f"NCCL all-reduce failed: {exc}") from exc
        _NcclPending(work, self, "all-reduce").wait()

    @property
    def closed(self) -> bool:
        return self._group is None

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(RuntimeError):
                group.abort()  # frees a communicator that may be stuck on a dead peer
