"""The TRL side of bench/trl_race.py: TRL's GRPOTrainer on the race's prompts, stopped at the wall-clock budget.

Run by bench/trl_race.py with the Python of a virtual environment that has TRL (kept outside the repository; this
script imports TRL, nothing of TRL is committed). It needs this repository importable there for the task's reward
(`pip install --no-deps -e .` into that environment), so that both sides score with the same function.

Writes to --out: metrics.jsonl (named as `grpolora run` names it; per optimizer step: step, reward mean, wall
time since the race started the process) and adapter/ (the LoRA adapter as the budget ran out), the peft folder
`grpolora eval` reads.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from grpolora.workers.tasks.arithmetic import arithmetic_reward


class Budget(TrainerCallback):
    """Records each optimizer step's reward and time as TRL logs it (logging_steps=1: once per step, after the
    step ends); stops training once a step ends past the budget (the rule the driver applies to grpo-lora too: the
    first step that ends at or after it is the last)."""

    def __init__(self, started: float, budget: float, out: Path):
        self.started, self.budget, self.out = started, budget, out
        self.ended: float | None = None

    def on_step_end(self, args, state, control, **kwargs):
        self.ended = time.time() - self.started
        if self.ended >= self.budget:
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs and self.ended is not None:
            record = {"step": state.global_step, "reward_mean": float(logs["reward"]), "elapsed": self.ended}
            with self.out.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True, help="JSONL of {messages, answer}")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=float, required=True, help="seconds since --started")
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
        max_steps=100_000,  # the budget stops it
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
    trainer.train()
    trainer.save_model(str(args.out / "adapter"))


if __name__ == "__main__":
    main()
