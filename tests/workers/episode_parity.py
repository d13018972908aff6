"""A multi-turn episode on a real vLLM engine and the trainer's logprobs of it (issue 39's parity check): vLLM
generates two assistant turns with the environment's tokens between them (the second turn's prompt is the whole
episode so far, as EpisodeRunner sends it); the trainer's Policy, given the sample as scoring builds it (opening as
prompt, loss mask over the rest), must give vLLM's logprobs at every assistant token. Used inside an engine test
that already runs (test_adapters_from_memory.py), so the suite starts no engine for it."""

from __future__ import annotations

import torch

from grpolora.api.spec import GRPOLoraJobSpec
from grpolora.workers.environments import Opening
from grpolora.workers.environments.episode import ChatDelta, EpisodeTokens
from grpolora.workers.inference.vllm_engine import SamplingRequest
from grpolora.workers.trainer.policy import Policy, build_batch
from grpolora.workers.trainer.scoring import with_loss_masks

TURN = SamplingRequest(n=1, temperature=1.0, top_p=1.0, max_tokens=6, seed=11)
OPENING = Opening([{"role": "user", "content": "What is 12 * 7? Use <calc>...</calc>."}])
TOOL_ANSWER = [{"role": "tool", "content": "<result>84</result>"}]


async def multi_turn_episode(engine, lora, model_dir) -> EpisodeTokens:
    """Two assistant turns sampled by `engine` under `lora`, a tool's answer between them, token in, token out."""
    from transformers import AutoTokenizer

    delta = ChatDelta(AutoTokenizer.from_pretrained(model_dir))
    episode = EpisodeTokens(delta.opening(OPENING))
    for turn in range(2):
        [sample] = await engine.generate(episode.ids, TURN, lora)
        episode.add_assistant(sample.token_ids, sample.logprobs, None)
        if turn == 0:
            episode.add_environment(delta.environment_turn(sample.token_ids, TOOL_ANSWER))
    return episode


def trainer_episode_delta(model_dir, adapter: dict[str, torch.Tensor], episode: EpisodeTokens) -> float:
    """Largest |trainer logprob - vLLM logprob| over the episode's assistant tokens, the trainer being the job's
    Policy (float32, the tests' LoRA shape: rank 8, alpha 16, all linear layers) with `adapter` loaded."""
    from peft import set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    assert 0 in episode.mask[episode.mask.index(1) :] and episode.mask[-1] == 1, "environment tokens between turns"
    spec = GRPOLoraJobSpec.model_validate(
        {"model": {"name": str(model_dir), "dtype": "float32"}, "lora": {"rank": 8, "alpha": 16}}
    )
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = Policy.from_model(base, spec, device=torch.device("cpu"))
    set_peft_model_state_dict(policy.model, adapter)
    batch = build_batch([(episode.opening, episode.tokens, episode.logprobs)], [0.0], pad_id=0)
    batch = with_loss_masks(batch, [len(episode.opening)], [episode.mask])
    with torch.no_grad():
        logp = policy.logprobs(batch)
    keep = batch.completion_mask.bool()
    assert int(keep.sum()) == sum(episode.mask)
    return float((logp[keep] - batch.behaviour_logprobs[keep]).abs().max())
