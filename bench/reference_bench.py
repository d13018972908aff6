"""Where the KL reference logprobs come from (grpo.referenceFrom): the trainer's own reference pass, or the inference
replicas scoring each sample with the adapter off. Side by side in one invocation, in the two layouts of
bench/step_bench.py and bench/staleness_bench.py:

    python bench/reference_bench.py [--steps 8] [--out bench/results/reference.json]

- sequential (maxStaleness 0), every worker free to use both cores: what the TRL comparison is made on;
- maxStaleness 1, trainer and inference pinned to a core each (separate node pools): where the replicas have
  idle time while the trainer trains.

The job of bench/step_bench.py (examples/quickstart.yaml: SmolLM2-135M-Instruct offline, `keyword`, 4 prompts x 8
completions of up to 48 tokens, LoRA r=16 all-linear, float32, klCoef 0.01, one trainer, one vLLM CPU replica).
Medians over steps 2..N (step 1 warms the engine up). The two settings of a layout share the seed, so they draw the
same prompts and, until their adapters drift apart by float rounding, the same samples.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: the repo's operator/ must not shadow stdlib
sys.path.append(str(Path(__file__).resolve().parent))

from step_bench import PHASES, ROOT, run_once, write_results

from grpolora.api.load import load_jobs
from grpolora.workers.launcher.results import read_metrics

LAYOUTS = {"sequential": (0, False), "k=1, pinned": (1, True)}  # name: (maxStaleness, pinned)


def configure(job, *, steps: int, staleness: int, reference_from: str):
    update = {"steps": steps, "pipelined": False, "max_staleness": staleness, "reference_from": reference_from}
    grpo = job.spec.grpo.model_copy(update=update)
    return job.model_copy(update={"spec": job.spec.model_copy(update={"grpo": grpo})})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="bench/results/reference.json")
    args = parser.parse_args()
    (base,) = load_jobs(ROOT / "examples" / "quickstart.yaml")
    results: dict[str, dict] = {}
    for layout, (staleness, pinned) in LAYOUTS.items():
        for reference_from in ("trainer", "inference"):
            name = f"{layout}, reference from {reference_from}"
            job = configure(base, steps=args.steps, staleness=staleness, reference_from=reference_from)
            result = run_once(job, pinned=pinned)
            records = read_metrics(Path(result["run_dir"]))
            result["kl"] = [r["kl"] for r in records]
            result["rewards"] = [r["reward_mean"] for r in records]
            results[name] = result
            print(name, json.dumps({k: round(v, 3) for k, v in result.items() if k in PHASES}), flush=True)
        trainer, inference = (results[f"{layout}, reference from {where}"] for where in ("trainer", "inference"))
        inference["step_speedup"] = trainer["step"] / inference["step"]
        inference["train_speedup"] = trainer["train"] / inference["train"]
    write_results(results, args.out)


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    main()
