"""Two GRPO jobs on one shared rollout replica vs each with its own vs one after the other, in one invocation.

    python bench/pool_bench.py [--steps 6] [--out bench/results/pool.json]

The job of bench/step_bench.py (examples/quickstart.yaml: SmolLM2-135M-Instruct offline, `keyword` task, LoRA r=16
all-linear, float32, one trainer) with 2 prompts x 8 completions of up to 48 tokens a step (see PROMPTS_PER_STEP),
twice (jobs `a` and `b`), as `grpolora run` runs it, on the same machine's cores, in three layouts:
- shared: `grpolora run pool.yaml a.yaml b.yaml`: one RolloutPool replica (maxJobs 2) serves both jobs at once;
- separate: `grpolora run a.yaml` and `grpolora run b.yaml` at the same time, each job with its own vLLM replica;
- sequential: `grpolora run a.yaml`, then `grpolora run b.yaml`.

Per layout: the wall time of the whole layout (engine starts included); aggregate completion tokens per second over
the steady state (the completion tokens of steps 2..N of both jobs, over the wall time from the first job's step 1
to the last job's step N; for sequential, the sum of both jobs' own such spans); each job's median step, generate
and sync seconds over steps 2..N; and the workers the layout needs (each one a node's cores, or a GPU, in a
cluster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
JOBS = ("a", "b")
PROMPTS_PER_STEP = 2


def job_document(name: str, steps: int, model: str, *, on_pool: bool) -> dict:
    job = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    job["metadata"]["name"] = name
    job["spec"]["model"]["name"] = model
    job["spec"]["grpo"]["steps"] = steps
    # 2 prompts (16 sequences) a step, not the quickstart's 4: chosen when vLLM 0.32's CPU engine died ("CPU Generator
    # does not use offset") on a round of seeded prompts chunked past its 2048-token prefill budget, as two jobs of
    # 4 x 8 at once were; CPU engines now prefill whole prompts, and 2 keeps BENCHMARKS.md's figures reproducible.
    job["spec"]["grpo"]["promptsPerStep"] = PROMPTS_PER_STEP
    job["spec"]["checkpoint"] = {"everySteps": steps}  # no checkpoint between: the layouts compare rollouts
    if on_pool:
        job["spec"]["inference"] = {"poolRef": {"name": "bench"}}
    return job


def pool_document(model: str) -> dict:
    quickstart = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())["spec"]
    return {
        "apiVersion": "grpolora.dev/v1alpha1",
        "kind": "RolloutPool",
        "metadata": {"name": "bench"},
        "spec": {"model": quickstart["model"] | {"name": model}, **quickstart["inference"], "maxJobs": 2},
    }


def grpolora_run(folder: Path, files: list[str], run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-P", "-m", "grpolora.cli", "run", *files, "--run-dir", str(run_dir)],
        cwd=folder,
        stdout=subprocess.DEVNULL,
        stderr=(run_dir.parent / f"{run_dir.name}.stderr").open("w"),
    )


def finished(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.wait() != 0:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")


def write(folder: Path, name: str, document: dict) -> str:
    (folder / name).write_text(yaml.safe_dump(document))
    return name


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def figures(layout: str, wall: float, runs: dict[str, list[dict]], workers: int) -> dict:
    later = {name: steps[1:] for name, steps in runs.items()}
    tokens = sum(r["tokens"] for steps in later.values() for r in steps)
    if layout == "sequential":
        span = sum(steps[-1]["time"] - steps[0]["time"] for steps in runs.values())
    else:
        span = max(steps[-1]["time"] for steps in runs.values()) - min(steps[0]["time"] for steps in runs.values())
    per_job = {
        name: {
            phase: round(statistics.median(r["seconds"][phase] for r in steps), 3)
            for phase in ("step", "generate", "train", "sync")
        }
        | {"reward_first": round(runs[name][0]["reward_mean"], 3), "reward_last": round(steps[-1]["reward_mean"], 3)}
        for name, steps in later.items()
    }
    return {
        "wall_s": round(wall, 1),
        "steady_tokens": tokens,
        "steady_span_s": round(span, 1),
        "completion_tokens_per_s": round(tokens / span, 2),
        "workers": workers,
        "jobs": per_job,
    }


LAYOUTS = ("shared", "separate", "sequential")
WORKERS = {"shared": 3, "separate": 4, "sequential": 2}  # 1 replica + 2 trainers; 2 + 2; 1 + 1, one job at a time


def run_layout(layout: str, folder: Path, own: list[str], on_pool: list[str], pool: str) -> dict[str, list[dict]]:
    """Run both jobs in `layout`; each job's metrics records."""
    if layout == "shared":
        finished([grpolora_run(folder, [pool, *on_pool], folder / "shared")])
        return {name: records(folder / "shared" / name) for name in JOBS}
    if layout == "separate":
        finished([grpolora_run(folder, [own[i]], folder / f"separate-{name}") for i, name in enumerate(JOBS)])
    else:
        for i, name in enumerate(JOBS):
            finished([grpolora_run(folder, [own[i]], folder / f"{layout}-{name}")])
    return {name: records(folder / f"{layout}-{name}") for name in JOBS}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="bench/results/pool.json")
    parser.add_argument("--model", default="offline:smollm2-135m-instruct", help="offline:tiny-llama: a smoke run")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="pool-bench-"))
    own = [write(folder, f"{n}.yaml", job_document(n, args.steps, args.model, on_pool=False)) for n in JOBS]
    on_pool = [write(folder, f"{n}-on-pool.yaml", job_document(n, args.steps, args.model, on_pool=True)) for n in JOBS]
    pool = write(folder, "pool.yaml", pool_document(args.model))
    out = Path(args.out)
    results: dict = json.loads(out.read_text()) if out.exists() else {}  # layouts run before, by another invocation
    results |= {"model": args.model, "steps": args.steps, "cores": os.cpu_count()}
    for layout in args.layouts:
        load_before, started = os.getloadavg(), time.monotonic()
        runs = run_layout(layout, folder, own, on_pool, pool)
        results[layout] = figures(layout, time.monotonic() - started, runs, WORKERS[layout])
        results[layout] |= {"load_average_before": load_before, "load_average_after": os.getloadavg()}
        results[layout]["folder"] = str(folder)
        print(layout, json.dumps(results[layout]), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))  # after each layout: a run cut short keeps what it measured


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    main()
