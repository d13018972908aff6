"""Reward plugins: `package.module:function`, called as function(prompt, completion, answer) -> float, or in TRL's
shape, function(prompts, completions, **columns) -> list[float | None] over a batch (`batched`).

Everything that can be checked without calling the function is checked when the task is loaded, so that a typo
fails the job before any model is loaded; the return value is checked on every call.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from grpolora.workers.tasks.base import Prompt, RewardFn, TaskError, TaskUnreachable

FIELD = "spec.task.reward"


def _add_to_import_path(folder: Path) -> None:
    # As with `python -m`, modules next to the job (the current directory by default) are importable without
    # installing them. Appended, so they never shadow an installed module, and kept, so that a plugin which
    # imports a sibling module lazily (inside the function) still finds it later.
    entry = str(folder.resolve())
    if entry not in sys.path:
        sys.path.append(entry)


def import_plugin_module(module_name: str, field: str, root: Path | None = None) -> ModuleType:
    """Import a plugin's module (searched on sys.path and in `root`, default the current directory); a TaskError
    naming `field` if it fails, a TaskUnreachable if the module is not there from here."""
    _add_to_import_path(root or Path.cwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise TaskUnreachable(field, f"cannot import module {module_name!r}: {err}") from err
        raise TaskError(field, f"importing module {module_name!r} failed: {err}") from err
    except Exception as err:  # the plugin's own import-time error, reported as the user's
        raise TaskError(field, f"importing module {module_name!r} failed: {type(err).__name__}: {err}") from err


def load_reward_function(ref: str, root: Path | None = None) -> RewardFn:
    """Import `package.module:function` (searched on sys.path and in `root`, default the current directory) and
    check that it can be called with (prompt, completion, answer). Raises TaskError naming `spec.task.reward`."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(FIELD, f"{ref!r} is not of the form package.module:function")
    module = import_plugin_module(module_name, FIELD, root)
    if not hasattr(module, attr):
        raise TaskError(FIELD, f"{module_name!r} has no function {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise TaskError(FIELD, f"{ref!r} is not callable (it is a {type(fn).__name__})")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise TaskError(FIELD, f"{ref!r} is async; a reward function must return a float directly")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature; their calls are checked when made
        return fn
    if batched(fn):
        return fn
    try:
        signature.bind("prompt", "completion", None)
    except TypeError as err:
        raise TaskError(
            FIELD,
            f"{ref!r} cannot be called as {attr}(prompt, completion, answer): its signature is {attr}{signature} "
            f"({err})",
        ) from err
    return fn


def call_reward(fn: RewardFn, ref: str, prompt: Prompt, completion: str) -> float:
    """fn(prompt.text, completion, prompt.answer) as a finite float, or a TaskError that says what came back."""
    value = fn(prompt.text, completion, prompt.answer)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise TaskError(FIELD, f"{ref!r} returned {value!r} ({type(value).__name__}); it must return a finite float")
    return float(value)


# TRL's GRPOTrainer calls reward functions as f(prompts=[...], completions=[...], **dataset_columns); a plugin whose
# first two parameters carry those names is called that way, once per batch.
BATCHED_PARAMETERS = ("prompts", "completions")


def batched(fn: RewardFn) -> bool:
    """Whether `fn` takes a batch in TRL's shape (its first two parameters are `prompts` and `completions`)."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return tuple(names[:2]) == BATCHED_PARAMETERS


def call_batched(fn: RewardFn, ref: str, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
    """fn(prompts, completions, answer=[...], <column>=[...]) for a TRL-shaped plugin: the answers and the dataset's
    other columns (a prompt's meta) as keyword arguments, each a list over the batch (None where a row lacks it),
    only those the function takes unless it takes **kwargs. Each score a finite float, or None where the reward does
    not apply (returned as NaN: it adds nothing to the total, as TRL's nansum does); a TaskError otherwise."""
    columns: dict[str, list[Any]] = {"answer": [p.answer for p in prompts]}
    for key in dict.fromkeys(k for p in prompts for k in p.meta):
        columns.setdefault(key, [p.meta.get(key) for p in prompts])
    parameters = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        columns = {k: v for k, v in columns.items() if k in parameters}
    scores = fn([p.text for p in prompts], list(completions), **columns)
    if not isinstance(scores, Sequence) or isinstance(scores, str | bytes):
        raise TaskError(FIELD, f"{ref!r} returned {type(scores).__name__}; it must return a list of floats (or None)")
    if len(scores) != len(completions):
        raise TaskError(FIELD, f"{ref!r} returned {len(scores)} scores for {len(completions)} completions")
    values = []
    for i, value in enumerate(scores):
        if value is None:
            values.append(math.nan)
        elif isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise TaskError(FIELD, f"{ref!r} returned {value!r} at [{i}]; each score must be a finite float or None")
        else:
            values.append(float(value))
    return values
