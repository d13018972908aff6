"""Per-step time split of a real GRPO run, sequential vs pipelined, side by side in one invocation.

    python bench/step_bench.py [--steps 8] [--out bench/results/step.json]

SmolLM2-135M-Instruct (offline), the `keyword` task, 4 prompts x 8 completions of up to 48 tokens, LoRA r=16 on
all linear layers, float32, one trainer and one vLLM CPU replica under `grpolora run`'s launcher. Four runs:
sequential and pipelined, each once with every worker free to use every core (what `grpolora run` does by
default) and once with trainer and inference pinned to separate cores (core 0 and core 1), which is what the
separate node pools of a cluster give. Step 1 (engine warm-up) is left out of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: the repo's operator/ must not shadow stdlib

from grpolora.api.load import load_jobs
from grpolora.workers.launcher.local import LocalRun
from grpolora.workers.launcher.results import read_metrics

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("generate", "reward", "train", "sync", "step")


def configure(job, *, steps: int, pipelined: bool):
    grpo = job.spec.grpo.model_copy(update={"steps": steps, "pipelined": pipelined})
    return job.model_copy(update={"spec": job.spec.model_copy(update={"grpo": grpo})})


def run_once(job, *, pinned: bool) -> dict[str, float]:
    run_dir = Path(tempfile.mkdtemp(prefix="step-bench-"))
    cpus = {"trainer": [0], "inference": [1]} if pinned else None
    one_thread = {"OMP_NUM_THREADS": "1"}
    role_env = {"trainer": one_thread, "inference": one_thread | {"VLLM_CPU_OMP_THREADS_BIND": "1"}} if pinned else None
    local = LocalRun([job], run_dir, ray_address=None, show_progress=False, cpus=cpus, role_env=role_env)
    try:
        local.start()
        local.wait()
    finally:
        local.stop()
    records = read_metrics(run_dir)[1:]
    result = {phase: statistics.median(r["seconds"][phase] for r in records) for phase in PHASES}
    result["reward_first"] = read_metrics(run_dir)[0]["reward_mean"]
    result["reward_last"] = records[-1]["reward_mean"]
    result["run_dir"] = str(run_dir)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="bench/results/step.json")
    args = parser.parse_args()
    (base,) = load_jobs(ROOT / "examples" / "quickstart.yaml")
    results = {}
    for pinned in (False, True):
        for pipelined in (False, True):
            name = f"{'pipelined' if pipelined else 'sequential'}{', pinned' if pinned else ''}"
            results[name] = run_once(configure(base, steps=args.steps, pipelined=pipelined), pinned=pinned)
            print(name, json.dumps({k: round(v, 3) for k, v in results[name].items() if k in PHASES}), flush=True)
    for pinned in ("", ", pinned"):
        sequential, pipelined = results[f"sequential{pinned}"], results[f"pipelined{pinned}"]
        pipelined["target_s"] = 1.15 * max(sequential["generate"], sequential["train"])
        pipelined["speedup_over_sequential"] = sequential["step"] / pipelined["step"]
    write_results(results, args.out)


def write_results(results: dict, out: str) -> None:
    """`results` with the load average at the end (the machine's state is part of a figure) to `out`, and printed."""
    results["load_average"] = os.getloadavg()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    main()
