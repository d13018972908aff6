"""Tasks: where prompts come from and how completions are scored. Torch-free.

`load_task(spec.task)` is the one entry point; it fails early with a TaskError that names the spec field.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from grpolora.api.spec import TaskSpec
from grpolora.workers.tasks.arithmetic import ArithmeticTask
from grpolora.workers.tasks.base import Prompt, RewardFn, Scores, Task, TaskError, TaskUnreachable, chat_messages
from grpolora.workers.tasks.dataset import DatasetTask
from grpolora.workers.tasks.keyword import KeywordTask
from grpolora.workers.tasks.rewards import Rewards, build_rewards
from grpolora.workers.tasks.sources import load_eval_rows, load_rows

BUILTIN_TASKS: dict[str, type[Task]] = {task.name: task for task in (ArithmeticTask, KeywordTask)}
"""Built-in tasks by name; the names must equal grpolora.api.constants.BUILTIN_TASKS (a test checks)."""

__all__ = [
    "BUILTIN_TASKS",
    "Prompt",
    "RewardFn",
    "Scores",
    "Task",
    "TaskError",
    "TaskUnreachable",
    "chat_messages",
    "check_task",
    "load_task",
]


class RewardedTask(Task):
    """Another task's prompts scored by the rewards of spec.task.reward."""

    def __init__(self, prompts_from: Task, rewards: Rewards):
        self.name = prompts_from.name
        self._prompts_from = prompts_from
        self.rewards = rewards

    def prompts(self, seed: int) -> Iterator[Prompt]:
        return self._prompts_from.prompts(seed)

    def stream(self, seed: int, start: int) -> Iterator[Prompt]:
        return self._prompts_from.stream(seed, start)

    def eval_prompts(self) -> Sequence[Prompt] | None:
        return self._prompts_from.eval_prompts()

    def reward(self, prompt: Prompt, completion: str) -> float:
        return self.rewards.score([(prompt, completion)]).total[0]

    def score(self, items: Sequence[tuple[Prompt, str]]) -> Scores:
        return self.rewards.score(items)

    def close(self) -> None:
        self.rewards.close()


def load_task(spec: TaskSpec, root: Path | None = None, data_root: Path | None = None) -> Task:
    """The task a validated `spec.task` describes, with its dataset opened and its rewards built and checked.

    `root` (default: the current directory) is where a relative dataset path is resolved and where reward
    modules are also looked for; `data_root` (default `root`) is where dataset paths start (the mount of
    `dataset.pvc` in a trainer pod). Raises TaskError (a ValueError) whose message starts with the field path.
    """
    root = root or Path.cwd()
    rewards = build_rewards(spec.rewards, root, plugin_string=isinstance(spec.reward, str)) if spec.reward else None
    if spec.dataset is not None:
        assert rewards is not None  # the spec validator requires a reward with a dataset
        data_root = data_root or root
        base: Task = DatasetTask(load_rows(spec.dataset, data_root), load_eval_rows(spec.dataset, data_root))
        return RewardedTask(base, rewards)
    if spec.name not in BUILTIN_TASKS:
        valid = ", ".join(BUILTIN_TASKS)
        raise TaskError("spec.task.name", f"unknown built-in task {spec.name!r}; valid: {valid}")
    task = BUILTIN_TASKS[spec.name]()
    return RewardedTask(task, rewards) if rewards is not None else task


def check_task(spec: TaskSpec, root: Path | None = None) -> tuple[list[TaskError], list[TaskUnreachable]]:
    """What `grpolora validate` checks of a task from where it runs: (problems, things it could not reach here).

    The rewards and the dataset are checked independently, so that one report names both. A dataset on a volume
    or a hub is never loaded here (a hub would be fetched): it is reported as not checked."""
    root = root or Path.cwd()
    problems: list[TaskError] = []
    unreachable: list[TaskUnreachable] = []
    checks = []
    if spec.reward:
        checks.append(lambda: build_rewards(spec.rewards, root, plugin_string=isinstance(spec.reward, str)).close())
    dataset = spec.dataset
    if dataset is not None and (dataset.pvc is not None or dataset.hub is not None):
        where = "spec.task.dataset.pvc" if dataset.pvc is not None else "spec.task.dataset.hub"
        unreachable.append(TaskUnreachable(where, "read by the trainer (a volume or a hub), not from here"))
    elif dataset is not None:
        checks.append(lambda: (load_rows(dataset, root), load_eval_rows(dataset, root)))
    for check in checks:
        try:
            check()
        except TaskUnreachable as exc:
            unreachable.append(exc)
        except TaskError as exc:
            problems.append(exc)
    return problems, unreachable
