"""Issue 37: the KL term at step 0 with `grpo.referenceFrom: inference` in bfloat16, on CPU.

    python bench/reference_kl_bf16.py --dtype bfloat16 --out bench/results/reference_kl_bf16.json

At step 0 the policy is the base model (LoRA B = 0), so the true KL to the reference is 0. With the reference from
the replicas, the reference logprobs are vLLM's (its kernels, its dtype) and the policy's are the trainer's: the
step-0 KL estimate (k3, as the loss takes it) measures how far the two sets of kernels disagree, which the loss
then pulls the policy along. SmolLM2-135M-Instruct on the race's first 8 `sums` prompts, 8 samples each at
temperature 1 (64 new tokens) from the vLLM CPU engine, each sample also scored by the engine with the adapter off
(what the replicas send as reference logprobs), then the trainer's policy logprobs of the same tokens. Prints the
mean k3 KL per token, the mean |difference| and the largest one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from trl_race import MODEL, job, race_prompts, task_spec

from grpolora.api.load import parse_job
from grpolora.workers.models import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--root", type=Path, default=Path("runs/reference-kl"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/reference_kl_bf16.json"))
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    import asyncio

    from transformers import AutoTokenizer

    from grpolora.workers.inference.adapter_book import OwnEngineBook
    from grpolora.workers.inference.vllm_engine import SamplingRequest, config_for, cpu_engine_env
    from grpolora.workers.tasks.base import Prompt
    from grpolora.workers.trainer.evaluate import tokenize_prompt
    from grpolora.workers.trainer.grpo import k3_kl
    from grpolora.workers.trainer.policy import Policy, build_batch

    model_dir = resolve_model(MODEL)
    prompts_file, in_order = race_prompts("sums", 0, args.root)
    doc = job(0, task_spec("sums", 0, args.root, prompts_file), 64, 1)
    doc["spec"]["model"]["dtype"] = args.dtype
    doc["spec"]["grpo"]["referenceFrom"] = "inference"
    spec = parse_job(doc).spec
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in in_order.read_text().splitlines()[: args.prompts]]
    ids = [tokenize_prompt(tokenizer, Prompt(text="", messages=tuple(r["messages"])), None) for r in rows]
    cpu_engine_env(spec)
    engine = OwnEngineBook(config_for(spec, str(model_dir)))
    request = SamplingRequest(8, 1.0, 1.0, 64, seed=0, reference_logprobs=True)

    async def run():
        await engine.start()
        try:
            return await asyncio.gather(*(engine.generate(p, request, 0) for p in ids))
        finally:
            engine.shutdown()

    outputs = asyncio.run(run())
    sequences = [(p, s.token_ids, s.logprobs) for p, samples in zip(ids, outputs, strict=True) for s in samples]
    reference = [s.reference_logprobs for samples in outputs for s in samples]
    batch = build_batch(sequences, [0.0] * len(sequences), tokenizer.pad_token_id, reference)
    policy = Policy(model_dir, spec, device=torch.device("cpu"))
    with torch.no_grad():
        logp = torch.cat([policy.logprobs(batch.select(slice(i, i + 8))) for i in range(0, len(batch), 8)])
    keep = batch.completion_mask.bool()
    kl = k3_kl(logp[keep].double(), batch.reference_logprobs[keep].double())
    diff = (logp[keep] - batch.reference_logprobs[keep]).abs()
    sampler = (logp[keep] - batch.behaviour_logprobs[keep]).abs()
    result = {
        "dtype": args.dtype,
        "tokens": int(keep.sum()),
        "step0_kl_k3_mean": float(kl.mean()),
        "step0_abs_logprob_diff_mean": float(diff.mean()),
        "step0_abs_logprob_diff_max": float(diff.max()),
        "trainer_vs_sampler_abs_diff_mean": float(sampler.mean()),
    }
    args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
