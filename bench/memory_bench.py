"""Trainer memory per token with and without activation checkpointing (trainer.gradientCheckpointing), side by
side in one invocation, on CPU at a small config.

    python bench/memory_bench.py [--lengths 512 2048] [--out bench/results/memory.json]

SmolLM2-135M-Instruct (offline), float32, LoRA r=16 on all linear layers, one sequence of a 64-token prompt and an
L-token completion, one training step (logprobs, reference pass, loss, backward, optimizer). Each configuration
runs in a fresh process; its figure is the process's peak resident memory during the step (VmHWM) minus its
resident memory just before it (model, adapter and optimizer loaded): what the step itself needs, mostly
activations. For the 8B config on a GPU, bench/gpu_scale.py measures the same with torch.cuda's peak.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: the repo's operator/ must not shadow stdlib

PROMPT_TOKENS = 64


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def one(length: int, checkpointing: bool) -> dict:
    """In this process: one training step on one sequence of `length` completion tokens."""
    import torch

    from grpolora.api.load import parse_job
    from grpolora.testing.jobs import job_doc
    from grpolora.workers.models import resolve_model
    from grpolora.workers.trainer.policy import Policy, build_batch
    from grpolora.workers.trainer.step import make_optimizer, train_step

    torch.set_num_threads(2)
    spec = parse_job(
        job_doc(
            model={"name": "offline:smollm2-135m-instruct", "dtype": "float32"},
            lora={"rank": 16, "alpha": 32},
            grpo={"microBatchSize": 1, "maxNewTokens": length},
            trainer={"gpusPerReplica": 0, "gradientCheckpointing": checkpointing},
            inference={"gpusPerReplica": 0, "maxModelLen": length + PROMPT_TOKENS},
        )
    ).spec
    policy = Policy(resolve_model(spec.model.name), spec, device=torch.device("cpu"))
    optimizer = make_optimizer(policy, spec.grpo)
    g = torch.Generator().manual_seed(0)
    vocabulary = policy.model.config.vocab_size
    prompt = torch.randint(0, vocabulary, (PROMPT_TOKENS,), generator=g).tolist()
    completion = torch.randint(0, vocabulary, (length,), generator=g).tolist()
    batch = build_batch([(prompt, completion, [-1.0] * length)], [1.0], policy.tokenizer.pad_token_id)
    before = _status("VmRSS")
    started = time.perf_counter()
    train_step(policy, optimizer, batch, spec.grpo, on_policy=True)
    seconds = time.perf_counter() - started
    peak = _status("VmHWM") - before
    return {"length": length, "checkpointing": checkpointing, "step_mib": peak / 2**20, "seconds": seconds,
            "mib_per_1k_tokens": peak / 2**20 / ((length + PROMPT_TOKENS) / 1000)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--out", default="bench/results/memory.json")
    parser.add_argument("--one", nargs=2, metavar=("LENGTH", "CHECKPOINTING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1] == "on")))
        return 0
    rows = []
    for length in args.lengths:
        for checkpointing in (False, True):
            done = subprocess.run(
                [sys.executable, "-P", __file__, "--one", str(length), "on" if checkpointing else "off"],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            mode = "on " if checkpointing else "off"
            print(f"{r['length']:>6} tokens  checkpointing {mode}  step {r['step_mib']:8.1f} MiB  "
                  f"{r['mib_per_1k_tokens']:7.1f} MiB per 1k tokens  {r['seconds']:6.1f} s")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
