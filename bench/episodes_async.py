"""Episodes that advance on their own against lockstep turns (issue 46 item 4), in one run on one real vLLM CPU
engine (SmolLM2-135M-Instruct, examples/calculator-episodes.yaml's serving settings):

    python bench/episodes_async.py [--episodes 16] [--turns 4] [--max-new-tokens 16] [--repeats 2]
                                   [--out bench/results/episodes_async.json]

Each episode's environment answers every turn after a step time drawn once per (episode, turn) from a uniform
0.1-2 s (a tool call, a sandbox, a web request: it sleeps, as I/O does), the same draws in both modes; an episode
runs --turns assistant turns of a word or so (stop strings; at most --max-new-tokens tokens, temperature 1, a seed per
episode and turn), so that the environments' step times dominate and the comparison is of scheduling. The
runner is the trainer's own (EpisodeRunner, ChatDelta); generation goes to the engine in this process the way the
replicas' /v1/generate does (one request per episode and turn, each awaited in the engine's loop, which batches
whatever is in flight). Modes alternate (lockstep, on their own, lockstep, ...) --repeats times each; the verdict
compares the median episodes per second of each mode against the goal of 1.5x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: the repo's operator/ must not shadow stdlib

from grpolora.api.load import load_jobs
from grpolora.workers.environments import Reply
from grpolora.workers.environments.episode import ChatDelta
from grpolora.workers.environments.runner import EpisodeLimits, EpisodeRunner
from grpolora.workers.tasks import Prompt
from grpolora.workers.trainer.rollout import Completion, Sampling

ROOT = Path(__file__).resolve().parents[1]
STEP_SECONDS = (0.1, 2.0)
# A turn is a word or so (it stops at a space, a full stop or a new line): a turn that runs to max_tokens ends its
# episode (truncated), and short turns keep the comparison on the scheduling of the environments' step times.
STOP = (" ", ".", "\n")


class Paced:
    """An environment whose step takes a drawn time, then asks the model to go on."""

    def __init__(self, index: int, seed: int):
        self.index, self.seed, self.turn = index, seed, 0

    def reset(self, prompt):
        return [{"role": "user", "content": prompt.text}]

    def step(self, message):
        self.turn += 1
        time.sleep(random.Random(self.seed * 100_003 + self.index * 1_009 + self.turn).uniform(*STEP_SECONDS))
        return Reply([{"role": "user", "content": "Next word:"}])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "episodes_async.json")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from grpolora.workers.inference.adapter_book import OwnEngineBook
    from grpolora.workers.inference.vllm_engine import SamplingRequest, config_for, cpu_engine_env
    from grpolora.workers.models import resolve_model

    (job,) = load_jobs(ROOT / "examples" / "calculator-episodes.yaml")
    spec = job.spec
    model_dir = str(resolve_model(spec.model.name, spec.model.revision))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cpu_engine_env(spec)
    engine = OwnEngineBook(config_for(spec, model_dir))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="engine-loop", daemon=True).start()
    asyncio.run_coroutine_threadsafe(engine.start(), loop).result()

    def generate(_replica, prompts, sampling: Sampling, seeds):
        futures = [
            asyncio.run_coroutine_threadsafe(engine.generate(ids, SamplingRequest(
                1, sampling.temperature, sampling.top_p, sampling.max_tokens, seed=seed, stop=STOP), 0), loop)
            for ids, seed in zip(prompts, seeds, strict=True)
        ]  # fmt: skip
        return [
            next(Completion(s.token_ids, s.logprobs, s.text, s.finish_reason, 0) for s in f.result()) for f in futures
        ]

    prompt = Prompt("Let us write a story together, one word at a time. Your word:")
    limits = EpisodeLimits(args.turns, 512, args.max_new_tokens, 30.0)  # the example's maxModelLen
    sampling = Sampling(args.episodes, 1.0, 1.0, args.max_new_tokens)
    runs: list[dict] = []
    try:
        hello = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                              add_generation_prompt=True)  # fmt: skip
        generate(0, [tokenizer(hello, add_special_tokens=False)["input_ids"]], sampling, [0])  # warm-up
        for repeat in range(args.repeats):
            for lockstep in (True, False):
                made = iter(range(args.episodes))
                runner = EpisodeRunner(lambda made=made: Paced(next(made), args.seed), ChatDelta(tokenizer), limits,
                                       lockstep=lockstep)  # fmt: skip
                started = time.perf_counter()
                [group] = runner.run([prompt], [[1]], [args.seed], sampling, generate, [0], version=0)
                seconds = time.perf_counter() - started
                runner.close()
                turns = [c.episode.turns for c in group]
                tokens = sum(sum(c.episode.loss_mask) for c in group)
                errors = sum(c.episode.error is not None for c in group)
                run = {"mode": "lockstep" if lockstep else "own", "repeat": repeat, "seconds": round(seconds, 2),
                       "episodes_per_second": round(args.episodes / seconds, 4), "turns": sum(turns),
                       "generated_tokens": tokens, "errors": errors}  # fmt: skip
                runs.append(run)
                print(json.dumps(run), flush=True)
    finally:
        engine.shutdown()
    medians = {
        mode: statistics.median(r["episodes_per_second"] for r in runs if r["mode"] == mode)
        for mode in ("lockstep", "own")
    }
    ratio = medians["own"] / medians["lockstep"]
    result = {
        "command": "python " + " ".join(sys.argv),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "step_seconds": STEP_SECONDS,
        "runs": runs,
        "median_episodes_per_second": medians,
        "ratio": round(ratio, 3),
        "goal": 1.5,
        "verdict": "met" if ratio >= 1.5 else "missed",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median_episodes_per_second", "ratio", "verdict")}))


if __name__ == "__main__":
    main()
