"""The GRPO recipe's knobs of issue 37 at the schema: what `grpolora validate` warns about or refuses."""

from __future__ import annotations

import pytest

from grpolora.api.load import InvalidJob, job_warnings, parse_job
from tests.helpers import job_doc


def _warnings(path: str, **grpo) -> list[str]:
    return [w.message for w in job_warnings(parse_job(job_doc(grpo=grpo))) if w.path == path]


def test_gspo_on_the_token_mean_loss_is_warned_about():
    # GSPO's sequence-level ratio gives every token of a completion the same clipped weight; a token-mean loss then
    # sums over tokens, so a completion weighs in proportion to its length (TRL warns of the same; verl forces
    # per-sequence averaging with GSPO).
    [message] = _warnings("spec.grpo.importanceRatio", importanceRatio="sequence")
    assert "lossAggregation: token-mean" in message and "sequence-mean" in message and "length" in message
    assert not _warnings("spec.grpo.importanceRatio", importanceRatio="sequence", lossAggregation="sequence-mean")
    assert not _warnings("spec.grpo.importanceRatio")
    # Dr. GRPO's constant normaliser sums the tokens as well (TRL warns for dr_grpo too, grpo_trainer.py).
    [message] = _warnings("spec.grpo.importanceRatio", importanceRatio="sequence", lossAggregation="constant")
    assert "lossAggregation: constant" in message and "length" in message and "sequence-mean" in message


def test_a_cap_far_too_tight_for_sequence_level_weights_is_warned_about():
    # A sequence-level weight multiplies up to maxNewTokens token weights: at a per-token log-weight spread of 0.1
    # nats its log spreads 0.1 * sqrt(256) = 1.6 nats, so the default cap 2 (log 0.69) cuts a large share of the
    # completions; the warning names the cap that would not (exp(1.6) = 4.95).
    [message] = _warnings("spec.grpo.importanceWeightCap", importanceWeightLevel="sequence")
    assert "importanceWeightLevel: sequence" in message and "1.60 nats" in message and "4.95" in message
    assert "geometric" in message
    assert not _warnings("spec.grpo.importanceWeightCap", importanceWeightLevel="sequence", importanceWeightCap=5)
    # 16 tokens: 0.1 * 4 = 0.4 nats, exp 1.49 < 2: not warned. Nor the token and geometric levels.
    assert not _warnings("spec.grpo.importanceWeightCap", importanceWeightLevel="sequence", maxNewTokens=16)
    assert not _warnings("spec.grpo.importanceWeightCap", importanceWeightLevel="geometric")
    assert not _warnings("spec.grpo.importanceWeightCap")


def test_the_two_sided_clip_and_the_weight_floor_are_checked():
    assert parse_job(job_doc(grpo={"clipRatioMax": 4})).spec.grpo.clip_ratio_max == 4
    with pytest.raises(InvalidJob, match="clipRatioMax"):
        parse_job(job_doc(grpo={"clipRatioMax": 1.0}))
    grpo = parse_job(job_doc(grpo={"importanceWeightLevel": "geometric", "importanceWeightFloor": 0.5})).spec.grpo
    assert (grpo.importance_weight_level, grpo.importance_weight_floor) == ("geometric", 0.5)
    with pytest.raises(InvalidJob, match="importanceWeightLevel"):
        parse_job(job_doc(grpo={"importanceWeightLevel": "batch"}))
    with pytest.raises(InvalidJob, match="importanceWeightFloor"):
        parse_job(job_doc(grpo={"importanceWeightFloor": 1.5}))


def test_chat_template_args_take_scalars_only():
    task = {"name": "arithmetic", "chatTemplateArgs": {"enable_thinking": False, "reasoning_effort": "low"}}
    parsed = parse_job(job_doc(task=task)).spec.task
    assert parsed.chat_template_args == {"enable_thinking": False, "reasoning_effort": "low"}
    with pytest.raises(InvalidJob, match=r"chatTemplateArgs.*'tools'.*not a string, number or boolean"):
        parse_job(job_doc(task={"name": "arithmetic", "chatTemplateArgs": {"tools": [{"x": 1}]}}))


def test_the_replicas_reference_in_half_precision_is_warned_about():
    # referenceFrom: inference compares vLLM's kernels (the reference) with the trainer's (the policy): in bf16 they
    # disagree by far more than the KL a step moves the policy, so the KL is not 0 at step 0 (the GPU example runs
    # exactly this). float32 agrees to ~1e-5 and is not warned about.
    def warned(dtype: str) -> list[str]:
        doc = job_doc(grpo={"referenceFrom": "inference"}, model={"name": "offline:tiny-llama", "dtype": dtype})
        return [w.message for w in job_warnings(parse_job(doc)) if w.path == "spec.grpo.referenceFrom"]

    [message] = warned("bfloat16")
    assert "bfloat16" in message and "step 0" in message and "referenceFrom: trainer" in message
    assert warned("float16") and not warned("float32")
