"""Peak trainer memory per completion token with and without activation checkpointing, on CPU, side by side in
one invocation.

    python bench/long_completions.py [--lengths 512,1024] [--sequences 2] [--out bench/results/long_completions.json]

The quickstart's model (SmolLM2-135M-Instruct offline, float32, LoRA r=16 all-linear) and one `train_step` (this
project's code, klCoef 0 so that only the policy's forward and backward hold activations) on `--sequences`
completions of each length after a 32-token prompt, all in one micro-batch. Each configuration runs in a fresh
subprocess; a thread samples the process's resident memory every 5 ms during the step, and the figure is the
peak above the resident memory just before it (the model, the adapter and the optimizer are already there), per
completion token. The update itself is the same with checkpointing (tests/workers/test_trainer_ranks.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: the repo's operator/ must not shadow stdlib

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


def measure(length: int, sequences: int, checkpointing: bool) -> dict:
    import torch

    from grpolora.api.load import load_jobs
    from grpolora.workers.models import resolve_model
    from grpolora.workers.trainer.policy import Policy, build_batch
    from grpolora.workers.trainer.step import make_optimizer, train_step

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    (job,) = load_jobs(Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml")
    grpo = job.spec.grpo.model_copy(
        update={"kl_coef": 0.0, "gradient_checkpointing": checkpointing, "micro_batch_size": sequences}
    )
    spec = job.spec.model_copy(update={"grpo": grpo})
    policy = Policy(resolve_model(spec.model.name), spec, device=torch.device("cpu"))
    optimizer = make_optimizer(policy, grpo)
    g = torch.Generator().manual_seed(0)
    rows = [
        (torch.randint(5, 1000, (32,), generator=g).tolist(), torch.randint(5, 1000, (length,), generator=g).tolist(),
         [-1.0] * length)
        for _ in range(sequences)
    ]  # fmt: skip
    batch = build_batch(rows, [1.0, -1.0] * (sequences // 2) + [0.5] * (sequences % 2), pad_id=0)
    peak, before, done = [0], resident(), threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.perf_counter()
    train_step(policy, optimizer, batch, grpo, on_policy=True)
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    tokens = sequences * length
    grown = max(peak[0] - before, 0)
    return {
        "length": length,
        "sequences": sequences,
        "checkpointing": checkpointing,
        "peak_mib": grown / 2**20,
        "kib_per_token": grown / 1024 / tokens,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,1024")
    parser.add_argument("--sequences", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results/long_completions.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # length,checkpointing: run in this process
    args = parser.parse_args()
    if args.one:
        length, checkpointing = args.one.split(",")
        print(json.dumps(measure(int(length), args.sequences, checkpointing == "1")))
        return
    results = []
    for length in (int(v) for v in args.lengths.split(",")):
        for checkpointing in (False, True):
            command = [sys.executable, __file__, "--sequences", str(args.sequences), "--one",
                       f"{length},{int(checkpointing)}"]  # fmt: skip
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
            r = results[-1]
            print(f"{r['length']:>6} tokens x {r['sequences']}  checkpointing {'on ' if checkpointing else 'off'}  "
                  f"peak +{r['peak_mib']:8.1f} MiB  {r['kib_per_token']:7.1f} KiB/token  {r['seconds']:6.1f} s",
                  flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
