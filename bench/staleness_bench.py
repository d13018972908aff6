"""Bounded staleness (grpo.maxStaleness = k): step time and reward per wall-clock minute at k = 0, 1, 2 in one
invocation, trainer and inference pinned to a core each (what separate node pools give), as bench/step_bench.py
does for the pipelined mode.

    python bench/staleness_bench.py [--steps 8] [--ks 0 1 2] [--seeds 0] [--out bench/results/staleness.json]

The job of bench/step_bench.py (examples/quickstart.yaml: SmolLM2-135M-Instruct offline, `keyword` task, 4 prompts
x 8 completions of up to 48 tokens, LoRA r=16 all-linear, float32, one trainer, one vLLM CPU replica). Step 1
(engine warm-up) is left out of the medians. Reward per minute: (mean reward of the last half of the steps - the
reward of step 1) / the wall minutes of steps 2..N. Targets: at k = 2 the median step is at most 1.05 x max(generate,
train) of the k = 0 run, and k = 2's reward per minute beats k = 0's. With several seeds (`grpo.seed`: prompt order,
sampling, LoRA initialisation) the verdicts compare the means over the seeds, and a second measure that needs no
choice of "gain" is reported too: the mean reward of the last `--window` steps each run finished within the same
wall-clock budget (the shortest run's time after step 1), so a faster k counts the extra steps it got.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: the repo's operator/ must not shadow stdlib
sys.path.append(str(Path(__file__).resolve().parent))

from step_bench import ROOT, run_once, write_results

from grpolora.api.load import load_jobs
from grpolora.workers.launcher.results import read_metrics


def configure(job, *, steps: int, staleness: int, seed: int = 0):
    update = {"steps": steps, "pipelined": False, "max_staleness": staleness, "seed": seed}
    grpo = job.spec.grpo.model_copy(update=update)
    inference = job.spec.inference.model_copy(update={"max_loras": max(2, staleness + 1)})
    return job.model_copy(update={"spec": job.spec.model_copy(update={"grpo": grpo, "inference": inference})})


def reward_per_minute(records: list[dict]) -> float:
    later = records[1:]
    gain = statistics.mean(r["reward_mean"] for r in later[len(later) // 2 :]) - records[0]["reward_mean"]
    return gain / (sum(r["seconds"]["step"] for r in later) / 60)


def reward_within(records: list[dict], budget_s: float, window: int) -> tuple[int, float]:
    """Steps finished within `budget_s` after step 1, and the mean reward of the last `window` of them."""
    done, elapsed = [], 0.0
    for record in records[1:]:
        elapsed += record["seconds"]["step"]
        if elapsed > budget_s:
            break
        done.append(record["reward_mean"])
    return len(done), statistics.mean(done[-window:]) if done else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--out", default="bench/results/staleness.json")
    args = parser.parse_args()
    if 0 not in args.ks:
        parser.error("--ks must include 0: the targets compare against k = 0")
    (base,) = load_jobs(ROOT / "examples" / "quickstart.yaml")
    results: dict[str, dict] = {}
    runs: dict[tuple[int, int], list[dict]] = {}
    for seed in args.seeds:
        for k in args.ks:
            name = f"k={k}" if args.seeds == [0] else f"k={k} seed={seed}"
            result = run_once(configure(base, steps=args.steps, staleness=k, seed=seed), pinned=True)
            records = read_metrics(Path(result["run_dir"]))
            runs[k, seed] = records
            result["seed"] = seed
            result.update(summarise(records))
            results[name] = result
            print(name, json.dumps({key: v for key, v in result.items() if key != "run_dir"}), flush=True)
    budget = min(sum(r["seconds"]["step"] for r in records[1:]) for records in runs.values())
    summary: dict[str, dict] = {}
    for k in args.ks:
        within = [reward_within(runs[k, seed], budget, args.window) for seed in args.seeds]
        keyed = [results[f"k={k}" if args.seeds == [0] else f"k={k} seed={seed}"] for seed in args.seeds]
        summary[f"k={k}"] = {
            "step": statistics.mean(r["step"] for r in keyed),
            "generate": statistics.mean(r["generate"] for r in keyed),
            "train": statistics.mean(r["train"] for r in keyed),
            "reward_per_minute": statistics.mean(r["reward_per_minute"] for r in keyed),
            "budget_s": budget,
            "steps_within_budget": [n for n, _ in within],
            "reward_within_budget": [reward for _, reward in within],
            "reward_within_budget_mean": statistics.mean(reward for _, reward in within),
        }
    results["summary"] = summary
    if 2 in args.ks:
        k0, k2 = summary["k=0"], summary["k=2"]
        k2["target_s"] = 1.05 * max(k0["generate"], k0["train"])
        k2["step_within_target"] = k2["step"] <= k2["target_s"]
        k2["reward_per_minute_beats_k0"] = k2["reward_per_minute"] > k0["reward_per_minute"]
        k2["reward_within_budget_beats_k0"] = k2["reward_within_budget_mean"] > k0["reward_within_budget_mean"]
    write_results(results, args.out)


def summarise(records: list[dict]) -> dict:
    return {
        "wait": statistics.median(r["seconds"]["wait"] for r in records[1:]),
        "reward_per_minute": reward_per_minute(records),
        "rewards": [r["reward_mean"] for r in records],
        "staleness": [r["staleness_max"] for r in records],
        "on_policy": [r["on_policy"] for r in records],
        "dropped_stale": records[-1]["dropped_stale_total"],
        "truncated_fraction_max": max(r["truncated_fraction"] for r in records),
    }


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    main()
