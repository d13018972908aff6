"""GPU figures at scale: the trainer step, the adapter sync's gather + pack + payload MAC, and the bytes per round
against the full weights, for a real-sized model with random weights (no download, no vLLM).

    python bench/gpu_scale.py                              # Qwen3-8B's architecture, bf16, on cuda
    python bench/gpu_scale.py --config tiny --device cpu   # what the test runs (seconds)
    python bench/gpu_scale.py --config my-config.json      # any HF causal-LM config dict (with "model_type")

Needs only torch, transformers and peft. The model is built from a config dict written below (Qwen3-8B's
numbers, from its published config.json) with random weights, directly on the device; everything after that is
this project's code: `Policy.from_model` (the LoRA wrapping, the selective logprob head), `train_step` (reference
pass at klCoef > 0, policy forward, GRPO loss, backward, clip, AdamW) on a batch from `build_batch`, and for the
sync what `AdapterSender.send` does before its transfer: `lora_tensors` (the gather) and `wire.pack`, which copies
them in the model's dtype (the float32 master weights travel as bf16 in a bf16 model) into `sync.bucketMiB`
buckets on the transport's device with the payload's MAC (on the host: a GPU's buckets are copied there piece by
piece), then that MAC again as a receiver checks it. The transfer
itself is measured on CPUs by bench/sync_bench.py; on GPUs it is NCCL's bandwidth.

Writes one JSON (default bench/results/gpu_scale.json); the bytes per round are the sum of the wire buckets, as
`RoundReport.bytes` counts them (the adapter's parameter bytes plus at most 63 alignment bytes per tensor).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: the repo's operator/ must not shadow stdlib

import torch

from grpolora.api.load import load_jobs
from grpolora.api.spec import GRPOLoraJobSpec
from grpolora.workers.adapter import lora_b_scales, lora_config, lora_tensors
from grpolora.workers.sync import wire
from grpolora.workers.trainer.policy import DTYPES, Batch, Policy, build_batch
from grpolora.workers.trainer.step import make_optimizer, train_step

ROOT = Path(__file__).resolve().parents[1]
KEY = wire.round_key("bench")  # any job token: the MAC costs the same

# Qwen/Qwen3-8B config.json (architecture fields; 8.19B parameters, untied embeddings).
QWEN3_8B: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "tie_word_embeddings": False,
}
# The same architecture at toy size, for the CPU test.
TINY: dict[str, Any] = QWEN3_8B | {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
}
CONFIGS = {"qwen3-8b": QWEN3_8B, "tiny": TINY}


def model_config(name_or_path: str) -> tuple[str, dict[str, Any]]:
    if name_or_path in CONFIGS:
        return name_or_path, CONFIGS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise SystemExit(f"--config: {name_or_path!r} is neither one of {sorted(CONFIGS)} nor a JSON file")
    config = json.loads(path.read_text())
    if not isinstance(config, dict) or "model_type" not in config:
        raise SystemExit(f"--config {path}: expected a JSON object with a model_type (an HF config.json)")
    return path.stem, config


def job_spec(
    *,
    dtype: str,
    rank: int,
    micro_batch: int,
    kl_coef: float,
    gradient_checkpointing: bool = False,
    micro_batch_tokens: int | None = None,
) -> GRPOLoraJobSpec:
    """The quickstart job with this run's dtype, rank and micro-batch (all-linear LoRA, alpha = 2 x rank), and
    optionally activation checkpointing and a token budget per micro-batch (long completions)."""
    (job,) = load_jobs(ROOT / "examples" / "quickstart.yaml")
    spec = job.spec
    return spec.model_copy(
        update={
            "model": spec.model.model_copy(update={"dtype": dtype}),
            "lora": spec.lora.model_copy(update={"rank": rank, "alpha": 2 * rank, "target_modules": "all-linear"}),
            "grpo": spec.grpo.model_copy(
                update={
                    "micro_batch_size": micro_batch,
                    "kl_coef": kl_coef,
                    "gradient_checkpointing": gradient_checkpointing,
                    "micro_batch_tokens": micro_batch_tokens,
                }
            ),
        }
    )


def random_batch(*, sequences: int, prompt_tokens: int, completion_tokens: int, vocab: int, seed: int) -> Batch:
    """Prompts of `prompt_tokens`, completions spread evenly from half to all of `completion_tokens` (rollouts
    end at different lengths), random token ids and behaviour logprobs, unit-normal advantages."""
    g = torch.Generator().manual_seed(seed)
    rows, advantages = [], []
    for index in range(sequences):
        length = completion_tokens // 2 + (completion_tokens - completion_tokens // 2) * (index + 1) // sequences
        prompt = torch.randint(vocab, (prompt_tokens,), generator=g).tolist()
        completion = torch.randint(vocab, (max(length, 1),), generator=g).tolist()
        rows.append((prompt, completion, (-3 * torch.rand(len(completion), generator=g)).tolist()))
        advantages.append(float(torch.randn((), generator=g)))
    return build_batch(rows, advantages, pad_id=0)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - started


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def sync_round(
    policy: Policy, version: int, bucket_bytes: int, device: torch.device, wire_dtype: torch.dtype
) -> dict[str, Any]:
    """What AdapterSender.send does before the transfer, timed step by step (the transfer is NCCL's or gloo's)."""
    gathered, gather_s = timed(lambda: lora_tensors(policy.model), device)
    config, scales = lora_b_scales(gathered, lora_config(policy.model))
    # AdapterSender.send packs a copy in the model's dtype, lora_B scaled on the way, and keeps it (a member caught
    # up later gets these bytes).
    packed, pack_s = timed(
        lambda: wire.pack(
            gathered,
            key=KEY,
            version=version,
            epoch=1,
            bucket_bytes=bucket_bytes,
            device=device,
            adapter_config=config,
            dtype=wire_dtype,
            scales=scales,
        ),
        device,
    )
    header, buckets = packed
    _, mac_s = timed(lambda: wire.verify(header, buckets, KEY), device)  # what a receiver's MAC pass costs
    return {
        "gather_seconds": gather_s,
        "pack_and_mac_seconds": pack_s,
        "mac_seconds": mac_s,
        "total_seconds": gather_s + pack_s,
        "sent": (wire.unpack(header, buckets), header, buckets),
    }


def machine(device: torch.device) -> dict[str, Any]:
    import peft
    import transformers

    info = {
        "device": str(device),
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"gpu": props.name, "gpu_memory_bytes": props.total_memory, "cuda": torch.version.cuda}
    return info


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    started = time.perf_counter()
    device = torch.device(args.device)
    name, config_dict = model_config(args.config)
    settings = dict(config_dict)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    spec = job_spec(
        dtype=args.dtype,
        rank=args.rank,
        micro_batch=args.micro_batch,
        kl_coef=args.kl_coef,
        gradient_checkpointing=args.gradient_checkpointing,
        micro_batch_tokens=args.micro_batch_tokens,
    )
    torch.manual_seed(args.seed)
    with torch.device(device):
        base, build_seconds = timed(
            lambda: AutoModelForCausalLM.from_config(config, dtype=DTYPES[spec.model.dtype]), device
        )
    full_weights_bytes = tensor_bytes(base.parameters())  # parameters() counts tied weights once
    policy = Policy.from_model(base, spec, device=device)
    optimizer = make_optimizer(policy, spec.grpo)
    batch = random_batch(
        sequences=args.prompts * args.generations,
        prompt_tokens=args.prompt_tokens,
        completion_tokens=args.completion_tokens,
        vocab=config.vocab_size,
        seed=args.seed,
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_seconds, stats = [], None
    for _ in range(args.warmup + args.steps):
        stats, seconds = timed(lambda: train_step(policy, optimizer, batch, spec.grpo, on_policy=True), device)
        step_seconds.append(seconds)
    timed_steps = step_seconds[args.warmup :]
    step_median = statistics.median(timed_steps)

    bucket_bytes = spec.sync.bucket_mib << 20
    wire_dtype = wire.dtype_named(spec.model.dtype)  # as the trainer gives its sender
    rounds = [sync_round(policy, version, bucket_bytes, device, wire_dtype) for version in range(1, args.rounds + 1)]
    kept, header, buckets = rounds[-1].pop("sent")
    for extra in rounds[:-1]:
        extra.pop("sent")
    adapter_bytes = tensor_bytes(kept.values())
    lora_parameters = sum(p.numel() for p in policy.trainable_parameters())
    tokens = int(batch.attention_mask.sum())
    return {
        "config": {"name": name, **config_dict},
        "dtype": spec.model.dtype,
        "lora": {
            "rank": spec.lora.rank,
            "alpha": spec.lora.alpha,
            "target_modules": spec.lora.target_modules,
            "tensors": len(kept),
            "parameters": lora_parameters,
            "master_dtype": str(next(iter(policy.trainable_parameters())).dtype).removeprefix("torch."),
            "dtype": str(next(iter(kept.values())).dtype).removeprefix("torch."),  # on the wire
        },
        "batch": {
            "sequences": len(batch),
            "prompt_tokens": args.prompt_tokens,
            "completion_tokens_max": args.completion_tokens,
            "completion_tokens": int(batch.completion_mask.sum()),
            "tokens": tokens,
            "micro_batch_size": spec.grpo.micro_batch_size,
            "micro_batch_tokens": spec.grpo.micro_batch_tokens,
            "gradient_checkpointing": spec.grpo.gradient_checkpointing,
            "kl_coef": spec.grpo.kl_coef,
            # Logits only at completion positions, where they provably match the full forward (Policy checks).
            "selective_logprob_head": policy._selective_head,
        },
        "step": {
            "median_seconds": step_median,
            "seconds": timed_steps,
            "warmup_seconds": step_seconds[: args.warmup],
            "tokens_per_second": tokens / step_median,
            "loss": stats.loss if stats else None,
            "grad_norm": stats.grad_norm if stats else None,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        },
        "sync": {
            "rounds": rounds,
            "median_seconds": {key: statistics.median(r[key] for r in rounds) for key in rounds[0]},
            "payload_mac": header.payload_mac_algorithm,
            "bucket_bytes": bucket_bytes,
            "buckets": len(buckets),
            "round_bytes": header.total_bytes,
            "adapter_parameter_bytes": adapter_bytes,
        },
        "full_weights_bytes": full_weights_bytes,
        "full_weights_parameters": sum(p.numel() for p in base.parameters() if not p.requires_grad),
        "full_over_round_bytes": full_weights_bytes / header.total_bytes,
        "model_build_seconds": build_seconds,
        "wall_seconds": time.perf_counter() - started,
        "machine": machine(device),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="qwen3-8b", help=f"one of {sorted(CONFIGS)}, or an HF config.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--completion-tokens", type=int, default=512)
    # 4 x up to 768 tokens keeps an 8B model's activations (no checkpointing, as the trainer runs) within 80 GB.
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--kl-coef", type=float, default=0.01, help="> 0 runs the reference pass, as by default")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="grpo.gradientCheckpointing")
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="grpo.microBatchTokens")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/gpu_scale.json")
    args = parser.parse_args(argv)
    for field in ("rank", "prompts", "generations", "prompt_tokens", "completion_tokens", "micro_batch", "steps"):
        if getattr(args, field) < 1:
            parser.error(f"--{field.replace('_', '-')} must be at least 1, got {getattr(args, field)}")
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be at least 1 and --warmup at least 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    step, sync = result["step"], result["sync"]
    print(
        f"{result['config']['name']} on {result['machine'].get('gpu', args.device)}: "
        f"step {step['median_seconds']:.2f} s "
        f"({step['tokens_per_second']:.0f} tokens/s); sync gather+copy+pack+mac "
        f"{sync['median_seconds']['total_seconds'] * 1e3:.1f} ms; {sync['round_bytes'] / 1e6:.1f} MB per round vs "
        f"{result['full_weights_bytes'] / 1e9:.2f} GB of weights; wrote {args.out} in {result['wall_seconds']:.0f} s"
    )
    return result


if __name__ == "__main__":
    main()
