"""A rollout stream's completion tokens/s with and without sync rounds, the rounds' time, and the HTTP process's
memory, on real inference servers.

    python bench/member_bench.py [--replicas 1] [--phases 4] [--seconds 20] [--omp-threads 1] [--out ...]

CPU, gloo over loopback, SmolLM2-135M-Instruct (offline), float32, LoRA r=16 on all linear layers (19.5 MB a
round), `--replicas` real inference servers (`grpolora worker inference`) and a sender in this process. After a
warm-up round, phases alternate (without rounds, with rounds, ...; `--phases` in all, `--seconds` each) while
`--clients` threads keep a rollout stream going against replica 0 (each request: one prompt, n=2, up to 16
tokens, temperature 1, seeded; small, so that many finish inside each phase). In a phase with rounds, the sender
sends a new version every `--gap` seconds after the last one returned. Per phase: completion tokens of the
requests that finished inside it, over its length. Per round: `send()` called until the version is live on every
replica (the servers' own `live_since`, one clock), and the `send()` call itself. At the end: VmRSS and VmHWM
(peak) of each server's HTTP process, from /proc/<pid>/status.

The script uses only what the servers have offered since before issue 22 (the sender, /v1/generate,
/v1/adapter), so that the same file measures the code before and after a change from a copy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from grpolora.testing.servers import TOKEN, ServerProcess, http_sender, tiny_cpu_job
from grpolora.workers.adapter import lora_config, lora_tensors
from grpolora.workers.models import resolve_model

MODEL = "offline:smollm2-135m-instruct"


def build_policy(model_dir: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))


def new_version(policy, seed: int) -> dict[str, torch.Tensor]:
    """Small random lora_B weights of their own each round (a LoRA whose B is zero is the base model)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.01)
    return lora_tensors(policy)


def memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


class Stream:
    """`clients` threads sending rollout requests to one replica until stopped; each finished request is
    recorded as (finish time, completion tokens)."""

    def __init__(self, url: str, clients: int):
        self.done: list[tuple[float, int]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(url, i), daemon=True) for i in range(clients)]
        for thread in self._threads:
            thread.start()

    def _run(self, url: str, client: int) -> None:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        seed = client * 1_000_000
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                seed += 1
                body = {
                    "prompts": ["Write a short story about a lighthouse keeper."],
                    "n": 2,
                    "max_tokens": 16,
                    "temperature": 1.0,
                    "seed": seed,
                }
                response = http.post(f"{url}/v1/generate", json=body, headers=headers)
                if response.status_code != 200:
                    self.errors += 1
                    continue
                tokens = sum(len(s["token_ids"]) for r in response.json()["results"] for s in r["samples"])
                self.done.append((time.time(), tokens))

    def tokens_between(self, start: float, end: float) -> int:
        return sum(tokens for at, tokens in self.done if start <= at < end)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(180)


def live_everywhere(servers, version: int) -> float:
    """The latest `live_since` of `version` over the replicas (polling each until it serves it)."""
    latest = 0.0
    for server in servers:
        while (state := httpx.get(f"{server.url}/v1/adapter", timeout=30).json())["live_version"] < version:
            time.sleep(0.001)
        latest = max(latest, state["live_since"])
    return latest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--phases", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--gap", type=float, default=0.5)
    parser.add_argument("--out", default="bench/results/members.json")
    # Each server's OpenMP threads: more than the free cores spin against each other on a shared machine.
    parser.add_argument("--omp-threads", default="1")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = args.omp_threads  # the servers inherit it (ServerProcess keeps a value set)
    torch.set_num_threads(1)
    model_dir = resolve_model(MODEL)
    policy = build_policy(model_dir)
    # SmolLM2 with the spec's own LoRA and sync defaults, one server per replica on loopback.
    job = tiny_cpu_job(
        model={"name": MODEL, "dtype": "float32"},
        lora={"rank": 16, "alpha": 32},
        inference={"maxModelLen": 512, "replicas": args.replicas},
        sync={"timeoutSeconds": 600},
    )
    log_dir = Path(tempfile.mkdtemp(prefix="member-bench-"))
    servers = [ServerProcess(job, i, log_dir) for i in range(args.replicas)]
    phases: list[dict] = []
    rounds: list[dict] = []
    try:
        for server in servers:
            server.wait_healthy(timeout=600)
        sender = http_sender(
            job.inference_endpoints,
            TOKEN,
            store_port=job.sync.port,
            model_dir=model_dir,
            timeout_seconds=60,
            bucket_bytes=job.sync.bucket_bytes,
            join_timeout_seconds=60,
        )
        sender.form_group(wait_for_all_seconds=60)
        sender.send(new_version(policy, 0), lora_config(policy))  # warm-up: both paths have built a LoRA once
        memory_before = [memory_kib(server.proc.pid) for server in servers]
        stream = Stream(servers[0].url, args.clients)
        time.sleep(5)  # the stream reaches its steady state
        for phase in range(args.phases):
            syncing = phase % 2 == 1
            start = time.time()
            while time.time() - start < args.seconds:
                if not syncing:
                    time.sleep(0.05)
                    continue
                tensors, config = new_version(policy, len(rounds) + 1), lora_config(policy)  # before the clock
                called = time.time()
                report = sender.send(tensors, config)
                returned = time.time()
                rounds.append(
                    {
                        "version": report.version,
                        "bytes": report.bytes,
                        "send_call_s": returned - called,
                        "round_to_live_everywhere_s": live_everywhere(servers, report.version) - called,
                    }
                )
                time.sleep(args.gap)
            end = time.time()
            tokens = stream.tokens_between(start, end)
            phases.append(
                {"syncing": syncing, "seconds": end - start, "tokens": tokens, "tokens_per_s": tokens / (end - start)}
            )
            print(json.dumps(phases[-1]))
        stream.stop()
        memory_after = [memory_kib(server.proc.pid) for server in servers]
        sender.close()
    finally:
        for server in servers:
            server.stop()

    def median(values):
        return statistics.median(values) if values else None

    without = [p["tokens_per_s"] for p in phases if not p["syncing"]]
    during = [p["tokens_per_s"] for p in phases if p["syncing"]]
    summary = {
        "replicas": args.replicas,
        "round_bytes": rounds[0]["bytes"] if rounds else None,
        "rounds": len(rounds),
        "round_to_live_everywhere_median_s": median([r["round_to_live_everywhere_s"] for r in rounds]),
        "send_call_median_s": median([r["send_call_s"] for r in rounds]),
        "tokens_per_s_without_rounds": without,
        "tokens_per_s_during_rounds": during,
        "tokens_per_s_ratio_during_over_without": (sum(during) / len(during)) / (sum(without) / len(without))
        if during and sum(without)
        else None,  # none without a stream (--clients 0: rounds alone)
        "stream_errors": stream.errors,
        "http_process_memory_kib_before": memory_before,
        "http_process_memory_kib_after": memory_after,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "phases": phases, "rounds": rounds}, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
