"""Reward plugins: `package.module:function`, called as function(prompt, completion, answer) -> float.

Everything that can be checked without calling the function is checked when the task is loaded, so that a typo
fails the job before any model is loaded; the return value is checked on every call.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import sys
from pathlib import Path

from grpolora.workers.tasks.base import Prompt, RewardFn, TaskError, TaskUnreachable

FIELD = "spec.task.reward"


def _add_to_import_path(folder: Path) -> None:
    # As with `python -m`, modules next to the job (the current directory by default) are importable without
    # installing them. Appended, so they never shadow an installed module, and kept, so that a plugin which
    # imports a sibling module lazily (inside the function) still finds it later.
    entry = str(folder.resolve())
    if entry not in sys.path:
        sys.path.append(entry)


def load_reward_function(ref: str, root: Path | None = None) -> RewardFn:
    """Import `package.module:function` (searched on sys.path and in `root`, default the current directory) and
    check that it can be called with (prompt, completion, answer). Raises TaskError naming `spec.task.reward`."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(FIELD, f"{ref!r} is not of the form package.module:function")
    _add_to_import_path(root or Path.cwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise TaskUnreachable(FIELD, f"cannot import module {module_name!r}: {err}") from err
        raise TaskError(FIELD, f"importing module {module_name!r} failed: {err}") from err
    except Exception as err:  # the plugin's own import-time error, reported as the user's
        raise TaskError(FIELD, f"importing module {module_name!r} failed: {type(err).__name__}: {err}") from err
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
