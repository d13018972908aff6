"""The grouped CPU LoRA ops compute what vLLM's own CPU ops compute, for the vLLM version they patch."""

from __future__ import annotations

import contextlib
import importlib
import time

import pytest
import torch

from grpolora.workers.inference import vllm_plugin

lora_ops = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")


@pytest.fixture
def original():
    """vLLM's functions as shipped (a fresh import: register() may have replaced them in this process)."""
    return importlib.reload(lora_ops)


def cases():
    g = torch.Generator().manual_seed(0)
    slots, rank, width, out = 3, 8, 32, 48
    for indices in ([0] * 5, [1, 0, 1, 2, 2, 0], [-1, 0, -1, 1], [2], [-1, -1]):
        tokens = len(indices)
        yield {
            "x_in": torch.randn(tokens, width, generator=g),
            "x_rank": torch.randn(tokens, rank, generator=g),
            "a": torch.randn(slots, 1, rank, width, generator=g),
            "b": torch.randn(slots, 1, out, rank, generator=g),
            "indices": torch.tensor(indices),
            "out_dim": out,
        }


def with_empty_last_slot(case: dict) -> dict:
    """`case` with an all-zero adapter slot appended: vLLM's CPU ops index -1 as Python does (the last slot), so
    this makes their -1 mean "no LoRA", as vLLM's GPU kernels and the grouped ops read it."""
    return {**case, **{k: torch.cat([case[k], torch.zeros_like(case[k][:1])]) for k in ("a", "b")}}


@pytest.mark.parametrize("case", list(cases()), ids=lambda c: str(c["indices"].tolist()))
def test_grouped_ops_match_vllms(original, case):
    """-1 ("no LoRA") rows get no LoRA term: vLLM's CPU ops gave them the last slot's adapter."""
    tokens = case["indices"].numel()
    rank = case["a"].shape[2]
    empty = with_empty_last_slot(case)
    for dtype in (torch.float32, torch.bfloat16):
        ours, theirs = torch.zeros(tokens, rank, dtype=dtype), torch.zeros(tokens, rank, dtype=dtype)
        vllm_plugin.bgmv_shrink(case["x_in"], case["a"], ours, case["indices"], 0.5)
        original.bgmv_shrink(case["x_in"], empty["a"], theirs, case["indices"], 0.5)
        torch.testing.assert_close(ours, theirs)
        for add in (False, True):
            base = torch.randn(tokens, case["out_dim"] + 4).to(dtype)
            ours, theirs = base.clone(), base.clone()
            vllm_plugin.bgmv_expand(case["x_rank"], case["b"], ours, case["indices"], add)
            original.bgmv_expand(case["x_rank"], empty["b"], theirs, case["indices"], add)
            torch.testing.assert_close(ours, theirs)
            ours, theirs = base.clone(), base.clone()
            vllm_plugin.bgmv_expand_slice(case["x_rank"], case["b"], ours, case["indices"], 2, case["out_dim"], add)
            original.bgmv_expand_slice(case["x_rank"], empty["b"], theirs, case["indices"], 2, case["out_dim"], add)
            torch.testing.assert_close(ours, theirs)


def test_register_patches_only_the_tested_vllm_on_cpu(monkeypatch, original):
    import vllm
    from vllm.lora.punica_wrapper import punica_cpu

    punica_cpu = importlib.reload(punica_cpu)  # vLLM's own functions again
    monkeypatch.setattr(vllm, "__version__", "9.9.9")
    vllm_plugin.register()
    assert punica_cpu.bgmv_shrink is not vllm_plugin.bgmv_shrink
    assert punica_cpu.bgmv_shrink.__module__ == "vllm.lora.ops.torch_ops.lora_ops"
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    vllm_plugin.register()
    assert punica_cpu.bgmv_shrink is vllm_plugin.bgmv_shrink
    assert lora_ops.bgmv_expand is vllm_plugin.bgmv_expand


class _Wrapper:
    """What add_lora_logits reads of vLLM's PunicaWrapperCPU: the adapter index of each request in the batch."""

    def __init__(self, indices: list[int]):
        self.sampler_indices = torch.tensor(indices)


def test_prompt_logprob_rows_need_no_lora_term_without_an_lm_head_lora(original):
    """vLLM 0.32 runs the LoRA logits processor on one request's prompt rows (prompt logprobs) with the batch's
    per-request adapter indices: 7 rows against 3 requests on two adapters killed the engine. Without an lm_head
    LoRA in any slot (all zero, as with every all-linear adapter) nothing is added, which is exact; with one it is
    refused, naming the cause."""
    from vllm.lora.punica_wrapper import punica_cpu

    punica_cpu = importlib.reload(punica_cpu)  # vLLM's own functions again
    g = torch.Generator().manual_seed(0)
    slots, rank, width, vocab = 3, 8, 32, 64
    a = torch.randn(slots, 1, rank, width, generator=g)
    zero_b = torch.zeros(slots, 1, vocab, rank)
    x = torch.randn(7, width, generator=g)
    logits = torch.randn(7, vocab, generator=g)
    mixed = _Wrapper([0, -1, 1])
    with pytest.raises(RuntimeError):  # what vLLM does with these rows, even with no lm_head LoRA at all
        punica_cpu.PunicaWrapperCPU.add_lora_logits(mixed, logits.clone(), x, a, zero_b, 1.0)
    vllm_plugin.register()
    out = logits.clone()
    vllm_plugin.add_lora_logits(mixed, out, x, a, zero_b, 1.0)
    assert torch.equal(out, logits)
    with pytest.raises(RuntimeError, match="lm_head LoRA"):
        vllm_plugin.add_lora_logits(mixed, logits.clone(), x, a, torch.randn(slots, 1, vocab, rank, generator=g), 1.0)
    # One row per request (sampling): vLLM's own computation, with the grouped ops.
    b = torch.randn(slots, 1, vocab, rank, generator=g)
    ours, theirs = logits[:3].clone(), logits[:3].clone()
    vllm_plugin.add_lora_logits(mixed, ours, x[:3], a, b, 1.0)
    for index, row in ((0, 0), (1, 2)):  # row 1 is on the base model (-1): no LoRA term
        theirs[row] += (x[row] @ a[index, 0].T) @ b[index, 0].T
    torch.testing.assert_close(ours, theirs)
    assert punica_cpu.PunicaWrapperCPU.add_lora_logits is vllm_plugin.add_lora_logits


def test_register_cuts_the_busy_loop_of_message_queue_readers_on_cpu(monkeypatch):
    """vLLM's shared-memory message queues (scheduler output to the workers, their answers back to the engine core)
    keep a reader spinning on sched_yield for `busy_loop_s` (1 s, not configurable in vLLM 0.32:
    vllm/distributed/device_communicators/shm_broadcast.py, SpinCondition) after every message before it waits on
    its socket. On a CPU replica each spinning reader holds a core that generation, the sync member's receive and
    the trainer need: a sync round of two idle replicas took 1.4 s on 2 cores (BENCHMARKS.md). On CPUs readers spin
    0.1 s, then wait on that socket as vLLM's own readers do after their first idle second; writers and other
    platforms are unchanged."""
    import vllm
    from vllm.distributed.device_communicators import shm_broadcast

    def made(is_reader: bool) -> float:
        with spin_condition(shm_broadcast, is_reader) as spin:
            return spin.busy_loop_s

    shm_broadcast = importlib.reload(shm_broadcast)  # vLLM's own class again
    monkeypatch.setattr(vllm, "__version__", "9.9.9")
    vllm_plugin.register()
    assert made(is_reader=True) == 1
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    vllm_plugin.register()
    vllm_plugin.register()  # idempotent: wrapped once
    assert made(is_reader=True) == vllm_plugin.CPU_READER_SPIN_SECONDS == 0.1
    assert made(is_reader=False) == 0  # a writer never spins (vLLM's own 0)
    assert shm_broadcast.SpinCondition.__init__.__wrapped__.__module__ == shm_broadcast.__name__


def test_a_spinning_reader_on_cpu_naps_instead_of_holding_a_core(monkeypatch):
    """In its busy window a reader loops on `sched_yield` (vllm/distributed/device_communicators/shm_broadcast.py,
    SpinCondition.wait). A task that yields stays runnable and Linux runs it again at once, so the loop took a
    whole core for the window: after each activation of one replica its worker and engine core spun on both of
    2 cores while the other replica activated (BENCHMARKS.md). On CPUs the loop naps 0.1 ms instead: a reader kept
    in its busy window for 0.3 s uses a small share of a core (about all of it before)."""
    import vllm
    from vllm.distributed.device_communicators import shm_broadcast

    shm_broadcast = importlib.reload(shm_broadcast)  # vLLM's own functions again
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    vllm_plugin.register()
    assert shm_broadcast.sched_yield is vllm_plugin.nap
    with spin_condition(shm_broadcast, is_reader=True) as reader:
        started, cpu = time.monotonic(), time.thread_time()
        while time.monotonic() - started < 0.3:
            reader.record_read()  # as a reader does after each message: the next wait stays in the busy loop
            reader.wait(timeout_ms=1000)
        share = (time.thread_time() - cpu) / (time.monotonic() - started)
    assert share < 0.3, f"a spinning reader used {share:.0%} of a core"


@contextlib.contextmanager
def spin_condition(shm_broadcast, is_reader: bool):
    """vLLM's SpinCondition on a zmq context of its own, as vLLM pairs them: a writer binds the notification address
    and readers connect to it. A reader alone left an inproc connection pending on an address nobody bound, and
    terminating its context then aborted the process in libzmq now and then (ctx.cpp, 1 run in 8 under load)."""
    import zmq

    context = zmq.Context()
    address = "inproc://grpolora-spin-test"
    try:
        writer = shm_broadcast.SpinCondition(False, context, address)
        yield shm_broadcast.SpinCondition(True, context, address) if is_reader else writer
    finally:
        context.destroy(linger=0)
