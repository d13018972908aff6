"""Generation with an adapter on a vLLM CPU replica, with and without grpolora's CPU LoRA plugin.

    python bench/lora_plugin_bench.py [--rounds 3] [--out bench/results/lora_plugin.json]

The engine is the inference server's own (`OwnEngineBook` with `engine_config` from the quickstart job through
the env contract: SmolLM2-135M-Instruct float32, LoRA r=16 on all linear layers, two LoRA slots, eager mode) with
the server's CPU environment. One child process per setting, the same in both but for `VLLM_PLUGINS`: unset loads
every `vllm.general_plugins` entry point, ours included; "" loads none, so vLLM's own CPU LoRA ops run. Each child
loads a random adapter as version 1 and times `--rounds` batches of the quickstart's shape (4 prompts x 8 samples
of up to 48 tokens, fixed seeds, so both settings generate the same tokens up to rounding), after one warm-up
batch; and the same on the base model (version 0) as a control, before the adapter is loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Write one sentence about the sea.",
    "Name a fruit and describe its colour.",
    "Say something kind about mornings.",
    "Describe a quiet street in two sentences.",
]


def child(rounds: int) -> dict:
    import torch

    from grpolora.api.contract import WorkerEnv
    from grpolora.api.load import load_jobs
    from grpolora.api.plan import LoopbackNetwork, plan
    from grpolora.workers.adapter import lora_config, lora_tensors
    from grpolora.workers.inference.adapter_book import OwnEngineBook
    from grpolora.workers.inference.server import engine_config
    from grpolora.workers.inference.vllm_engine import SamplingRequest
    from grpolora.workers.models import resolve_model

    (job,) = load_jobs(ROOT / "examples" / "quickstart.yaml")
    env = WorkerEnv.from_environ(plan(job, LoopbackNetwork()).env_for("inference", 0, token="bench"))
    model_dir = resolve_model(env.model)
    spec = env.spec
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.inference.kv_cache_gib))  # as serve() sets them
    os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        LoraConfig(r=spec.lora.rank, lora_alpha=spec.lora.alpha, target_modules=spec.lora.target_modules),
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter: B is zero at initialisation
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.01)
    tensors, config = lora_tensors(peft_model), lora_config(peft_model)
    ids = [  # as the trainer tokenizes prompts (Controller._tokenize)
        tokenizer(
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
        for p in PROMPTS
    ]
    grpo = spec.grpo
    sampling = [
        SamplingRequest(
            n=grpo.generations_per_prompt,
            temperature=grpo.temperature,
            top_p=grpo.top_p,
            max_tokens=grpo.max_new_tokens,
            seed=1000 + k,
        )
        for k in range(len(ids))
    ]

    async def run() -> dict:
        engine = OwnEngineBook(engine_config(env, str(model_dir)))
        await engine.start()
        try:
            result = {}
            for version in (0, 1):  # the base model first: once version 1 is live, version 0 is no longer served
                if version:
                    await asyncio.to_thread(engine.activate, version, tensors, config)
                times, tokens = [], []
                for round_index in range(rounds + 1):
                    started = time.perf_counter()
                    async with engine.lease(version, 10) as leased:
                        outputs = await asyncio.gather(
                            *(engine.generate(p, s, leased) for p, s in zip(ids, sampling, strict=True))
                        )
                    if round_index:  # round 0 warms up
                        times.append(time.perf_counter() - started)
                        tokens.append(sum(len(s.token_ids) for samples in outputs for s in samples))
                result["adapter" if version else "base"] = {"seconds": times, "tokens": tokens}
            return result
        finally:
            engine.shutdown()

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench/results/lora_plugin.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.rounds)), flush=True)
        return
    results = {}
    for setting, plugins in (("plugin", None), ("vllm_ops", "")):
        env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
        if plugins is not None:
            env["VLLM_PLUGINS"] = plugins
        done = subprocess.run(
            [sys.executable, "-P", __file__, "--child", "--rounds", str(args.rounds)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            sys.exit(f"{setting} run failed:\n{done.stderr[-4000:]}")
        results[setting] = json.loads(lines[-1].removeprefix("RESULT "))
        print(setting, json.dumps(results[setting]), flush=True)
    summary = {}
    for kind in ("adapter", "base"):
        for setting in results:
            runs = results[setting][kind]
            summary[f"{kind}_{setting}_s"] = statistics.median(runs["seconds"])
            summary[f"{kind}_{setting}_tokens"] = statistics.median(runs["tokens"])
        summary[f"{kind}_speedup"] = summary[f"{kind}_vllm_ops_s"] / summary[f"{kind}_plugin_s"]
    print(json.dumps(summary, indent=2))
    Path(args.out).write_text(json.dumps({"summary": summary, "runs": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
