"""PEFT options and their limits: rsLoRA scaled the same by peft (trainer) and vLLM (replicas), and DoRA and
modules_to_save refused with the reason (vLLM cannot serve them). A target module the model lacks:
tests/workers/test_trainer_pod.py."""

from __future__ import annotations

import math

import pytest
import torch

from grpolora.api.load import InvalidJob, parse_job
from grpolora.workers.adapter import lora_config
from grpolora.workers.models import resolve_model
from grpolora.workers.trainer.policy import Policy
from tests.helpers import job_doc


def tiny_policy(**lora) -> Policy:
    spec = parse_job(job_doc(model={"name": "offline:tiny-llama", "dtype": "float32"}, lora=lora)).spec
    return Policy(resolve_model("offline:tiny-llama"), spec, device=torch.device("cpu"))


def test_rslora_is_scaled_alike_by_the_trainer_and_by_vllm():
    from vllm.lora.peft_helper import PEFTHelper

    policy = tiny_policy(rank=16, alpha=32, rslora=True)
    layer = next(m for m in policy.model.modules() if hasattr(m, "scaling") and isinstance(m.scaling, dict))
    assert layer.scaling["default"] == pytest.approx(32 / math.sqrt(16))  # rsLoRA: alpha / sqrt(r), not alpha / r
    config = lora_config(policy.model)
    assert config["use_rslora"] is True
    helper = PEFTHelper.from_dict(config)  # what the replicas build the adapter from
    assert helper.vllm_lora_scaling_factor == pytest.approx(32 / math.sqrt(16))
    plain = PEFTHelper.from_dict(lora_config(tiny_policy(rank=16, alpha=32).model))
    assert plain.vllm_lora_scaling_factor == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("field", "why"),
    [("useDora", "vLLM cannot serve DoRA adapters"), ("modulesToSave", "vLLM cannot serve modules_to_save")],
)
def test_peft_options_vllm_cannot_serve_are_refused_with_the_reason(field, why):
    with pytest.raises(InvalidJob) as refused:
        parse_job(job_doc(lora={"rank": 8, field: True}))
    (problem,) = refused.value.problems
    assert problem.path == f"spec.lora.{field}" and why in problem.message
