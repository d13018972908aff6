"""A task whose prompts come from a JSONL file (one JSON object per line) and whose reward is a plugin."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

from grpolora.workers.tasks.base import Prompt, RewardFn, Task, TaskError, TaskUnreachable
from grpolora.workers.tasks.plugin import call_reward

FIELD = "spec.task.dataset.path"


def read_jsonl(
    path: Path, prompt_field: str, answer_field: str, *, answer_required: bool = False, shown_path: str | None = None
) -> list[Prompt]:
    """Every prompt in the file, checked line by line. Blank lines are skipped. A line without `answer_field`
    gets answer None (a reward may not need one) unless `answer_required`. Numbers as answers become strings."""
    shown = shown_path or str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TaskUnreachable(FIELD, f"file not found: {shown}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise TaskError(FIELD, f"cannot read {shown}: {err}") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise TaskError(FIELD, f"line {number}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(record, dict):
            raise TaskError(FIELD, f"line {number}: expected a JSON object, got {type(record).__name__}")
        if prompt_field not in record:
            raise TaskError(FIELD, f"line {number}: missing field {prompt_field!r}")
        prompt = record[prompt_field]
        if not isinstance(prompt, str) or not prompt.strip():
            raise TaskError(FIELD, f"line {number}: field {prompt_field!r} must be a non-empty string")
        answer = record.get(answer_field)
        if answer is None and answer_required:
            raise TaskError(FIELD, f"line {number}: missing field {answer_field!r}")
        if isinstance(answer, bool) or not isinstance(answer, str | int | float | None):
            raise TaskError(FIELD, f"line {number}: field {answer_field!r} must be a string or a number")
        meta = {"line": number, **{k: v for k, v in record.items() if k not in (prompt_field, answer_field)}}
        prompts.append(Prompt(text=prompt, answer=None if answer is None else str(answer), meta=meta))
    if not prompts:
        raise TaskError(FIELD, f"no prompts in {shown}")
    return prompts


class DatasetTask(Task):
    name = "dataset"

    def __init__(self, prompts: list[Prompt], fn: RewardFn, ref: str):
        self._prompts = prompts
        self._fn = fn
        self._ref = ref

    def prompts(self, seed: int) -> Iterator[Prompt]:
        """Every prompt once per epoch, in a fresh shuffled order each epoch (the same orders for the same seed)."""
        rng = random.Random(f"dataset:{seed}")
        order = list(range(len(self._prompts)))
        while True:
            rng.shuffle(order)
            for index in order:
                yield self._prompts[index]

    def drop_prompts(self, keep: Callable[[Prompt], bool], why: str) -> str | None:
        """Drop the prompts `keep` refuses (e.g. too long for the engine), once, before any is drawn; return a
        report naming their lines (None if all stay). Raises TaskError if none is left."""
        kept = [p for p in self._prompts if keep(p)]
        if len(kept) == len(self._prompts):
            return None
        if not kept:
            raise TaskError(FIELD, f"none of the {len(self._prompts)} prompts is left: all {why}")
        kept_ids = {id(p) for p in kept}
        lines = ", ".join(str(p.meta.get("line")) for p in self._prompts if id(p) not in kept_ids)
        report = f"{len(self._prompts) - len(kept)} of {len(self._prompts)} prompts {why}; skipped: lines {lines}"
        self._prompts = kept
        return f"{FIELD}: {report}"

    def reward(self, prompt: Prompt, completion: str) -> float:
        return call_reward(self._fn, self._ref, prompt, completion)
