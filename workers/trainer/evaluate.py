"""Evaluation: held-out prompts through the inference replicas (one completion each, greedy by default), scored by
the task's reward. The controller runs it every `eval.everySteps` and after the last step; `grpolora eval` runs it
for a saved adapter against the base model.

Held-out prompts: a dataset's `eval` split or file; for a built-in task, the first prompts of another stream
(seed grpo.seed + EVAL_SEED_OFFSET), the same at every evaluation (a generated task may still repeat a training
problem by chance).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from grpolora.api.spec import EvalSpec, GRPOLoraJobSpec
from grpolora.workers.environments.templates import job_chat_template
from grpolora.workers.tasks import Prompt, Task, TaskError, chat_messages
from grpolora.workers.trainer.rollout import Completion, Sampling

EVAL_SEED_OFFSET = 1_000_003


def held_out(task: Task, spec: GRPOLoraJobSpec) -> list[Prompt]:
    """The evaluation prompts of a job (at most eval.maxPrompts), the same every time."""
    limit = (spec.eval or EvalSpec()).max_prompts
    rows = task.eval_prompts()
    if rows is not None:
        return [rows[i] for i in range(min(limit, len(rows)))]
    return list(islice(task.prompts(spec.grpo.seed + EVAL_SEED_OFFSET), limit))


@dataclass(frozen=True)
class EvalResult:
    reward_mean: float
    reward_std: float
    parts: dict[str, float] = field(default_factory=dict)
    completion_length_mean: float = 0.0
    prompts: int = 0
    version: int = 0
    seconds: float = 0.0
    figures: dict[str, float | int] = field(default_factory=dict)
    """With spec.environment: the episodes' figures (as training reports them), prefixed `eval_`."""

    def record(self) -> dict:
        """The figures as they go into metrics.jsonl."""
        result = {
            "eval_reward": self.reward_mean,
            "eval_reward_std": self.reward_std,
            "eval_completion_length_mean": self.completion_length_mean,
            "eval_prompts": self.prompts,
        }
        if self.parts:
            result["eval_rewards"] = dict(self.parts)
        return result | self.figures


Generate = Callable[[Sequence[Prompt], list[list[int]], Sampling], list[list[Completion]]]
"""Completions for the prompts (and their token ids): the inference replicas over HTTP (training; with
spec.environment, one episode per prompt), or an engine in this process (`grpolora eval`)."""


def tokenize_prompt(
    tokenizer, prompt: Prompt, system_prompt: str | None, template_args: Mapping[str, Any] | None = None
) -> list[int]:
    """A prompt's token ids as the replicas get them: its chat rendered with the template, generation prompt added,
    and `template_args` (spec.task.chatTemplateArgs, e.g. enable_thinking) passed to the template. The replicas
    receive these ids, never the text, so generation and training see the same prompt tokens."""
    text = tokenizer.apply_chat_template(
        chat_messages(prompt, system_prompt), tokenize=False, add_generation_prompt=True, **(template_args or {})
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def evaluate(
    prompts: Sequence[Prompt],
    *,
    task: Task,
    tokenize: Callable[[Prompt], list[int]],
    generate: Generate,
    spec: GRPOLoraJobSpec,
) -> EvalResult:
    """Generate one completion (or, with spec.environment, play one episode) per prompt and score it as training
    scores its rollouts (scoring.scores_of: an episode's own reward wins; an unscorable one is left out)."""
    from grpolora.workers.trainer.scoring import Rollouts, episode_figures, scores_of

    evaluation = spec.eval or EvalSpec()
    started = time.perf_counter()
    sampling = Sampling(
        n=1,
        temperature=evaluation.temperature,
        top_p=1.0,
        max_tokens=evaluation.max_new_tokens or spec.grpo.max_new_tokens,
        stop=tuple(spec.grpo.stop),  # the answer format the rollouts were trained to end with
    )
    ids = [tokenize(p) for p in prompts]
    groups = generate(prompts, ids, sampling)
    rollouts = Rollouts(list(prompts), ids, [group[:1] for group in groups], 0.0)
    scores = scores_of(task, rollouts)
    scored = [r for r in scores.total if not math.isnan(r)] or [0.0]  # unscorable ones (NaN) are left out
    texts = [group[0] for group in rollouts.completions]
    figures = {f"eval_{name}": value for name, value in episode_figures(rollouts).items()}
    return EvalResult(
        reward_mean=statistics.fmean(scored),
        reward_std=statistics.pstdev(scored),
        parts=scores.part_means(),
        completion_length_mean=statistics.fmean(len(c.token_ids) for c in texts),
        prompts=len(prompts),
        version=min(c.version for c in texts),
        seconds=time.perf_counter() - started,
        figures=figures,
    )


def offline(spec: GRPOLoraJobSpec, adapter_dir: Path, root: Path | None = None) -> dict[str, EvalResult]:
    """`grpolora eval`: the job's evaluation for the base model and for a saved adapter, in one vLLM engine in
    this process (adapter version 1 next to the base, version 0). Returns {"base": ..., "adapter": ...}."""
    from transformers import AutoTokenizer

    from grpolora.workers import adapter as adapter_io
    from grpolora.workers.inference.adapter_book import OwnEngineBook
    from grpolora.workers.inference.vllm_engine import SamplingRequest, config_for, cpu_engine_env
    from grpolora.workers.models import resolve_model
    from grpolora.workers.tasks import load_task

    if spec.environment is not None:
        raise TaskError("spec.environment", "`grpolora eval` does not play episodes yet; the job's own evaluation "
                        "(spec.eval, on the replicas during training) does")  # fmt: skip
    task = load_task(spec.task, root=root)
    try:
        prompts = held_out(task, spec)
        model_dir = str(resolve_model(spec.model.name, spec.model.revision))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if (template := job_chat_template(spec.task)) is not None:
            tokenizer.chat_template = template
        tensors, config = adapter_io.load_adapter(adapter_dir)
        cpu_engine_env(spec)
        engine = OwnEngineBook(config_for(spec, model_dir))

        async def run() -> dict[str, EvalResult]:
            await engine.start()
            try:
                await asyncio.to_thread(engine.activate, 1, tensors, config)  # it waits on this loop
                loop = asyncio.get_running_loop()
                results = {}
                for name, version in (("base", 0), ("adapter", 1)):

                    def generate(_prompts, ids: list[list[int]], sampling: Sampling, version: int = version):
                        request = SamplingRequest(sampling.n, sampling.temperature, sampling.top_p,
                                                  sampling.max_tokens, stop=sampling.stop)  # fmt: skip
                        futures = [
                            asyncio.run_coroutine_threadsafe(engine.generate(p, request, version), loop) for p in ids
                        ]
                        return [
                            [Completion(s.token_ids, s.logprobs, s.text, s.finish_reason, version) for s in f.result()]
                            for f in futures
                        ]

                    results[name] = await asyncio.to_thread(
                        evaluate,
                        prompts,
                        task=task,
                        tokenize=lambda p: tokenize_prompt(
                            tokenizer, p, spec.task.system_prompt, spec.task.chat_template_args
                        ),
                        generate=generate,
                        spec=spec,
                    )
                return results
            finally:
                engine.shutdown()

        return asyncio.run(run())
    finally:
        task.close()
