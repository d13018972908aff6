"""Where the trainer's step goes, and what each candidate to cut it measures, side by side in one invocation.

    python bench/step_profile.py [--steps 3] [--candidates baseline,kl0,...] [--out bench/results/step_profile.json]

The trainer part of `bench/step_bench.py`'s step, without vLLM: the quickstart job (SmolLM2-135M-Instruct offline,
float32, LoRA r=16 all-linear, klCoef 0.01, micro-batches of 8), 4 real `keyword` prompts through the chat template
x 8 completions of 8-48 tokens (mean about 25, as the bench's rollouts), one `train_step` (this project's code) per
step on the same batch. Every candidate starts from a fresh Policy (same seed, so the same LoRA initialisation):
one warm-up step, then `--steps` timed ones, median. The timed sections wrap the project's functions rather than
copy them: `Policy.logprobs` under no_grad (the reference pass) and with grad (the policy forward, of which
`token_logprobs` — softmax over the vocabulary at the completion positions — is its own line), `Tensor.backward`, the
optimizer's `step`; "other" is the rest of `train_step` (loss, stats, gradient clipping, batch slicing). One extra
step of the baseline under torch.profiler gives the per-operator table.

Exactness: before any update, each candidate's completion-token logprobs are compared with the float32 baseline's
(max |Δ|), against the project's trainer-vs-vLLM parity bound of 1e-3 (tests/workers/test_inference_sync.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: the repo's operator/ must not shadow stdlib

import torch

from grpolora.api.load import load_jobs
from grpolora.api.spec import GRPOLoraJobSpec
from grpolora.workers.models import resolve_model
from grpolora.workers.tasks import load_task
from grpolora.workers.trainer import policy as policy_module
from grpolora.workers.trainer.evaluate import tokenize_prompt
from grpolora.workers.trainer.policy import Batch, Policy, build_batch
from grpolora.workers.trainer.step import make_optimizer, train_step

ROOT = Path(__file__).resolve().parents[1]
PARITY_BOUND = 1e-3  # max |Δlogprob| trainer vs vLLM, tests/workers/test_inference_sync.py
SECTIONS = ("reference", "policy_forward", "token_logprobs", "backward", "optimizer", "other")


def with_grpo(spec: GRPOLoraJobSpec, **update) -> GRPOLoraJobSpec:
    return spec.model_copy(update={"grpo": spec.grpo.model_copy(update=update)})


def with_dtype(spec: GRPOLoraJobSpec, dtype: str) -> GRPOLoraJobSpec:
    return spec.model_copy(update={"model": spec.model.model_copy(update={"dtype": dtype})})


def bf16_autocast() -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16)


# name -> (how the spec changes, the context the step runs in, what it means)
CANDIDATES: dict[str, tuple[Callable[[GRPOLoraJobSpec], GRPOLoraJobSpec], Callable[[], Any], str]] = {}


def _candidate(name: str, change, context, what: str) -> None:
    CANDIDATES[name] = (change, context, what)


_candidate("baseline", lambda s: s, contextlib.nullcontext, "the quickstart job as step_bench runs it")
_candidate("kl0", lambda s: with_grpo(s, kl_coef=0.0), contextlib.nullcontext, "klCoef 0: no reference pass")
_candidate("micro16", lambda s: with_grpo(s, micro_batch_size=16), contextlib.nullcontext, "micro-batches of 16")
_candidate("micro32", lambda s: with_grpo(s, micro_batch_size=32), contextlib.nullcontext, "one micro-batch of 32")
_candidate("bf16-autocast", lambda s: s, bf16_autocast, "float32 weights, bf16 autocast (AMX) around the step")
_candidate("bf16-weights", lambda s: with_dtype(s, "bfloat16"), contextlib.nullcontext, "model.dtype bfloat16")


def rollout_batch(spec: GRPOLoraJobSpec, tokenizer, seed: int = 0) -> Batch:
    """The bench's batch shape: real prompts, completions of random tokens with the rollouts' length spread."""
    task = load_task(spec.task, root=ROOT)
    try:
        prompts = [p for _, p in zip(range(spec.grpo.prompts_per_step), task.prompts(seed), strict=False)]
    finally:
        task.close()
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    sequences, advantages = [], []
    for prompt in prompts:
        ids = tokenize_prompt(tokenizer, prompt, spec.task.system_prompt)
        for _ in range(spec.grpo.generations_per_prompt):
            length = min(spec.grpo.max_new_tokens, max(8, int(rng.gauss(25, 10))))
            completion = [rng.randrange(vocab) for _ in range(length)]
            sequences.append((ids, completion, [-rng.random() * 3 for _ in completion]))
            advantages.append(rng.gauss(0, 1))
    return build_batch(sequences, advantages, tokenizer.pad_token_id)


class Sections:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started


@contextlib.contextmanager
def instrumented(policy: Policy, optimizer: torch.optim.Optimizer, sections: Sections) -> Iterator[None]:
    """Time the project's own functions in place (wrapping, not copying them)."""
    logprobs, head, backward, step = (
        policy.logprobs,
        policy_module.token_logprobs,
        torch.Tensor.backward,
        optimizer.step,
    )

    def timed_logprobs(batch: Batch) -> torch.Tensor:
        with sections.time("policy_forward" if torch.is_grad_enabled() else "reference"):
            return logprobs(batch)

    def timed_head(*args, **kwargs) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return head(*args, **kwargs)
        with sections.time("token_logprobs"):
            return head(*args, **kwargs)

    def timed_backward(self, *args, **kwargs) -> None:
        with sections.time("backward"):
            return backward(self, *args, **kwargs)

    def timed_step(*args, **kwargs):
        with sections.time("optimizer"):
            return step(*args, **kwargs)

    policy.logprobs, policy_module.token_logprobs, torch.Tensor.backward = timed_logprobs, timed_head, timed_backward
    optimizer.step = timed_step
    try:
        yield
    finally:
        policy_module.token_logprobs, torch.Tensor.backward = head, backward
        del policy.logprobs, optimizer.step


def completion_logprobs(policy: Policy, batch: Batch, context) -> torch.Tensor:
    with torch.no_grad(), context():
        return policy.logprobs(batch)[batch.completion_mask.bool()].float()


def run_candidate(name: str, base: GRPOLoraJobSpec, model_dir: Path, batch: Batch, steps: int, reference) -> dict:
    change, context, what = CANDIDATES[name]
    spec = change(base)
    policy = Policy(model_dir, spec, device=torch.device("cpu"))
    optimizer = make_optimizer(policy, spec.grpo)
    logp = completion_logprobs(policy, batch, context)
    delta = float((logp - reference).abs().max()) if reference is not None else 0.0
    runs = []
    for index in range(steps + 1):
        sections = Sections()
        with instrumented(policy, optimizer, sections), context():
            started = time.perf_counter()
            train_step(policy, optimizer, batch, spec.grpo, on_policy=True)
            total = time.perf_counter() - started
        forward = sections.seconds["policy_forward"] - sections.seconds["token_logprobs"]
        known = sum(sections.seconds[s] for s in ("reference", "policy_forward", "backward", "optimizer"))
        runs.append(
            {"train": total, **{s: sections.seconds[s] for s in SECTIONS[:-1]}, "policy_forward": forward}
            | {"other": total - known}
        )
        if index:
            print(f"  {name} step {index}: {json.dumps({k: round(v, 3) for k, v in runs[-1].items()})}", flush=True)
    timed = runs[1:]
    result = {key: statistics.median(r[key] for r in timed) for key in timed[0]}
    return {
        "what": what,
        "median_seconds": result,
        "steps": timed,
        "max_abs_logprob_delta_vs_fp32": delta,
        "within_parity_bound": delta <= PARITY_BOUND,
        "logprobs": logp,
        "policy": policy,
        "optimizer": optimizer,
        "spec": spec,
    }


def operator_table(policy: Policy, optimizer, batch: Batch, spec: GRPOLoraJobSpec, rows: int = 15) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(policy, optimizer, batch, spec.grpo, on_policy=True)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    return {
        "self_cpu_seconds_total": total / 1e6,
        "matmul_share": matmul / total if total else 0.0,
        "top": [
            {
                "op": e.key,
                "self_cpu_seconds": e.self_cpu_time_total / 1e6,
                "calls": e.count,
                "share": e.self_cpu_time_total / total,
            }
            for e in top
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help=f"comma-separated, of {list(CANDIDATES)}")
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler operator table")
    parser.add_argument("--out", default="bench/results/step_profile.json")
    args = parser.parse_args()
    names = [n for n in args.candidates.split(",") if n]
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown or not names or names[0] != "baseline":
        parser.error(f"--candidates: start with baseline, then any of {list(CANDIDATES)}; got {args.candidates!r}")
    (job,) = load_jobs(ROOT / "examples" / "quickstart.yaml")
    model_dir = resolve_model(job.spec.model.name, job.spec.model.revision)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = rollout_batch(job.spec, tokenizer)
    results: dict[str, dict] = {}
    table = None
    load_before = os.getloadavg()
    reference = None  # the float32 baseline's logprobs, before any update
    for name in names:
        results[name] = run_candidate(name, job.spec, model_dir, batch, args.steps, reference)
        if reference is None:
            reference = results[name]["logprobs"]
        print(name, json.dumps({k: round(v, 3) for k, v in results[name]["median_seconds"].items()}), flush=True)
        if name == "baseline" and not args.no_profile:
            r = results[name]
            table = operator_table(r["policy"], r["optimizer"], batch, r["spec"])
        for key in ("logprobs", "policy", "optimizer", "spec"):
            results[name].pop(key)
    out = {
        "batch": {
            "sequences": len(batch),
            "completion_tokens": int(batch.completion_mask.sum()),
            "tokens": int(batch.attention_mask.sum()),
            "padded_length": batch.input_ids.shape[1],
        },
        "threads": torch.get_num_threads(),
        "load_average_before_after": [load_before, os.getloadavg()],
        "parity_bound": PARITY_BOUND,
        "candidates": results,
        "baseline_operators": table,
        "versions": {"torch": torch.__version__},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v for k, v in out.items() if k != "candidates"}, indent=2))


if __name__ == "__main__":
    main()
