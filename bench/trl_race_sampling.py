"""Issue 37: do grpo-lora's sampler (vLLM) and TRL's (transformers' `generate`, as GRPOTrainer configures it on CPUs)
draw the same completions from the same model? The race's step reward is the mean over what each side sampled, so a
sampler that answers right more often would read as more learning per step.

    python bench/trl_race_sampling.py --prompts 32 --out bench/results/trl_race_sampling.json
    python bench/trl_race_sampling.py --samplers generate --generate-batch 8 \
        --out bench/results/trl_race_sampling_unpadded.json      # generate without left padding

The base model (SmolLM2-135M-Instruct float32: the policy of both sides at step 1, LoRA B = 0) on the race's first
`--prompts` `sums` training prompts (seed 0, in grpo-lora's order), 8 completions each at temperature 1, top-p 1,
no top-k, 64 new tokens: once with the vLLM CPU engine grpo-lora's replicas run (its own EngineConfig, a seed per
prompt as the trainer sends), once with
`generate` and the GenerationConfig TRL 1.16's GRPOTrainer builds (do_sample, temperature 1, top_p 1, top_k 0,
repetition_penalty 1, the EOS ids, left-padded batches of 32). Both scored by the arithmetic reward. Prints and
writes per sampler: mean reward with its standard error over prompts, the share with the right number, mean length,
and the share cut at 64 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trl_race import MODEL, job, race_prompts, task_spec

from grpolora.api.load import parse_job
from grpolora.workers.models import resolve_model
from grpolora.workers.tasks.arithmetic import arithmetic_reward
from grpolora.workers.trainer.rollout import prompt_seed

GENERATIONS, MAX_NEW_TOKENS, SEED = 8, 64, 0


def summary(rows: list[dict]) -> dict:
    """rows: {prompt, answer, completions: [{text, tokens, cut}]}; standard error over prompts (a prompt's 8
    samples are not independent of each other)."""
    per_prompt = [statistics.fmean(arithmetic_reward(c["text"], r["answer"]) for c in r["completions"]) for r in rows]
    samples = [c for r in rows for c in r["completions"]]
    right = [arithmetic_reward(c["text"], r["answer"]) >= 1 for r in rows for c in r["completions"]]
    return {
        "reward_mean": statistics.fmean(per_prompt),
        "reward_standard_error": statistics.stdev(per_prompt) / len(per_prompt) ** 0.5,
        "right_share": sum(right) / len(right),
        "length_mean": statistics.fmean(c["tokens"] for c in samples),
        "cut_share": sum(c["cut"] for c in samples) / len(samples),
        "samples": len(samples),
    }


def with_vllm(spec, model_dir: Path, prompts: list[list[int]]) -> list[list[dict]]:
    from grpolora.workers.inference.adapter_book import OwnEngineBook
    from grpolora.workers.inference.vllm_engine import SamplingRequest, config_for, cpu_engine_env

    cpu_engine_env(spec)
    engine = OwnEngineBook(config_for(spec, str(model_dir)))
    # One seed per prompt, as the trainer asks (rollout.prompt_seed). One seed for all (this bench until 2026-12-04)
    # makes every prompt's j-th sample draw the same random numbers: 8 streams, not 256 samples, whose mean length
    # came out 24.0 tokens against 29.8 with a seed each.
    requests = [
        SamplingRequest(GENERATIONS, 1.0, 1.0, MAX_NEW_TOKENS, seed=prompt_seed(SEED, i)) for i in range(len(prompts))
    ]

    async def run() -> list[list[dict]]:
        await engine.start()
        try:
            outputs = await asyncio.gather(*(engine.generate(p, r, 0) for p, r in zip(prompts, requests, strict=True)))
        finally:
            engine.shutdown()
        return [
            [{"text": s.text, "tokens": len(s.token_ids), "cut": s.finish_reason == "length"} for s in samples]
            for samples in outputs
        ]

    return asyncio.run(run())


def with_generate(model_dir: Path, prompts: list[list[int]], batch: int = 32) -> list[list[dict]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = [tokenizer.eos_token_id, *([model.generation_config.eos_token_id] if model.generation_config.eos_token_id
                                    not in (None, tokenizer.eos_token_id) else [])]  # fmt: skip
    config = GenerationConfig(
        max_new_tokens=MAX_NEW_TOKENS, do_sample=True, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
        repetition_penalty=1.0,
    )  # fmt: skip
    repeated = [p for p in prompts for _ in range(GENERATIONS)]
    out: list[dict] = []
    for start in range(0, len(repeated), batch):
        part = repeated[start : start + batch]
        width = max(map(len, part))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in part])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in part])
        with torch.no_grad():
            generated = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:]
        for row in generated.tolist():
            ended = next((i for i, t in enumerate(row) if t in eos), None)
            tokens = row if ended is None else row[: ended + 1]
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            out.append({"text": text, "tokens": len(tokens), "cut": ended is None})
    return [out[i : i + GENERATIONS] for i in range(0, len(out), GENERATIONS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument(
        "--generate-batch", type=int, default=32,
        help="prompts per generate call: 32 left-pads as TRL's batches do; 8 (GENERATIONS) holds one prompt's samples, "
        "no padding",
    )  # fmt: skip
    parser.add_argument("--samplers", nargs="+", default=["vllm", "generate"], choices=["vllm", "generate"])
    parser.add_argument("--root", type=Path, default=Path("runs/trl-race-sampling"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/trl_race_sampling.json"))
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(MODEL)
    prompts_file, in_order = race_prompts("sums", SEED, args.root)
    spec = parse_job(job(SEED, task_spec("sums", SEED, args.root, prompts_file), MAX_NEW_TOKENS, 1)).spec
    from transformers import AutoTokenizer

    from grpolora.workers.tasks.base import Prompt
    from grpolora.workers.trainer.evaluate import tokenize_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in in_order.read_text().splitlines()[: args.prompts]]
    ids = [tokenize_prompt(tokenizer, Prompt(text="", messages=tuple(r["messages"])), None) for r in rows]
    result: dict = {"prompts": args.prompts, "generations": GENERATIONS, "max_new_tokens": MAX_NEW_TOKENS}
    samplers = {
        "vllm": lambda: with_vllm(spec, model_dir, ids),
        "generate": lambda: with_generate(model_dir, ids, args.generate_batch),
    }
    result["generate_batch"] = args.generate_batch
    for name in args.samplers:
        sample = samplers[name]
        drawn = sample()
        result[name] = summary([{"answer": r["answer"], "completions": c} for r, c in zip(rows, drawn, strict=True)])
        result[name + "_examples"] = [c["text"] for c in drawn[0][:4]]
        print(name, json.dumps(result[name]), flush=True)
    args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
