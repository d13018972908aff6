"""The policy: the base model with a PEFT LoRA adapter; the reference policy is the same model with the adapter
disabled, so there is no second copy of the weights.

The base model runs in the spec's compute dtype; the LoRA weights stay float32 (peft's default
`autocast_adapter_dtype`), so small updates are not rounded away. With several trainer ranks the model is
sharded with FSDP2 (`fully_shard` per decoder layer and at the root); LoRA tensors are then DTensors that
`lora_tensors` gathers whole for sync and checkpoints.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from grpolora.api.spec import GRPOLoraJobSpec
from grpolora.workers.environments.templates import job_chat_template
from grpolora.workers.trainer.grpo import token_entropy, token_logprobs

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelMismatch(ValueError):
    """The spec names something the model does not have, found once the model is loaded (`grpolora validate` has
    no model at hand). The message starts with the spec field to fix; the trainer exits with EXIT_INVALID_SPEC."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")


def missing_target_modules(model: torch.nn.Module, names: list[str]) -> list[str]:
    """The names of `lora.targetModules` that match no module of `model` by peft's rule (the module's full name,
    or its last dotted parts): peft wraps the ones that match and silently skips the others."""
    modules = [name for name, _ in model.named_modules()]
    return [n for n in names if not any(m == n or m.endswith("." + n) for m in modules)]


@dataclass(frozen=True)
class Batch:
    """Sequences (prompt + completion, right-padded) and which positions are completion tokens.

    `completion_mask[b, t]` marks whether token t + 1 of sequence b is a completion token: position t's logits
    predict it. `behaviour_logprobs` are the sampler's logprobs of those tokens (zeros elsewhere);
    `reference_logprobs`, when the replicas computed them (grpo.referenceFrom: inference), the base model's.
    """

    input_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] int64
    completion_mask: torch.Tensor  # [B, T-1] float32
    behaviour_logprobs: torch.Tensor  # [B, T-1] float32
    advantages: torch.Tensor  # [B] float32
    reference_logprobs: torch.Tensor | None = None  # [B, T-1] float32
    groups: torch.Tensor | None = None  # [B] int64: each sequence's prompt group, for per-group figures

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _map(self, fn) -> Batch:
        return Batch(*(None if (t := getattr(self, f.name)) is None else fn(t) for f in fields(self)))

    def select(self, index: slice | torch.Tensor) -> Batch:
        return self._map(lambda t: t[index])

    def trimmed(self) -> Batch:
        """Without the padding columns that no sequence of this (micro-)batch uses: compute scales with length."""
        length = int(self.attention_mask.sum(dim=1).max()) if len(self) else 1
        length = max(length, 2)
        reference = self.reference_logprobs
        return Batch(
            self.input_ids[:, :length],
            self.attention_mask[:, :length],
            self.completion_mask[:, : length - 1],
            self.behaviour_logprobs[:, : length - 1],
            self.advantages,
            None if reference is None else reference[:, : length - 1],
            self.groups,
        )

    @staticmethod
    def stand_in(device: torch.device | str = "cpu", *, reference: bool = False) -> Batch:
        """One two-token sequence that counts for nothing (no completion token, advantage 0).

        A rank whose share of a step has fewer micro-batches than another's runs this instead: FSDP's all-gathers
        and reduce-scatters need every rank in every forward and backward, and an HF forward of batch size 0
        raises. Its loss is exactly 0 yet depends on the weights, so backward runs the same collectives.
        `reference`: it carries reference logprobs like the real ones, so it skips the reference pass as they do
        (the same forwards on every rank)."""
        ones = torch.ones(1, 2, dtype=torch.int64, device=device)
        zeros = torch.zeros(1, 1, dtype=torch.float32, device=device)
        advantages = torch.zeros(1, dtype=torch.float32, device=device)
        return Batch(ones, ones.clone(), zeros, zeros.clone(), advantages, zeros.clone() if reference else None)

    def by_length(self) -> Batch:
        """Sequences sorted by length, so that micro-batches of neighbours pad little."""
        return self.select(torch.argsort(self.attention_mask.sum(dim=1), stable=True))

    def to(self, device: torch.device) -> Batch:
        return self._map(lambda t: t.to(device))


def build_batch(
    sequences: list[tuple[list[int], list[int], list[float]]],
    advantages: list[float],
    pad_id: int,
    reference: list[list[float]] | None = None,
) -> Batch:
    """(prompt ids, completion ids, completion logprobs) per sequence -> a right-padded Batch; `reference`, one
    list per sequence, the completion tokens' reference logprobs where the replicas computed them."""
    if reference is not None and len(reference) != len(sequences):
        raise ValueError(f"need reference logprobs for each of the {len(sequences)} sequences, got {len(reference)}")
    length = max(len(p) + len(c) for p, c, _ in sequences)
    size = len(sequences)
    input_ids = torch.full((size, length), pad_id, dtype=torch.int64)
    attention = torch.zeros((size, length), dtype=torch.int64)
    completion = torch.zeros((size, length - 1), dtype=torch.float32)
    behaviour = torch.zeros((size, length - 1), dtype=torch.float32)
    ref = None if reference is None else torch.zeros((size, length - 1), dtype=torch.float32)
    for row, (prompt, tokens, logprobs) in enumerate(sequences):
        total = len(prompt) + len(tokens)
        input_ids[row, :total] = torch.tensor(prompt + tokens)
        attention[row, :total] = 1
        start = len(prompt) - 1  # logits at position len(prompt) - 1 predict the first completion token
        completion[row, start : start + len(tokens)] = 1.0
        behaviour[row, start : start + len(tokens)] = torch.tensor(logprobs, dtype=torch.float32)
        if ref is not None:
            given = reference[row]
            if given is None or len(given) != len(tokens):
                count = "none" if given is None else len(given)
                raise ValueError(f"sequence {row} has {len(tokens)} completion tokens and {count} reference logprobs")
            ref[row, start : start + len(tokens)] = torch.tensor(given, dtype=torch.float32)
    return Batch(input_ids, attention, completion, behaviour, torch.tensor(advantages, dtype=torch.float32), ref)


class Policy:
    def __init__(
        self,
        model_dir: Path,
        spec: GRPOLoraJobSpec,
        *,
        device: torch.device,
        shard: bool = False,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if (template := job_chat_template(spec.task)) is not None:  # every prompt and episode, not the model's
            tokenizer.chat_template = template
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[spec.model.dtype])
        self._attach(base, tokenizer, spec, device=device, shard=shard, source=str(model_dir))

    @classmethod
    def from_model(
        cls, base: torch.nn.Module, spec: GRPOLoraJobSpec, *, device: torch.device, tokenizer: Any = None
    ) -> Policy:
        """A policy over a causal LM already built in memory (e.g. randomly initialised from a config, as
        bench/gpu_scale.py does to measure a large model without downloading it); `tokenizer` may be None where
        nothing is tokenised. The LoRA wrapping, the reference and the logprobs are those of a loaded model."""
        policy = cls.__new__(cls)
        policy._attach(base, tokenizer, spec, device=device, shard=False, source=type(base).__name__)
        return policy

    def _attach(
        self, base: torch.nn.Module, tokenizer: Any, spec: GRPOLoraJobSpec, *, device: torch.device, shard: bool,
        source: str,
    ) -> None:  # fmt: skip
        from peft import LoraConfig, get_peft_model

        self.spec = spec
        self.device = device
        self.temperature = spec.grpo.temperature
        self.top_p = spec.grpo.top_p
        self.top_k = spec.grpo.top_k
        self.tokenizer = tokenizer
        base.config.use_cache = False
        lora = spec.lora
        if isinstance(lora.target_modules, list) and (missing := missing_target_modules(base, lora.target_modules)):
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)})
            raise ModelMismatch(
                "spec.lora.targetModules",
                f"{', '.join(map(repr, missing))} names no module of {spec.model.name} (its linear layers: "
                f"{', '.join(linear)})",
            )
        torch.manual_seed(spec.grpo.seed)  # LoRA A's initialisation is part of the run's reproducibility
        config = LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            use_rslora=lora.rslora,
            task_type="CAUSAL_LM",
        )
        self.model = get_peft_model(base, config).to(device)
        if spec.grpo.gradient_checkpointing:
            # Non-reentrant: gradients reach the LoRA weights without the inputs requiring grad, and it composes
            # with FSDP2. HF recomputes each decoder layer in backward (only in train mode, as train_step runs).
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # Logits only where a completion token is predicted: the output head is a large share of a small model's
        # compute (49k x 576 for SmolLM2; 151k x 1024 for Qwen3-0.6B). Used where it provably gives the same
        # numbers as the full forward (checked once here); FSDP2 runs the root module whole, so not when sharded.
        self._selective_head = not shard and self._selective_head_matches()
        if shard:
            self._fully_shard()
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        log.info("policy: %s with LoRA r=%d (%d trainable parameters)", source, lora.rank, trainable)

    def _fully_shard(self) -> None:
        from torch.distributed.fsdp import fully_shard

        layers = getattr(self.model.get_base_model().model, "layers", None)
        if layers is None:
            raise ValueError("FSDP2 sharding expects a decoder with model.layers (Llama, Qwen, Mistral, ...)")
        for layer in layers:
            fully_shard(layer)
        fully_shard(self.model)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """The reference policy: the same weights with the adapter switched off."""
        with self.model.disable_adapter():
            yield

    def logprobs(self, batch: Batch) -> torch.Tensor:
        """Per-token logprobs [B, T-1] at the sampling temperature and top-p, float32 (the same distribution vLLM
        samples); exact at completion positions, zero elsewhere when only those are computed."""
        return self._logprobs(batch, entropy=False)[0]

    def logprobs_and_entropy(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """`logprobs` and, from the same logits (no second forward), the sampling distribution's entropy at each
        position [B, T-1] (`token_entropy`; detached; zero where `logprobs` is)."""
        logp, entropy = self._logprobs(batch, entropy=True)
        assert entropy is not None
        return logp, entropy

    def _logprobs(self, batch: Batch, *, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        sampler = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        if not self._selective_head:
            logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
            logp = token_logprobs(logits, batch.input_ids[:, 1:], **sampler)
            return logp, token_entropy(logits, **sampler) if entropy else None
        causal_lm = self.model.get_base_model()
        hidden = causal_lm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        keep = batch.completion_mask.bool()
        logits = causal_lm.lm_head(hidden[:, :-1][keep])[None]  # [1, completion tokens, V]
        targets = batch.input_ids[:, 1:][keep]
        selected = token_logprobs(logits, targets[None], **sampler)[0]
        logp = torch.zeros(keep.shape, dtype=selected.dtype, device=selected.device).masked_scatter(keep, selected)
        if not entropy:
            return logp, None
        spread = token_entropy(logits, **sampler)[0]
        return logp, torch.zeros_like(logp).masked_scatter(keep, spread)

    def _selective_head_matches(self) -> bool:
        causal_lm = self.model.get_base_model()
        if not (hasattr(causal_lm, "model") and hasattr(causal_lm, "lm_head")):
            return False
        probe = torch.arange(3, 11, device=self.device)[None] % causal_lm.config.vocab_size
        batch = Batch(
            probe,
            torch.ones_like(probe),
            torch.ones(1, 7, device=self.device),
            torch.zeros(1, 7, device=self.device),
            torch.zeros(1, device=self.device),
        )
        with torch.no_grad():
            full = token_logprobs(
                self.model(input_ids=probe).logits[:, :-1],
                probe[:, 1:],
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
            )
            try:
                self._selective_head = True
                selective = self.logprobs(batch)
            except (AttributeError, TypeError, RuntimeError) as exc:
                log.info("policy: computing logits at every position (%s)", exc)
                return False
            finally:
                self._selective_head = False
        return bool(torch.allclose(full, selective, atol=1e-4, rtol=1e-3))
