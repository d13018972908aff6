"""What every task is: prompts from a seed, and a reward for a completion. Torch-free (rewards run on the CPU of
trainer rank 0, and `grpolora validate` may load a task without the ML stack)."""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

RewardFn = Callable[[str, str, "str | None"], float]
"""A reward plugin: function(prompt: str, completion: str, answer: str | None) -> float (see docs/tasks.md)."""


class TaskError(ValueError):
    """A task that cannot work, found before training starts. The message starts with the spec field to fix,
    e.g. `spec.task.dataset.path: file not found: x.jsonl`."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}")


class TaskUnreachable(TaskError):
    """A dataset file or reward module that is not there from where the check runs: an error for the trainer, but
    only "not checked" for `grpolora validate` (in a cluster it may live in a volume or the worker image)."""


@dataclass(frozen=True)
class Prompt:
    text: str
    """The user message (without chat template; see `chat_messages`)."""
    answer: str | None = None
    """The reference answer handed to the reward, if the task has one."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Task-specific details (e.g. the operands, the keyword), for logging and rewards."""
    messages: tuple[dict[str, str], ...] | None = None
    """A chat row's conversation (ending with the user message `text`), rendered instead of `text` alone."""
    system: str | None = None
    """This row's system prompt (a dataset's systemField); wins over spec.task.systemPrompt."""


@dataclass(frozen=True)
class Scores:
    """Rewards of a batch of completions: the weighted total of each, and each reward's own score by label."""

    total: list[float]
    parts: dict[str, list[float]] = field(default_factory=dict)  # NaN where a reward does not apply to an item

    def part_means(self) -> dict[str, float]:
        """Each reward's mean over the items it applies to (a reward that applied to none is left out)."""
        means = {}
        for label, values in self.parts.items():
            applied = [v for v in values if not math.isnan(v)]
            if applied:
                means[label] = math.fsum(applied) / len(applied)
        return means


class Task(abc.ABC):
    """A source of prompts and a reward. Implementations are cheap to build and hold no global state."""

    name: str

    @abc.abstractmethod
    def prompts(self, seed: int) -> Iterator[Prompt]:
        """An endless stream of prompts; the same seed gives the same stream (so a resumed run can skip ahead)."""

    @abc.abstractmethod
    def reward(self, prompt: Prompt, completion: str) -> float:
        """Scalar reward of `completion` (the generated text only, without the prompt) for `prompt`."""

    def stream(self, seed: int, start: int) -> Iterator[Prompt]:
        """`prompts(seed)` from position `start` (a resumed run); tasks that can jump there cheaply override it."""
        return islice(self.prompts(seed), start, None)

    def score(self, items: Sequence[tuple[Prompt, str]]) -> Scores:
        """Rewards of many (prompt, completion) pairs at once (a remote reward answers a batch per request)."""
        return Scores([float(self.reward(prompt, completion)) for prompt, completion in items])

    def eval_prompts(self) -> Sequence[Prompt] | None:
        """Held-out prompts for evaluation (spec.task.dataset.eval), or None."""
        return None

    def close(self) -> None:  # noqa: B027 (most tasks hold nothing)
        """Release what the task holds (connections of remote rewards)."""


def chat_messages(prompt: Prompt | str, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The conversation to render with the tokenizer's chat template (`add_generation_prompt=True`).

    Without `system_prompt` no system message is added, so a template's own default (SmolLM2 adds one) applies.
    A chat row keeps its own conversation; the row's system prompt (or else `system_prompt`) goes first unless the
    conversation starts with one.
    """
    if isinstance(prompt, str):
        prompt = Prompt(text=prompt)
    system = prompt.system or system_prompt
    conversation = [dict(m) for m in prompt.messages] if prompt.messages else [{"role": "user", "content": prompt.text}]
    if system and conversation[0]["role"] != "system":
        conversation.insert(0, {"role": "system", "content": system})
    return conversation
