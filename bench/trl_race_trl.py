"""The TRL side of bench/trl_race.py: TRL's GRPOTrainer on the race's prompts, stopped at the wall-clock budget.

Run by bench/trl_race.py with the Python of a virtual environment that has TRL (kept outside the repository; this
script imports TRL, nothing of TRL is committed). It needs this repository importable there for the task's reward
(`pip install --no-deps -e .` into that environment), so that both sides score with the same function.

Writes to --out: metrics.jsonl (named as `grpolora run` names it; per optimizer step: step, reward mean, wall
time since the race started the process, the figures that size an update under grpo-lora's names where TRL has
them, and all of TRL's logs under `logs`), config.json (what sizes an update and does not change per step, read
from the live trainer: AdamW's settings, the LoRA scaling and dropout, the normalisers) and adapter/ (the LoRA
adapter at the end), the peft folder `grpolora eval` reads.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers
import trl
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from grpolora.workers.tasks.arithmetic import arithmetic_reward


class Budget(TrainerCallback):
    """Records each optimizer step's reward, time and update figures as TRL logs them (logging_steps=1: once per
    step, after the step ends); stops training once a step ends past the budget, if there is one (the rule the
    driver applies to grpo-lora too: the first step that ends at or after it is the last)."""

    def __init__(self, started: float, budget: float | None, out: Path):
        self.started, self.budget, self.out = started, budget, out
        self.ended: float | None = None
        self.tokens_before = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        self.ended = time.time() - self.started
        if self.budget is not None and self.ended >= self.budget:
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs and self.ended is not None:
            tokens = float(logs.get("num_tokens", 0.0))  # TRL counts prompt and completion tokens, cumulatively
            record = {
                "step": state.global_step,
                "reward_mean": float(logs["reward"]),
                "elapsed": self.ended,
                # HF's grad_norm is the norm before the cut at max_grad_norm. TRL 1.16's GRPOTrainer sets
                # loss_is_scaled_for_ga (its `dapo` loss is already over the whole batch's tokens), so from
                # transformers 5.19 on HF does not divide it by the accumulation steps again: comparable with ours.
                "grad_norm": float(logs["grad_norm"]) if "grad_norm" in logs else None,
                "grad_clipped": float(float(logs.get("grad_norm", 0.0)) > args.max_grad_norm),
                "learning_rate": logs.get("learning_rate"),
                "entropy": logs.get("entropy"),
                "kl": logs.get("kl"),
                # TRL's num_tokens counts prompt and completion tokens; grpo-lora's `tokens` completion tokens only:
                # the same figure here is the mean completion length times the step's completions.
                "prompt_and_completion_tokens": tokens - self.tokens_before,
                "tokens": float(logs["completions/mean_length"]) * args.generation_batch_size
                if "completions/mean_length" in logs
                else None,
                "frac_reward_zero_std": logs.get("frac_reward_zero_std"),
                "completions": {k.split("/", 1)[1]: v for k, v in logs.items() if k.startswith("completions/")},
                "clip_ratio": {k.split("/", 1)[1]: v for k, v in logs.items() if k.startswith("clip_ratio/")},
                "logs": logs,
            }
            self.tokens_before = tokens
            with self.out.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


def update_config(trainer: GRPOTrainer) -> dict:
    """What sizes an update and stays fixed, read from the live trainer rather than from defaults."""
    optimizer = trainer.optimizer
    group = optimizer.param_groups[0]
    lora = next(m for m in trainer.model.modules() if hasattr(m, "scaling") and isinstance(m.scaling, dict))
    dropout = lora.lora_dropout["default"]
    args = trainer.args
    return {
        "optimizer": type(optimizer).__name__,
        "betas": list(group["betas"]),
        "eps": group["eps"],
        "weight_decay": group["weight_decay"],
        "max_grad_norm": args.max_grad_norm,
        "lr_scheduler_type": str(args.lr_scheduler_type),
        "lora_scaling": lora.scaling["default"],
        "lora_dropout": getattr(dropout, "p", 0.0),
        "loss_type": args.loss_type,
        "scale_rewards": args.scale_rewards,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "steps_per_generation": args.steps_per_generation,
        "model_accepts_loss_kwargs": trainer.model_accepts_loss_kwargs,
        # True: HF's Trainer does not divide the loss by the accumulation steps again (transformers >= 5.19).
        "loss_is_scaled_for_ga": trainer.loss_is_scaled_for_ga,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "shuffle_dataset": args.shuffle_dataset,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "temperature": args.temperature,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True, help="JSONL of {messages, answer}")
    parser.add_argument("--out", type=Path, required=True)
    limit = parser.add_mutually_exclusive_group(required=True)
    limit.add_argument("--budget", type=float, help="seconds since --started")
    limit.add_argument("--max-steps", type=int, help="optimizer steps (instead of a budget)")
    parser.add_argument("--started", type=float, required=True, help="time.time() when the race launched this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--kl-coef", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rows = [json.loads(line) for line in args.prompts.read_text(encoding="utf-8").splitlines()]
    dataset = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])

    def reward(prompts, completions, answer, **_):
        return [arithmetic_reward(c[0]["content"], a) for c, a in zip(completions, answer, strict=True)]

    completions = args.prompts_per_step * args.generations
    config = GRPOConfig(
        output_dir=str(args.out / "trl"),
        # One optimizer step per prompts-per-step x generations completions, in micro-batches of 8 (as grpo-lora's
        # microBatchSize 8): the same batch and update count as the other side.
        per_device_train_batch_size=8,
        gradient_accumulation_steps=completions // 8,
        num_generations=args.generations,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        beta=args.kl_coef,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",  # grpo-lora's default (TRL's is linear decay to 0 over max_steps)
        warmup_steps=0,
        max_steps=args.max_steps or 100_000,  # else the budget stops it
        shuffle_dataset=False,  # the driver gives the rows in the order grpo-lora reads them
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
    )
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    args.out.mkdir(parents=True, exist_ok=True)
    steps = args.out / "metrics.jsonl"
    steps.unlink(missing_ok=True)
    trainer = GRPOTrainer(
        model=str(args.model_dir),
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        peft_config=lora,
        callbacks=[Budget(args.started, args.budget, steps)],
    )
    trainer.create_optimizer()  # train() would make it; made here so that its settings are recorded first
    (args.out / "config.json").write_text(json.dumps(update_config(trainer), indent=1), encoding="utf-8")
    trainer.train()
    trainer.save_model(str(args.out / "adapter"))


if __name__ == "__main__":
    main()
