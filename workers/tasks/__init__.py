"""Tasks: where prompts come from and how completions are scored. Torch-free.

`load_task(spec.task)` is the one entry point; it fails early with a TaskError that names the spec field.
"""

from __future__ import annotations

from pathlib import Path

from grpolora.api.spec import DatasetSpec, TaskSpec
from grpolora.workers.tasks.arithmetic import ArithmeticTask
from grpolora.workers.tasks.base import Prompt, RewardFn, Task, TaskError, TaskUnreachable, chat_messages
from grpolora.workers.tasks.dataset import DatasetTask, read_jsonl
from grpolora.workers.tasks.keyword import KeywordTask
from grpolora.workers.tasks.plugin import PluginRewardTask, load_reward_function

BUILTIN_TASKS: dict[str, type[Task]] = {task.name: task for task in (ArithmeticTask, KeywordTask)}
"""Built-in tasks by name; the names must equal grpolora.api.constants.BUILTIN_TASKS (a test checks)."""

__all__ = [
    "BUILTIN_TASKS",
    "Prompt",
    "RewardFn",
    "Task",
    "TaskError",
    "TaskUnreachable",
    "chat_messages",
    "check_task",
    "load_task",
]


def load_task(spec: TaskSpec, root: Path | None = None) -> Task:
    """The task a validated `spec.task` describes, with its dataset read and its reward plugin imported and checked.

    `root` (default: the current directory) is where a relative dataset path is resolved and where reward
    modules are also looked for. Raises TaskError (a ValueError) whose message starts with the field path.
    """
    root = root or Path.cwd()
    fn = load_reward_function(spec.reward, root) if spec.reward else None
    if spec.dataset is not None:
        if fn is None or spec.reward is None:  # the spec validator already requires it
            raise TaskError("spec.task.reward", "a `dataset` task needs `reward: package.module:function`")
        return DatasetTask(_read_dataset(spec.dataset, root), fn, spec.reward)
    if spec.name not in BUILTIN_TASKS:
        valid = ", ".join(BUILTIN_TASKS)
        raise TaskError("spec.task.name", f"unknown built-in task {spec.name!r}; valid: {valid}")
    task = BUILTIN_TASKS[spec.name]()
    if fn is not None and spec.reward is not None:
        return PluginRewardTask(task, fn, spec.reward)
    return task


def check_task(spec: TaskSpec, root: Path | None = None) -> tuple[list[TaskError], list[TaskUnreachable]]:
    """What `grpolora validate` checks of a task from where it runs: (problems, things it could not reach here).

    The reward plugin and the dataset are checked independently, so that one report names both."""
    root = root or Path.cwd()
    problems: list[TaskError] = []
    unreachable: list[TaskUnreachable] = []
    checks = []
    if spec.reward:
        checks.append(lambda: load_reward_function(spec.reward, root))
    if spec.dataset is not None:
        checks.append(lambda: _read_dataset(spec.dataset, root))
    for check in checks:
        try:
            check()
        except TaskUnreachable as exc:
            unreachable.append(exc)
        except TaskError as exc:
            problems.append(exc)
    return problems, unreachable


def _read_dataset(dataset: DatasetSpec, root: Path) -> list[Prompt]:
    return read_jsonl(
        root / dataset.path,
        dataset.prompt_field,
        dataset.answer_field,
        # Naming an answer field on purpose and never having it is a mistake; the default may be absent.
        answer_required="answer_field" in dataset.model_fields_set,
        shown_path=dataset.path,
    )
