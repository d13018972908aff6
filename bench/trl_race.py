"""A learning race against TRL's GRPOTrainer (issue 25): same model, LoRA, task, batch and wall-clock budget.

    python bench/trl_race.py --trl-python /path/to/trl-venv/bin/python --budget 420 --seeds 0 1
    python bench/trl_race.py --trl-python /path/to/trl-venv/bin/python --task sums --budget 600 --seeds 0 1
    python bench/trl_race.py --trl-python /path/to/trl-venv/bin/python --task sums --steps 10 --seeds 0 1 2 3

`--steps N` bounds each side by optimizer steps instead of wall time (issue 37): a per-step comparison of what each
update learns needs no idle machine, so it can run beside other work (its times then say nothing). `--together`
runs a seed's two sides at the same time and `--no-held-out` skips the held-out evaluation, for such per-step runs.

Tasks: `arithmetic` (the built-in task: two-digit sums and differences, products up to 12 x 99), or `sums`, a
GSM8K-shaped file made on disk (rows {messages, answer}, a training file and 64 held-out rows) of one- and two-digit
sums that the 135M model already answers now and then, so that a budget of minutes shows learning; both are scored
by the `arithmetic` reward (1 for the right number, +0.1 for an `Answer:` line). The 64 held-out problems are drawn
first and the training rows from the other problems, so that no held-out problem is trained on.

Both sides read the training prompts in the same order: grpo-lora shuffles the file by its seed
(tasks/dataset.epoch_order), so TRL is given the rows in that order with its own shuffling off.

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
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from itertools import islice
from pathlib import Path

import yaml

from grpolora.workers.launcher.results import read_metrics
from grpolora.workers.models import resolve_model
from grpolora.workers.tasks import chat_messages
from grpolora.workers.tasks.arithmetic import INSTRUCTION, ArithmeticTask
from grpolora.workers.tasks.dataset import epoch_order

MODEL = "offline:smollm2-135m-instruct"
# What the race keeps of each grpo-lora step (metrics.jsonl's names); TRL's side writes its own logs under these
# names where it has them (bench/trl_race_trl.py) and the rest of its logs beside them.
# `tokens` is the step's completion tokens on both sides; `frac_reward_zero_std`, `completions` and `clip_ratio` are
# TRL's figures under TRL's names (docs/metrics.md). Results recorded before 2026-12-04's issue 47 have TRL's
# per-step prompt + completion tokens under `tokens` and lack the rest. grpo-lora's on-policy evidence (the
# version sampled against the trainer's, the logprob mismatch) is kept so that a claim of exact rollouts can be
# checked from the results file.
LOGGED = (
    "step", "reward_mean", "grad_norm", "grad_clipped", "learning_rate", "entropy", "kl", "tokens",
    "frac_reward_zero_std", "completions", "clip_ratio", "completions_truncated",
    "on_policy", "rollout_version", "trainer_version", "mismatch", "mismatch_max_abs",
)  # fmt: skip
SMOOTH = 3  # steps in the moving mean that decides when a side reached the threshold
PROMPTS_PER_STEP, GENERATIONS, MAX_NEW_TOKENS, LEARNING_RATE, KL = 4, 8, 64, 2e-4, 0.01


HELD_OUT = 64


def sums_problems(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """`sums`: a + b with a from 1 to 19 and b from 1 to 9 (171 problems), split per seed into HELD_OUT held-out
    problems and the rest, the only ones training rows are drawn from."""
    problems = [(a, b) for a in range(1, 20) for b in range(1, 10)]
    random.Random(f"sums-split:{seed}").shuffle(problems)
    return problems[HELD_OUT:], problems[:HELD_OUT]


def sums_row(a: int, b: int) -> dict:
    """A `sums` problem asked as the arithmetic task asks."""
    return {"messages": chat_messages(f"What is {a} + {b}? {INSTRUCTION}"), "answer": str(a + b)}


def sums_rows(seed: int, count: int) -> list[dict]:
    """`count` training rows drawn (with repeats) from the problems `sums_problems` leaves for training."""
    train, _ = sums_problems(seed)
    rng = random.Random(f"sums:{seed}")
    return [sums_row(*rng.choice(train)) for _ in range(count)]


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def race_prompts(task: str, seed: int, root: Path) -> tuple[Path, Path]:
    """The training prompts, as {messages, answer} rows: grpo-lora's file (for `sums`; for `arithmetic` it draws
    the same stream from its built-in task) and TRL's, the same rows in the order grpo-lora reads them (TRL reads
    it unshuffled). 500 steps' worth: more than a race uses, and within one epoch of grpo-lora's order."""
    count = 500 * PROMPTS_PER_STEP
    if task == "sums":
        rows = sums_rows(seed, count)
        ours = write_rows(root / f"sums-train-{seed}.jsonl", rows)
        ordered = [rows[int(i)] for i in epoch_order(seed, 0, len(rows))]
        return ours, write_rows(root / f"sums-train-{seed}-in-order.jsonl", ordered)
    drawn = islice(ArithmeticTask().prompts(seed), count)
    rows = [{"messages": chat_messages(p), "answer": p.answer} for p in drawn]
    prompts = write_rows(root / f"prompts-{seed}.jsonl", rows)
    return prompts, prompts


def task_spec(task: str, seed: int, root: Path, prompts: Path) -> dict:
    """grpo-lora's spec.task: the built-in `arithmetic`, or the `sums` files (`prompts`, and 64 held-out rows)."""
    if task == "arithmetic":
        return {"name": "arithmetic"}
    held_out = write_rows(root / f"sums-eval-{seed}.jsonl", [sums_row(*p) for p in sums_problems(seed)[1]])
    return {
        "dataset": {
            "path": str(prompts.resolve()),
            "messagesField": "messages",
            "eval": {"path": str(held_out.resolve())},
        },
        "reward": [{"name": "arithmetic"}],
    }


def job(seed: int, task: dict, max_new_tokens: int, steps: int | None) -> dict:
    return {
        "apiVersion": "grpolora.dev/v1alpha1",
        "kind": "GRPOLoraJob",
        "metadata": {"name": f"race-{seed}"},
        "spec": {
            "model": {"name": MODEL, "dtype": "float32"},
            "lora": {"rank": 16, "alpha": 32, "targetModules": "all-linear"},
            "grpo": {
                "steps": steps or 10_000,  # else the budget stops it
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
            # The adapter as the budget runs out (or at the last step).
            "checkpoint": {"everySteps": steps or 1, "keep": 1},
        },
    }


def run_ours(seed: int, budget: float | None, root: Path, document: dict) -> tuple[list[dict], Path]:
    """`grpolora run` until a step ends past the budget, then Ctrl-C (it stops after its checkpoint); without a
    budget, to its last step."""
    folder = root / f"grpolora-{seed}"
    job_file = root / f"race-{seed}.yaml"
    job_file.write_text(yaml.safe_dump(document), encoding="utf-8")
    started = time.time()
    process = subprocess.Popen(
        [sys.executable, "-m", "grpolora.cli", "run", str(job_file), "--run-dir", str(folder)],
        stdout=subprocess.DEVNULL,
        stderr=(root / f"grpolora-{seed}.log").open("w"),
        # A shell's background job starts with SIGINT ignored, and Python then installs no handler: the budget's
        # Ctrl-C would never arrive. The run gets the default disposition back.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    while process.poll() is None:
        seen = read_metrics(folder)
        if budget is not None and seen and seen[-1]["time"] - started >= budget:
            # The checkpoint of that step is written before the next step's record; wait for it, then stop.
            wanted = folder / "checkpoints" / f"step-{seen[-1]['step']:08d}"
            while not (wanted / "trainer_state.pt").exists() and process.poll() is None:
                time.sleep(0.2)
            process.send_signal(signal.SIGINT)
            break
        time.sleep(0.5)
    process.wait(timeout=None if budget is None else 120)
    records = read_metrics(folder)
    steps = [{**{k: r.get(k) for k in LOGGED}, "elapsed": r["time"] - started} for r in records]
    last = max((folder / "checkpoints").glob("step-*"))
    return steps, last / "adapter"


def run_trl(
    seed: int,
    limit: tuple[float | None, int | None],
    root: Path,
    trl_python: str,
    model_dir: Path,
    prompts: Path,
    max_new_tokens: int,
) -> tuple[list[dict], Path]:
    folder = root / f"trl-{seed}"
    here = Path(__file__).resolve().parent
    started = time.time()
    command = [trl_python, str(here / "trl_race_trl.py"), "--model-dir", str(model_dir), "--prompts", str(prompts)]
    budget, steps = limit
    command += ["--out", str(folder), "--started", str(started), "--seed", str(seed)]
    command += ["--budget", str(budget)] if budget is not None else ["--max-steps", str(steps)]
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


def per_step(result: dict) -> dict:
    """Per side: the training reward at each step averaged over the seeds, and each seed's mean over its steps."""
    table: dict = {}
    for name in ("grpolora", "trl"):
        curves = [seeded[name]["curve"] for seeded in result["seeds"].values()]
        length = min(len(c) for c in curves)
        table[name] = {
            "reward_by_step (mean over seeds)": [
                statistics.fmean(c[i]["reward_mean"] for c in curves) for i in range(length)
            ],
            "reward_mean_over_steps by seed": {
                seed: statistics.fmean(s["reward_mean"] for s in seeded[name]["curve"][:length])
                for seed, seeded in result["seeds"].items()
            },
        }
    return table


def plot_race(result: dict, out: Path) -> None:
    """Training reward against step (left) and against wall time since launch (right), every seed, both sides."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, color in (("grpolora", "tab:blue"), ("trl", "tab:orange")):
        for seed, seeded in result["seeds"].items():
            curve = seeded[name]["curve"]
            rewards = [s["reward_mean"] for s in curve]
            label = f"{name}, seed {seed}"
            by_step.plot([s["step"] for s in curve], rewards, color=color, alpha=0.5, marker="o", ms=3, label=label)
            by_time.plot([s["elapsed"] for s in curve], rewards, color=color, alpha=0.5, marker="o", ms=3)
        mean = result["per_step"][name]["reward_by_step (mean over seeds)"]
        by_step.plot(range(1, len(mean) + 1), mean, color=color, linewidth=3, label=f"{name}, mean over seeds")
    by_step.set_xlabel("optimizer step")
    by_time.set_xlabel("seconds since launch")
    for axis in (by_step, by_time):
        axis.set_ylabel("training reward (mean of 32)")
        axis.grid(alpha=0.3)
    by_step.legend(fontsize=7, loc="best")
    figure.suptitle(f"grpo-lora vs TRL GRPOTrainer, task {result['task']}")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", required=True, help="python of a virtual environment with TRL")
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--budget", type=float, help="wall-clock seconds per side and seed (default 420)")
    limit.add_argument("--steps", type=int, help="optimizer steps per side and seed, instead of a budget")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--root", type=Path, default=Path("runs/trl-race"))
    parser.add_argument("--task", choices=["arithmetic", "sums"], default="arithmetic")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    parser.add_argument("--out", type=Path, default=Path("bench/results/trl_race.json"))
    parser.add_argument("--together", action="store_true", help="a seed's two sides at once (with --steps)")
    parser.add_argument("--no-held-out", dest="held_out", action="store_false", help="skip the held-out evaluation")
    args = parser.parse_args()
    if args.budget is None and args.steps is None:
        args.budget = 420.0
    args.root.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(MODEL)
    result: dict = {"task": args.task, "max_new_tokens": args.max_new_tokens, "budget_seconds": args.budget}
    result |= {"steps": args.steps, "sides_together": args.together, "seeds": {}}
    if args.together and args.steps is None:
        parser.error("--together compares per step only: give --steps")
    for seed in args.seeds:
        prompts, in_order = race_prompts(args.task, seed, args.root)
        document = job(seed, task_spec(args.task, seed, args.root, prompts), args.max_new_tokens, args.steps)
        trl_side = partial(
            run_trl, seed, (args.budget, args.steps), args.root, args.trl_python, model_dir, in_order,
            args.max_new_tokens,
        )  # fmt: skip
        with ThreadPoolExecutor(max_workers=1) as pool:
            theirs = pool.submit(trl_side) if args.together else None
            ours, ours_adapter = run_ours(seed, args.budget, args.root, document)
            trl, trl_adapter = theirs.result() if theirs else trl_side()
        threshold = statistics.fmean(s["reward_mean"] for s in trl[-SMOOTH:])
        evals = {
            name: held_out(seed, adapter, args.root, name) if args.held_out else None
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
        seeded["trl"]["config"] = json.loads((args.root / f"trl-{seed}" / "config.json").read_text())
        result["seeds"][str(seed)] = seeded
        result["per_step"] = per_step(result)
        args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
        plot_race(result, args.out.with_suffix(".png"))
        for name in ("grpolora", "trl"):
            side = seeded[name]
            print(
                f"seed {seed} {name}: {side['steps']} steps in {side['last_step_elapsed']:.0f} s, threshold "
                f"{threshold:.3f} reached at {side['seconds_to_threshold']}, "
                f"held-out {json.dumps(side['held_out'])[:300]}"
            )


if __name__ == "__main__":
    main()
