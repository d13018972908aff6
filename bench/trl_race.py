"""A learning race against TRL's GRPOTrainer (issue 25): same model, LoRA, task, batch and wall-clock budget.

    python bench/trl_race.py --trl-python /path/to/trl-venv/bin/python --budget 420 --seeds 0 1
    python bench/trl_race.py --trl-python /path/to/trl-venv/bin/python --task sums --budget 600 --seeds 0 1

Tasks: `arithmetic` (the built-in task: two-digit sums and differences, products up to 12 x 99), or `sums`, a
GSM8K-shaped file made on disk (rows {messages, answer}, a training file and 64 held-out rows) of one- and two-digit
sums that the 135M model already answers now and then, so that a budget of minutes shows learning; both are scored
by the `arithmetic` reward (1 for the right number, +0.1 for an `Answer:` line).

For each seed, one after the other on the same cores: `grpolora run` of an `arithmetic` job (SmolLM2-135M-Instruct
float32, LoRA r16/alpha 32 on all linear layers, 4 prompts x 8 completions per step, 64 new tokens, lr 2e-4, KL
0.01, temperature 1), then TRL's GRPOTrainer with the same settings (bench/trl_race_trl.py, run with --trl-python).
Each side's clock starts when its process is launched (loading the model and, for grpo-lora, starting vLLM count),
and each stops after the first optimizer step that ends at or after the budget. Then `grpolora eval` scores both
final adapters, and the base model, on the task's held-out prompts (greedy, one completion each), with one evaluator.

Prints and writes (--out, JSON) per side and seed: steps done, training reward per step with its time, the time at
which the training reward (mean of 3 steps) first reaches a threshold, and the held-out reward. The threshold is
TRL's final training reward (mean of its last 3 steps), per seed: "reaches TRL's final reward in at most half TRL's
time" is then ours_time <= 0.5 x trl_time.

The TRL environment needs TRL and this repository without its dependencies (`pip install --no-deps -e .`): both
sides score with grpolora's own arithmetic reward.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from itertools import islice
from pathlib import Path

import yaml

from grpolora.workers.launcher.results import read_metrics
from grpolora.workers.models import resolve_model
from grpolora.workers.tasks import chat_messages
from grpolora.workers.tasks.arithmetic import INSTRUCTION, ArithmeticTask

MODEL = "offline:smollm2-135m-instruct"
SMOOTH = 3  # steps in the moving mean that decides when a side reached the threshold
PROMPTS_PER_STEP, GENERATIONS, MAX_NEW_TOKENS, LEARNING_RATE, KL = 4, 8, 64, 2e-4, 0.01


def sums_rows(seed: int, count: int) -> list[dict]:
    """`sums`: a + b with a from 1 to 19 and b from 1 to 9, asked as the arithmetic task asks."""
    rng = random.Random(f"sums:{seed}")
    rows = []
    for _ in range(count):
        a, b = rng.randint(1, 19), rng.randint(1, 9)
        rows.append({"messages": chat_messages(f"What is {a} + {b}? {INSTRUCTION}"), "answer": str(a + b)})
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def race_prompts(task: str, seed: int, root: Path) -> Path:
    """The training prompts both sides draw, as {messages, answer} rows (grpo-lora reads the file for `sums`; for
    `arithmetic` it draws the same stream from its built-in task). 500 steps' worth: more than a budget uses."""
    count = 500 * PROMPTS_PER_STEP
    if task == "sums":
        return write_rows(root / f"sums-train-{seed}.jsonl", sums_rows(seed, count))
    drawn = islice(ArithmeticTask().prompts(seed), count)
    rows = [{"messages": chat_messages(p), "answer": p.answer} for p in drawn]
    return write_rows(root / f"prompts-{seed}.jsonl", rows)


def task_spec(task: str, seed: int, root: Path, prompts: Path) -> dict:
    """grpo-lora's spec.task: the built-in `arithmetic`, or the `sums` files (`prompts`, and 64 held-out rows)."""
    if task == "arithmetic":
        return {"name": "arithmetic"}
    held_out = write_rows(root / f"sums-eval-{seed}.jsonl", sums_rows(10_000 + seed, 64))
    return {
        "dataset": {
            "path": str(prompts.resolve()),
            "messagesField": "messages",
            "eval": {"path": str(held_out.resolve())},
        },
        "reward": [{"name": "arithmetic"}],
    }


def job(seed: int, task: dict, max_new_tokens: int) -> dict:
    return {
        "apiVersion": "grpolora.dev/v1alpha1",
        "kind": "GRPOLoraJob",
        "metadata": {"name": f"race-{seed}"},
        "spec": {
            "model": {"name": MODEL, "dtype": "float32"},
            "lora": {"rank": 16, "alpha": 32, "targetModules": "all-linear"},
            "grpo": {
                "steps": 10_000,  # the budget stops it
                "promptsPerStep": PROMPTS_PER_STEP,
                "generationsPerPrompt": GENERATIONS,
                "learningRate": LEARNING_RATE,
                "klCoef": KL,
                "maxNewTokens": max_new_tokens,
                "temperature": 1.0,
                "microBatchSize": 8,
                "seed": seed,
            },
            "task": task,
            "trainer": {"replicas": 1, "gpusPerReplica": 0},
            "inference": {"replicas": 1, "gpusPerReplica": 0, "kvCacheGiB": 1, "maxModelLen": 512},
            "sync": {"backend": "gloo"},
            "checkpoint": {"everySteps": 1, "keep": 1},  # the adapter as the budget runs out
        },
    }


def run_ours(seed: int, budget: float, root: Path, document: dict) -> tuple[list[dict], Path]:
    """`grpolora run` until a step ends past the budget, then Ctrl-C (it stops after its checkpoint)."""
    folder = root / f"grpolora-{seed}"
    job_file = root / f"race-{seed}.yaml"
    job_file.write_text(yaml.safe_dump(document), encoding="utf-8")
    started = time.time()
    process = subprocess.Popen(
        [sys.executable, "-m", "grpolora.cli", "run", str(job_file), "--run-dir", str(folder)],
        stdout=subprocess.DEVNULL,
        stderr=(root / f"grpolora-{seed}.log").open("w"),
    )
    while process.poll() is None:
        seen = read_metrics(folder)
        if seen and seen[-1]["time"] - started >= budget:
            # The checkpoint of that step is written before the next step's record; wait for it, then stop.
            wanted = folder / "checkpoints" / f"step-{seen[-1]['step']:08d}"
            while not (wanted / "trainer_state.pt").exists() and process.poll() is None:
                time.sleep(0.2)
            process.send_signal(signal.SIGINT)
            break
        time.sleep(0.5)
    process.wait(timeout=120)
    records = read_metrics(folder)
    steps = [{"step": r["step"], "reward_mean": r["reward_mean"], "elapsed": r["time"] - started} for r in records]
    last = max((folder / "checkpoints").glob("step-*"))
    return steps, last / "adapter"


def run_trl(
    seed: int, budget: float, root: Path, trl_python: str, model_dir: Path, prompts: Path, max_new_tokens: int
) -> tuple[list[dict], Path]:
    folder = root / f"trl-{seed}"
    here = Path(__file__).resolve().parent
    started = time.time()
    command = [trl_python, str(here / "trl_race_trl.py"), "--model-dir", str(model_dir), "--prompts", str(prompts)]
    command += ["--out", str(folder), "--budget", str(budget), "--started", str(started), "--seed", str(seed)]
    command += ["--prompts-per-step", str(PROMPTS_PER_STEP), "--generations", str(GENERATIONS)]
    command += ["--max-new-tokens", str(max_new_tokens), "--learning-rate", str(LEARNING_RATE), "--kl-coef", str(KL)]
    with (root / f"trl-{seed}.log").open("w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    return read_metrics(folder), folder / "adapter"


def held_out(seed: int, adapter: Path, root: Path, name: str) -> dict:
    out = root / f"eval-{name}-{seed}.json"
    job_file = root / f"race-{seed}.yaml"
    subprocess.run(
        [sys.executable, "-m", "grpolora.cli", "eval", str(job_file), "--adapter", str(adapter), "--out", str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return json.loads(out.read_text(encoding="utf-8"))


def reached(steps: list[dict], threshold: float) -> float | None:
    """Wall time of the first step at which the mean training reward of the last SMOOTH steps is >= threshold."""
    for i in range(SMOOTH - 1, len(steps)):
        window = [s["reward_mean"] for s in steps[i - SMOOTH + 1 : i + 1]]
        if None not in window and statistics.fmean(window) >= threshold:
            return steps[i]["elapsed"]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", required=True, help="python of a virtual environment with TRL")
    parser.add_argument("--budget", type=float, default=420.0, help="wall-clock seconds per side and seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--root", type=Path, default=Path("runs/trl-race"))
    parser.add_argument("--task", choices=["arithmetic", "sums"], default="arithmetic")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    parser.add_argument("--out", type=Path, default=Path("bench/results/trl_race.json"))
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(MODEL)
    result: dict = {"task": args.task, "max_new_tokens": args.max_new_tokens, "budget_seconds": args.budget}
    result["seeds"] = {}
    for seed in args.seeds:
        prompts = race_prompts(args.task, seed, args.root)
        document = job(seed, task_spec(args.task, seed, args.root, prompts), args.max_new_tokens)
        ours, ours_adapter = run_ours(seed, args.budget, args.root, document)
        trl, trl_adapter = run_trl(
            seed, args.budget, args.root, args.trl_python, model_dir, prompts, args.max_new_tokens
        )
        threshold = statistics.fmean(s["reward_mean"] for s in trl[-SMOOTH:])
        evals = {
            name: held_out(seed, adapter, args.root, name)
            for name, adapter in (("grpolora", ours_adapter), ("trl", trl_adapter))
        }
        seeded = {"threshold (TRL's final training reward, mean of its last 3 steps)": threshold}
        for name, steps in (("grpolora", ours), ("trl", trl)):
            seeded[name] = {
                "steps": len(steps),
                "last_step_elapsed": steps[-1]["elapsed"],
                "seconds_to_threshold": reached(steps, threshold),
                "held_out": evals[name],
                "curve": steps,
            }
        result["seeds"][str(seed)] = seeded
        args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
        for name in ("grpolora", "trl"):
            side = seeded[name]
            print(
                f"seed {seed} {name}: {side['steps']} steps in {side['last_step_elapsed']:.0f} s, threshold "
                f"{threshold:.3f} reached at {side['seconds_to_threshold']}, "
                f"held-out {json.dumps(side['held_out'])[:300]}"
            )


if __name__ == "__main__":
    main()
