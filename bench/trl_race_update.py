"""Issue 37: from the same batch and the same LoRA weights, do grpo-lora and TRL's GRPOTrainer compute the same
gradient? The race's per-step rewards mix the update with sampling noise; this takes the update alone.

    python bench/trl_race_update.py --trl-python /work/trl-venv/bin/python --out bench/results/trl_race_update.json

One fixed batch of the race's shape: 4 `sums` prompts x 8 written completions (right and wrong answers, with and
without the `Answer:` line, so every group has spread), scored by the arithmetic reward. grpo-lora's side
(`--side ours`, this environment) builds its policy as the race does (SmolLM2-135M-Instruct float32, LoRA r16 / alpha
32 on all linear layers, the peft initialisation of its seed), saves those LoRA weights, and runs `train_step` on the
batch with maxGradNorm out of the way, keeping each LoRA tensor's gradient. TRL's side (`--side trl`, run with
--trl-python) builds GRPOTrainer with the race's config, loads the same LoRA weights, and runs its own `_compute_loss`
over the batch in micro-batches of 8 (its inputs built as `_generate_and_score_completions` builds them: left-padded
prompts, completions masked after their EOS, its advantages, the reference logprobs with the adapter off, the
batch's token count), summing the gradients as its gradient accumulation does. The driver compares the two.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MODEL = "offline:smollm2-135m-instruct"
GENERATIONS = 8
# Per prompt: the completions as text, `{s}` the right sum, `{w}` a wrong one. Mixed so that each group has spread.
COMPLETIONS = [
    "The sum is {s}.\nAnswer: {s}",
    "Answer: {s}",
    "{a} + {b} = {s}",
    "Let me add them: {a} plus {b} is {w}.\nAnswer: {w}",
    "Answer: {w}",
    "I think it is {w}",
    "The answer is {s}, since {a} + {b} = {s}.",
    "Hmm, {a} and {b} make {w}.",
]
PROBLEMS = [(7, 5), (12, 9), (3, 8), (16, 4)]


def case(tokenizer) -> dict:
    """The batch as token ids and rewards: prompts rendered as both sides render them (chat template, generation
    prompt), completions ending with the tokenizer's EOS as a sampler's do."""
    from grpolora.workers.tasks.arithmetic import INSTRUCTION, arithmetic_reward
    from grpolora.workers.tasks.base import Prompt
    from grpolora.workers.trainer.evaluate import tokenize_prompt

    prompts, completions, rewards = [], [], []
    for a, b in PROBLEMS:
        prompt = Prompt(text=f"What is {a} + {b}? {INSTRUCTION}", answer=str(a + b))
        prompts.append(tokenize_prompt(tokenizer, prompt, None))
        texts = [t.format(a=a, b=b, s=a + b, w=a + b + 1) for t in COMPLETIONS]
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
        completions.append(ids)
        rewards.append([arithmetic_reward(t, prompt.answer) for t in texts])
    return {"prompts": prompts, "completions": completions, "rewards": rewards}


def lora_grads(model) -> dict:
    """Every trainable (LoRA) tensor's gradient, by its peft name (the same names on both sides)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def ours(model_dir: Path, root: Path) -> dict:
    import torch
    from transformers import AutoTokenizer

    from grpolora.api.load import parse_job
    from grpolora.workers.trainer.grpo import group_advantages
    from grpolora.workers.trainer.policy import Policy, build_batch
    from grpolora.workers.trainer.step import make_optimizer, train_step

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch_case = case(tokenizer)
    (root / "case.json").write_text(json.dumps(batch_case))
    doc = {
        "apiVersion": "grpolora.dev/v1alpha1",
        "kind": "GRPOLoraJob",
        "metadata": {"name": "update"},
        "spec": {
            "model": {"name": MODEL, "dtype": "float32"},
            "lora": {"rank": 16, "alpha": 32, "targetModules": "all-linear"},
            "grpo": {"promptsPerStep": 4, "generationsPerPrompt": 8, "learningRate": 2e-4, "klCoef": 0.01,
                     "maxNewTokens": 64, "microBatchSize": 8, "maxGradNorm": 1e9, "seed": 0},
            "task": {"name": "arithmetic"},
        },
    }  # fmt: skip
    spec = parse_job(doc).spec
    policy = Policy(model_dir, spec, device=torch.device("cpu"))
    torch.save({n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}, root / "init.pt")
    rewards = torch.tensor(batch_case["rewards"])
    advantages = group_advantages(rewards, "group-normalized").flatten().tolist()
    sequences = [
        (p, c, [0.0] * len(c))
        for p, group in zip(batch_case["prompts"], batch_case["completions"], strict=True)
        for c in group
    ]
    batch = build_batch(sequences, advantages, tokenizer.pad_token_id)
    optimizer = make_optimizer(policy, spec.grpo)
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] = 0.0  # the gradient, not the step
    stats = train_step(policy, optimizer, batch, spec.grpo, on_policy=True)
    torch.save(lora_grads(policy.model), root / "grads-ours.pt")
    return {"grad_norm": stats.grad_norm, "tokens": stats.tokens, "loss": stats.loss, "advantages": advantages}


def trl(model_dir: Path, root: Path) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    batch_case = json.loads((root / "case.json").read_text())
    config = GRPOConfig(
        output_dir=str(root / "trl"), per_device_train_batch_size=8, gradient_accumulation_steps=4,
        num_generations=GENERATIONS, max_completion_length=64, temperature=1.0, beta=0.01, learning_rate=2e-4,
        lr_scheduler_type="constant", max_steps=1, report_to=[], seed=0, use_cpu=True, bf16=False,
    )  # fmt: skip
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    dataset = Dataset.from_list([{"prompt": "x"}] * 8)
    trainer = GRPOTrainer(
        model=str(model_dir), reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
        train_dataset=dataset, peft_config=lora,
    )  # fmt: skip
    model = trainer.model
    init = torch.load(root / "init.pt")
    with torch.no_grad():
        named = dict(model.named_parameters())
        for name, value in init.items():
            named[name].copy_(value)
    model.train()
    trainer.current_gradient_accumulation_steps = config.gradient_accumulation_steps
    pad = trainer.processing_class.pad_token_id
    prompts = [p for p in batch_case["prompts"] for _ in range(GENERATIONS)]
    completions = [c for group in batch_case["completions"] for c in group]
    rewards = torch.tensor(batch_case["rewards"], dtype=torch.float32)
    # TRL's advantages (_generate_and_score_completions, scale_rewards "group"): (r - mean) / (sample std + 1e-4).
    grouped = rewards.view(-1, GENERATIONS)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
    plen, clen = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.tensor([[pad] * (plen - len(p)) + p for p in prompts])  # left-padded
    prompt_mask = torch.tensor([[0] * (plen - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [pad] * (clen - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (clen - len(c)) for c in completions])
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad(), model.disable_adapter():
        ref, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention, clen, batch_size=8)
    tokens = completion_mask.sum()
    model.zero_grad(set_to_none=True)
    for start in range(0, len(completions), 8):
        part = slice(start, start + 8)
        inputs = {
            "prompt_ids": prompt_ids[part], "prompt_mask": prompt_mask[part],
            "completion_ids": completion_ids[part], "completion_mask": completion_mask[part],
            "advantages": advantages[part], "ref_per_token_logps": ref[part], "num_items_in_batch": tokens,
        }  # fmt: skip
        trainer._compute_loss(model, inputs).backward()
    grads = lora_grads(model)
    torch.save(grads, root / "grads-trl.pt")
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    return {"grad_norm": float(norm), "tokens": int(tokens), "advantages": advantages.tolist()}


def compare(root: Path) -> dict:
    import torch

    a, b = torch.load(root / "grads-ours.pt"), torch.load(root / "grads-trl.pt")
    names = sorted(a)
    assert names == sorted(b), "the two sides' LoRA tensors differ"
    x = torch.cat([a[n].flatten() for n in names]).double()
    y = torch.cat([b[n].flatten() for n in names]).double()
    return {
        "lora_tensors": len(names),
        "cosine": float(x @ y / (x.norm() * y.norm())),
        "norm_ours": float(x.norm()),
        "norm_trl": float(y.norm()),
        "norm_ratio_trl_over_ours": float(y.norm() / x.norm()),
        "relative_difference_after_scaling": float((y - x * (y.norm() / x.norm())).norm() / y.norm()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=["ours", "trl", "both"], default="both")
    parser.add_argument("--trl-python", help="python of a virtual environment with TRL (for --side both)")
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--root", type=Path, default=Path("runs/trl-race-update"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/trl_race_update.json"))
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    if args.side == "trl":
        print(json.dumps(trl(args.model_dir, args.root)))
        return
    from grpolora.workers.models import resolve_model

    model_dir = resolve_model(MODEL)
    result = {"ours": ours(model_dir, args.root)}
    if args.side == "both":
        command = [args.trl_python, __file__, "--side", "trl", "--model-dir", str(model_dir), "--root", str(args.root)]
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        result["trl"] = json.loads(done.stdout.strip().splitlines()[-1])
        result["compare"] = compare(args.root)
        args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    json.dump(result, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
