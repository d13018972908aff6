"""Evidence for pinning an episode to one adapter version (issue 46 item 8; vLLM's maintainers asked for it): the
trainer-vs-vLLM logprob mismatch of episodes whose turns all ran under one adapter version, against episodes whose
turns span an update (the first turn under version 0, the base model, the second under version 1, a trained
adapter), all scored by the trainer under the episode's recorded version (the oldest that served it, as the runner
records it). One real vLLM CPU engine and the trainer's own Policy (SmolLM2-135M-Instruct, float32):

    python bench/episode_pinning.py --adapter RUN/calculator-episodes/final-adapter [--episodes 8]
                                    [--out bench/results/episode_pinning.json]

`--adapter`: a LoRA adapter the project trained for examples/calculator-episodes.yaml's model (rank 16, alpha 32,
all linear layers), e.g. the final adapter of `grpolora run examples/calculator-episodes.yaml` (its steps are the
update between the versions). Each episode: the calculator's opening for an arithmetic prompt, an assistant turn of
at most 24 tokens, the tool's answer, a second turn (temperature 1, a seed per episode). Reported per mode, over the
assistant tokens: the mean and largest |trainer - vLLM| logprob, and the share of tokens whose importance ratio
exp(trainer - vLLM) falls outside PPO's clip range [0.8, 1.2].
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: the repo's operator/ must not shadow stdlib

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", type=Path, required=True)
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "episode_pinning.json")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from grpolora.api.load import load_jobs
    from grpolora.workers import adapter as adapter_io
    from grpolora.workers.environments.calculator import CalculatorEnvironment
    from grpolora.workers.environments.episode import ChatDelta, EpisodeTokens
    from grpolora.workers.inference.adapter_book import OwnEngineBook
    from grpolora.workers.inference.vllm_engine import SamplingRequest, config_for, cpu_engine_env
    from grpolora.workers.models import resolve_model
    from grpolora.workers.tasks.arithmetic import ArithmeticTask
    from grpolora.workers.trainer.policy import Policy, build_batch
    from grpolora.workers.trainer.scoring import with_loss_masks

    (job,) = load_jobs(ROOT / "examples" / "calculator-episodes.yaml")
    spec = job.spec
    model_dir = str(resolve_model(spec.model.name, spec.model.revision))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    delta = ChatDelta(tokenizer)
    tensors, config = adapter_io.load_adapter(args.adapter)
    prompts = [p for _, p in zip(range(args.episodes), ArithmeticTask().prompts(0), strict=False)]
    answer = [{"role": "tool", "content": "<result>0</result>"}]

    async def play() -> dict[str, list[EpisodeTokens]]:
        cpu_engine_env(spec)
        engine = OwnEngineBook(config_for(spec, model_dir))
        await engine.start()
        try:
            await asyncio.to_thread(engine.activate, 1, tensors, config)
            played: dict[str, list[EpisodeTokens]] = {"pinned": [], "spanning": []}
            for i, prompt in enumerate(prompts):
                opening = delta.opening(CalculatorEnvironment().reset(prompt))
                for mode, versions in (("pinned", (0, 0)), ("spanning", (0, 1))):
                    episode = EpisodeTokens(list(opening))
                    for turn, version in enumerate(versions):
                        request = SamplingRequest(1, 1.0, 1.0, 24, seed=1000 * i + turn)
                        [sample] = await engine.generate(episode.ids, request, version)
                        episode.add_assistant(sample.token_ids, sample.logprobs, None)
                        if turn == 0:
                            episode.add_environment(delta.environment_turn(sample.token_ids, answer))
                    played[mode].append(episode)
            return played
        finally:
            engine.shutdown()

    played = asyncio.run(play())
    # The trainer at the episode's recorded version: the oldest that served it, version 0 (the base: LoRA B = 0).
    policy = Policy(Path(model_dir), spec, device=torch.device("cpu"))

    def deltas(episodes: list[EpisodeTokens]) -> tuple[list[float], list[float]]:
        every, second = [], []
        for episode in episodes:
            batch = build_batch([(episode.opening, episode.tokens, episode.logprobs)], [0.0], pad_id=0)
            batch = with_loss_masks(batch, [len(episode.opening)], [episode.mask])
            with torch.no_grad():
                logp = policy.logprobs(batch)
            keep = batch.completion_mask.bool()
            gaps = (logp[keep] - batch.behaviour_logprobs[keep]).tolist()
            every += gaps
            first_turn = episode.mask.index(0)  # the first environment token ends the first turn
            second += gaps[first_turn:]
        return every, second

    result: dict = {"command": "python " + " ".join(sys.argv), "episodes": args.episodes, "modes": {}}
    for mode, episodes in played.items():
        every, second = deltas(episodes)

        def figures(gaps: list[float]) -> dict[str, float]:
            clipped = sum(not 0.8 <= math.exp(g) <= 1.2 for g in gaps)
            return {"tokens": len(gaps), "mean_abs": statistics.fmean(abs(g) for g in gaps),
                    "max_abs": max(abs(g) for g in gaps), "outside_clip": clipped / len(gaps)}  # fmt: skip

        result["modes"][mode] = {"all_turns": figures(every), "second_turn": figures(second)}
        print(mode, json.dumps(result["modes"][mode]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
