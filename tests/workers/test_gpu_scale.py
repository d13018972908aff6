"""bench/gpu_scale.py, the GPU-at-scale figures, runs here on CPU at a toy config of the same architecture: its
JSON carries every figure, and the byte counts are the model's and the adapter's own (checked against counts
worked out from the config by hand, which also give the Qwen3-8B figures quoted in BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from grpolora.workers.sync import wire

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_scale", ROOT / "bench" / "gpu_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def linear_shapes(config: dict) -> list[tuple[int, int]]:
    """(in, out) of every linear layer a decoder layer of a Qwen3/Llama-style model has (what all-linear wraps)."""
    hidden, heads, kv, head_dim = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    inter = config["intermediate_size"]
    query, key_value = heads * head_dim, kv * head_dim
    attention = [(hidden, query), (hidden, key_value), (hidden, key_value), (query, hidden)]
    return [*attention, (hidden, inter), (hidden, inter), (inter, hidden)]


def model_parameters(config: dict) -> int:
    """Embedding, output head (unless tied), per layer its linears, two RMSNorms and Qwen3's q/k norms, final norm."""
    per_layer = sum(i * o for i, o in linear_shapes(config)) + 2 * config["hidden_size"] + 2 * config["head_dim"]
    embedding = config["vocab_size"] * config["hidden_size"]
    heads = 1 if config["tie_word_embeddings"] else 2
    return heads * embedding + config["num_hidden_layers"] * per_layer + config["hidden_size"]


def lora_parameters(config: dict, rank: int) -> int:
    """A [r, in] and B [out, r] per wrapped linear (the output head is not one of peft's all-linear targets)."""
    return config["num_hidden_layers"] * sum(rank * (i + o) for i, o in linear_shapes(config))


def test_the_config_counts_are_qwen3_8b():
    script = load_script()
    assert model_parameters(script.QWEN3_8B) == 8_190_735_360  # "8.2B"; 16.4 GB in bfloat16
    assert lora_parameters(script.QWEN3_8B, 16) == 43_646_976  # 174.6 MB in float32, 87.3 MB in bfloat16


def test_tiny_run_writes_every_figure(tmp_path):
    script = load_script()
    out = tmp_path / "gpu_scale.json"
    argv = ["--config", "tiny", "--device", "cpu", "--prompts", "2", "--generations", "3", "--prompt-tokens", "6"]
    argv += ["--completion-tokens", "9", "--micro-batch", "4", "--steps", "2", "--rounds", "2", "--out", str(out)]
    argv += ["--gradient-checkpointing", "--micro-batch-tokens", "40"]  # the long-completion options reach the step
    script.main(argv)
    result = json.loads(out.read_text())
    config, rank = script.TINY, 16

    assert result["config"]["name"] == "tiny" and result["dtype"] == "bfloat16"
    batch = result["batch"]
    assert batch["sequences"] == 6 and batch["micro_batch_size"] == 4
    assert batch["gradient_checkpointing"] is True and batch["micro_batch_tokens"] == 40
    assert isinstance(batch["selective_logprob_head"], bool)
    # completions spread from half to all of the maximum: 4 + (9 - 4) * (i + 1) // 6 tokens for i = 0..5
    completions = [4 + 5 * (i + 1) // 6 for i in range(6)]
    assert batch["completion_tokens"] == sum(completions)
    assert batch["tokens"] == 6 * 6 + sum(completions)

    step = result["step"]
    assert len(step["seconds"]) == 2 and step["median_seconds"] > 0
    assert step["tokens_per_second"] == pytest.approx(batch["tokens"] / step["median_seconds"])
    assert math.isfinite(step["loss"]) and step["grad_norm"] > 0  # a real update ran

    lora = result["lora"]
    assert lora["parameters"] == lora_parameters(config, rank)
    assert lora["tensors"] == 2 * len(linear_shapes(config)) * config["num_hidden_layers"]
    # peft keeps LoRA weights float32 over a bfloat16 base (the trainer's master weights); a round sends them in the
    # model's dtype, as AdapterSender.send does: half the bytes.
    assert lora["master_dtype"] == "float32" and lora["dtype"] == "bfloat16"

    sync = result["sync"]
    assert sync["adapter_parameter_bytes"] == 2 * lora["parameters"]
    # The wire adds at most 63 alignment bytes per tensor (none here: every tensor is a multiple of 64 bytes).
    assert 0 <= sync["round_bytes"] - sync["adapter_parameter_bytes"] < 64 * lora["tensors"]
    assert sync["payload_mac"] == wire.PAYLOAD_MAC_ALGORITHM and sync["buckets"] >= 1
    assert len(sync["rounds"]) == 2
    for round_ in sync["rounds"]:
        parts = round_["gather_seconds"] + round_["pack_and_mac_seconds"]
        assert round_["total_seconds"] == pytest.approx(parts)
        assert round_["mac_seconds"] > 0

    assert result["full_weights_parameters"] == model_parameters(config)
    assert result["full_weights_bytes"] == 2 * model_parameters(config)
    assert result["full_over_round_bytes"] == pytest.approx(result["full_weights_bytes"] / sync["round_bytes"])
    assert result["machine"]["device"] == "cpu" and result["machine"]["peft"]


def test_a_bad_config_is_named(tmp_path):
    script = load_script()
    with pytest.raises(SystemExit, match="--config"):
        script.main(["--config", str(tmp_path / "missing.json"), "--device", "cpu"])
    (tmp_path / "no_type.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(SystemExit, match="model_type"):
        script.main(["--config", str(tmp_path / "no_type.json"), "--device", "cpu"])
