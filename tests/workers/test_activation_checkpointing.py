"""trainer.gradientCheckpointing: activations are recomputed in the backward pass instead of kept (long
completions fit), and the update is the same as without. Peak memory per token, with and without, is measured in
bench/memory_bench.py (BENCHMARKS.md), not here."""

from __future__ import annotations

import torch

from grpolora.api.load import parse_job
from grpolora.workers.models import resolve_model
from grpolora.workers.trainer.policy import Policy, build_batch
from grpolora.workers.trainer.step import make_optimizer, train_step
from tests.helpers import job_doc


def updated(checkpointing: bool) -> tuple[Policy, dict[str, torch.Tensor]]:
    spec = parse_job(
        job_doc(
            model={"name": "offline:tiny-llama", "dtype": "float32"},
            lora={"rank": 8, "alpha": 16},
            grpo={"learningRate": 1e-2, "microBatchSize": 2, "klCoef": 0.05, "maxGradNorm": 1e6},
            trainer={"gpusPerReplica": 0, "gradientCheckpointing": checkpointing},
            inference={"gpusPerReplica": 0},
        )
    ).spec
    policy = Policy(resolve_model("offline:tiny-llama"), spec, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    vocabulary = policy.model.config.vocab_size
    sequences = [
        (torch.randint(0, vocabulary, (5,), generator=g).tolist(), torch.randint(0, vocabulary, (7,), generator=g)
         .tolist(), (-torch.rand(7, generator=g)).tolist()) for _ in range(4)
    ]  # fmt: skip
    batch = build_batch(sequences, [1.0, -1.0, 0.5, -0.5], policy.tokenizer.pad_token_id)
    train_step(policy, make_optimizer(policy, spec.grpo), batch, spec.grpo, on_policy=True)
    return policy, {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


def test_gradient_checkpointing_recomputes_activations_and_changes_no_update():
    plain, expected = updated(False)
    checkpointed, got = updated(True)
    assert checkpointed.model.get_base_model().is_gradient_checkpointing
    assert not plain.model.get_base_model().is_gradient_checkpointing
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(v, torch.zeros_like(v)) for n, v in expected.items() if "lora_B" in n)  # it moved
