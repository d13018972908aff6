"""Bounded staleness (grpo.maxStaleness = k): step time and reward per wall-clock minute at k = 0, 1, 2 in one
invocation, trainer and inference pinned to a core each (what separate node pools give), as bench/step_bench.py
does for the pipelined mode.

    python bench/staleness_bench.py [--steps 8] [--out bench/results/staleness.json]

The job of bench/step_bench.py (examples/quickstart.yaml: SmolLM2-135M-Instruct offline, `keyword` task, 4 prompts
x 8 completions of up to 48 tokens, LoRA r=16 all-linear, float32, one trainer, one vLLM CPU replica). Step 1
(engine warm-up) is left out of the medians. Reward per minute: (mean reward of the last half of the steps - the
reward of step 1) / the wall minutes of steps 2..N. Targets: at k = 2 the median step is at most 1.05 x max(generate,
train) of the k = 0 run, and k = 2's reward per minute beats k = 0's.
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

from step_bench import ROOT, run_once

from grpolora.api.load import load_jobs
from grpolora.workers.launcher.local import read_metrics


def configure(job, *, steps: int, staleness: int):
    grpo = job.spec.grpo.model_copy(update={"steps": steps, "pipelined": False, "max_staleness": staleness})
    inference = job.spec.inference.model_copy(update={"max_loras": max(2, staleness + 1)})
    return job.model_copy(update={"spec": job.spec.model_copy(update={"grpo": grpo, "inference": inference})})


def reward_per_minute(records: list[dict]) -> float:
    later = records[1:]
    gain = statistics.mean(r["reward_mean"] for r in later[len(later) // 2 :]) - records[0]["reward_mean"]
    return gain / (sum(r["seconds"]["step"] for r in later) / 60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="bench/results/staleness.json")
    args = parser.parse_args()
    (base,) = load_jobs(ROOT / "examples" / "quickstart.yaml")
    results: dict[str, dict] = {}
    for k in (0, 1, 2):
        result = run_once(configure(base, steps=args.steps, staleness=k), pinned=True)
        records = read_metrics(Path(result["run_dir"]))
        result["wait"] = statistics.median(r["seconds"]["wait"] for r in records[1:])
        result["reward_per_minute"] = reward_per_minute(records)
        result["staleness"] = [r["staleness_max"] for r in records]
        result["on_policy"] = [r["on_policy"] for r in records]
        result["dropped_stale"] = records[-1]["dropped_stale_total"]
        result["truncated_fraction_max"] = max(r["truncated_fraction"] for r in records)
        results[f"k={k}"] = result
        print(f"k={k}", json.dumps({key: v for key, v in result.items() if key != "run_dir"}), flush=True)
    k0, k2 = results["k=0"], results["k=2"]
    k2["target_s"] = 1.05 * max(k0["generate"], k0["train"])
    k2["step_within_target"] = k2["step"] <= k2["target_s"]
    k2["reward_per_minute_beats_k0"] = k2["reward_per_minute"] > k0["reward_per_minute"]
    results["load_average"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    main()
