"""What every task is: prompts from a seed, and a reward for a completion. Torch-free (rewards run on the CPU of
trainer rank 0, and `grpolora validate` may load a task without the ML stack)."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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


class Task(abc.ABC):
    """A source of prompts and a reward. Implementations are cheap to build and hold no global state."""

    name: str

    @abc.abstractmethod
    def prompts(self, seed: int) -> Iterator[Prompt]:
        """An endless stream of prompts; the same seed gives the same stream (so a resumed run can skip ahead)."""

    @abc.abstractmethod
    def reward(self, prompt: Prompt, completion: str) -> float:
        """Scalar reward of `completion` (the generated text only, without the prompt) for `prompt`."""


def chat_messages(prompt: Prompt | str, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The conversation to render with the tokenizer's chat template (`add_generation_prompt=True`).

    Without `system_prompt` no system message is added, so a template's own default (SmolLM2 adds one) applies.
    """
    text = prompt.text if isinstance(prompt, Prompt) else prompt
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": text})
    return messages
