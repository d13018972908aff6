"""Evaluation: held-out prompts through the inference replicas (one completion each, greedy by default), scored by
the task's reward. The controller runs it every `eval.everySteps` and after the last step; `grpolora eval` runs it
for a saved adapter against the base model.

Held-out prompts: a dataset's `eval` split or file; for a built-in task, the first prompts of another stream
(seed grpo.seed + EVAL_SEED_OFFSET), the same at every evaluation (a generated task may still repeat a training
problem by chance).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice

from grpolora.api.spec import GRPOLoraJobSpec
from grpolora.workers.tasks import Prompt, Task
from grpolora.workers.trainer.rollout import RolloutClient, Sampling

EVAL_SEED_OFFSET = 1_000_003


def held_out(task: Task, spec: GRPOLoraJobSpec) -> list[Prompt]:
    """The evaluation prompts of a job (at most eval.maxPrompts), the same every time."""
    assert spec.eval is not None
    limit = spec.eval.max_prompts
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
        return result


def evaluate(
    prompts: Sequence[Prompt],
    *,
    task: Task,
    tokenize: Callable[[Prompt], list[int]],
    rollouts: RolloutClient,
    spec: GRPOLoraJobSpec,
    version: int | None,
    replicas: Sequence[int],
) -> EvalResult:
    """Generate one completion per prompt with adapter `version` (None: what the replicas serve) and score it."""
    assert spec.eval is not None
    started = time.perf_counter()
    sampling = Sampling(
        n=1,
        temperature=spec.eval.temperature,
        top_p=1.0,
        max_tokens=spec.eval.max_new_tokens or spec.grpo.max_new_tokens,
    )
    completions = rollouts.generate([tokenize(p) for p in prompts], sampling, version=version or 0, replicas=replicas)
    texts = [group[0] for group in completions]
    scores = task.score([(p, c.text) for p, c in zip(prompts, texts, strict=True)])
    return EvalResult(
        reward_mean=statistics.fmean(scores.total),
        reward_std=statistics.pstdev(scores.total),
        parts={label: statistics.fmean(values) for label, values in scores.parts.items()},
        completion_length_mean=statistics.fmean(len(c.token_ids) for c in texts),
        prompts=len(prompts),
        version=min(c.version for c in texts),
        seconds=time.perf_counter() - started,
    )
