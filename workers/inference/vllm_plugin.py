"""A vLLM general plugin (entry point `vllm.general_plugins`, loaded by vLLM in each of its processes): faster
LoRA matmuls for vLLM's CPU backend, engine processes that do not spin on a CPU's cores while they wait, and, in an
inference server, engine processes that die with the server.

vLLM's CPU LoRA ops (`vllm.lora.ops.torch_ops`) gather a full copy of the adapter weight for every token,
`weights[indices]` (tokens x out x rank), then einsum. In RL almost every token in a batch uses the same adapter
version, and never more than a few, so grouping tokens by adapter and doing one matmul per group computes the same
products without the per-token copies: generation with an adapter on a CPU replica was about 3x faster in one run
on 2 cores (bench/lora_plugin_bench.py, plugin on vs off; BENCHMARKS.md). Nothing changes on GPUs, which use vLLM's
Triton kernels. It also lets a request's prompt logprobs (the server's reference scoring) share a batch with
requests on other adapters, which vLLM 0.32's CPU LoRA path does not (`add_lora_logits` below).

vLLM's shared-memory message queues (scheduler output to the workers, their answers back) keep a reader spinning
on sched_yield for a second after every message before it waits on its socket (`SpinCondition.busy_loop_s`, fixed at
1 s in vLLM 0.32): on a GPU node that is one of many cores, buying microseconds per engine step; on a CPU replica it
is a core that generation, the sync member in the worker and, on a small machine, the trainer need. A sync round of
two CPU replicas on 2 cores took 1.4 s with the spin (BENCHMARKS.md). On CPUs readers therefore spin for 0.1 s
only, then wait on the socket, as vLLM's readers do anyway after their first idle second: the writer wakes them
through it on every message. And they spin by napping 0.1 ms, not by sched_yield: a task that yields stays
runnable, and Linux's scheduler runs it again at once, so each spinning reader still took a whole core for its
0.1 s, from the other replica's activation or from generation (BENCHMARKS.md).

This replaces private functions, so it is guarded: it applies only to the vLLM versions it was written and tested
against (tests/workers/test_vllm_plugin.py compares it with the originals), and only on CPU platforms.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

log = logging.getLogger(__name__)

TESTED_VLLM = ("0.32.",)
# A message-queue reader's busy loop after each message on CPUs (vLLM's: 1 s). Not 0: a reader that waits on its
# socket at once depends on the writer's wake-up message, which vLLM's queue can lose (it re-checks every 5 s for
# that reason, SHM_READER_RECHECK_INTERVAL_MS); with 0, a replica generating without pause had activations stall
# 4.3 s in 3 of 10 rounds. 0.1 s covers the gap between engine steps, so a busy replica never depends on it.
CPU_READER_SPIN_SECONDS = 0.1
# How a reader on a CPU spins: a nap of this long instead of sched_yield, between looks at the queue. A message then
# waits up to ~0.1 ms (plus the timer's slack) for its reader, against engine steps of tens of milliseconds on CPUs,
# and a spinning reader costs a few percent of a core instead of all of it.
CPU_READER_NAP_SECONDS = 1e-4


def nap() -> None:
    """shm_broadcast's `sched_yield` on CPUs (see CPU_READER_NAP_SECONDS)."""
    time.sleep(CPU_READER_NAP_SECONDS)


def _grouped_products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype):
    """out[t] = weights[indices[t]] @ inputs[t], one matmul per distinct index; 0 where indices[t] is -1.

    -1 means "no LoRA" (a request on the base model), as vLLM's GPU kernels read it. vLLM 0.32's CPU ops index
    with it as Python does, i.e. the *last* adapter slot: a base-model request (adapter version 0, the server's
    reference scoring, another job's step 1 on a pool) sharing a batch with adapter requests got the adapter of the
    last slot whenever one was loaded there."""
    if weights.ndim == 4:
        weights = weights.squeeze(dim=1)
    inputs = inputs.to(dtype=dtype)
    groups = torch.unique(indices)
    if groups.numel() == 1 and int(groups[0]) >= 0:
        return inputs @ weights[int(groups[0])].to(dtype=dtype).T
    out = inputs.new_zeros((inputs.shape[0], weights.shape[1]))
    for index in groups.tolist():
        if index >= 0:
            rows = indices == index
            out[rows] = inputs[rows] @ weights[index].to(dtype=dtype).T
    return out


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    outputs = _grouped_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    outputs = _grouped_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common = min(outputs.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(
    inputs,
    lora_b_weights,
    output_tensor,
    lora_indices_tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
):
    outputs = _grouped_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


_vllm_add_lora_logits = None  # PunicaWrapperCPU.add_lora_logits as vLLM ships it, once register() replaced it


def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
    """PunicaWrapperCPU.add_lora_logits that also takes vLLM's prompt-logprobs call. vLLM 0.32 computes a request's
    prompt logprobs by running the logits processor on that request's prompt rows alone, while the CPU wrapper maps
    rows to adapters with one index per request of the batch (`sampler_indices`): once the batch mixes adapters the
    shapes disagree and the engine dies (vllm#29955; vllm#51594 is the GPU side, where the mapping is silently
    misaligned instead). The rows need no LoRA term when no adapter slot holds an lm_head LoRA (the logits layer's
    stacked B is all zero): then nothing is added, which is exact. That is the case the inference server's reference
    scoring relies on (GRPOSpec refuses referenceFrom `inference` with an lm_head target); any other is refused."""
    if x.view(-1, x.shape[-1]).shape[0] == self.sampler_indices.numel():
        return _vllm_add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, buffer=buffer, **kwargs)
    if torch.count_nonzero(lora_b_stacked) == 0:
        return None
    raise RuntimeError(
        "prompt logprobs with an lm_head LoRA loaded: vLLM 0.32's CPU LoRA path maps them to the wrong adapter rows "
        "(vllm#29955); leave lm_head out of lora.targetModules"
    )


def _spin_less(init):
    """SpinCondition.__init__ with a reader's busy loop cut to CPU_READER_SPIN_SECONDS."""

    @functools.wraps(init)
    def __init__(self, is_reader, context, notify_address, busy_loop_s: float = 1, **kwargs):
        init(self, is_reader, context, notify_address, min(busy_loop_s, CPU_READER_SPIN_SECONDS), **kwargs)

    return __init__


def register() -> None:
    """The entry point vLLM calls in every process it starts (idempotent)."""
    import os

    import vllm

    from grpolora.api.contract import ROLE
    from grpolora.workers.lifetime import tie_children_to_this_process

    if os.environ.get(ROLE) == "inference":  # only in our servers, not in any vLLM run that has this installed
        # No OS facility beyond Linux's prctl, so this holds for any vLLM version.
        tie_children_to_this_process()

    if not vllm.__version__.startswith(TESTED_VLLM):
        log.info("grpolora vLLM plugin: vLLM %s untested (%s): CPU LoRA ops unchanged", vllm.__version__, TESTED_VLLM)
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    # The sgmv_* functions call these through lora_ops' globals; punica_cpu imported them by name.
    for module in (lora_ops, punica_cpu):
        module.bgmv_shrink = bgmv_shrink
        module.bgmv_expand = bgmv_expand
        module.bgmv_expand_slice = bgmv_expand_slice
    from vllm.distributed.device_communicators import shm_broadcast

    # Before any engine or worker makes its queues: vLLM loads general plugins first in each of its processes.
    if not hasattr(shm_broadcast.SpinCondition.__init__, "__wrapped__"):
        shm_broadcast.SpinCondition.__init__ = _spin_less(shm_broadcast.SpinCondition.__init__)
    # The queue's busy loops (a reader's spin, a writer waiting for a slot) call it by this module-level name.
    shm_broadcast.sched_yield = nap
    global _vllm_add_lora_logits
    if punica_cpu.PunicaWrapperCPU.add_lora_logits is not add_lora_logits:
        _vllm_add_lora_logits = punica_cpu.PunicaWrapperCPU.add_lora_logits
        punica_cpu.PunicaWrapperCPU.add_lora_logits = add_lora_logits
