"""A task whose prompts come from a dataset (JSONL/JSON/Parquet files, a folder of them, or a Hugging Face dataset)
and whose reward is given by `spec.task.reward`.

Rows become Prompts one at a time, when drawn (`Rows`): a large dataset stays in its memory-mapped Arrow files
(see `sources`), and only a permutation of row indices (8 bytes a row) is held. The order is deterministic from the
seed, reshuffled each epoch, and a resumed run jumps to its position without reading the rows it skips.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from grpolora.workers.tasks.base import Prompt, Task, TaskError, TaskUnreachable

FIELD = "spec.task.dataset.path"
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Columns:
    """Which keys of a row hold what (spec.task.dataset's promptField, answerField, messagesField, systemField)."""

    prompt: str = "prompt"
    answer: str = "answer"
    messages: str | None = None
    system: str | None = None
    answer_required: bool = False
    """Naming an answer field on purpose and never having it is a mistake; the default may be absent."""

    @property
    def used(self) -> tuple[str, ...]:
        return tuple(k for k in (self.messages or self.prompt, self.answer, self.system) if k)


def row_prompt(record: Any, columns: Columns, where: str, field: str) -> Prompt:
    """One row (a JSON object or an Arrow row) as a Prompt; TaskError(`field`, "<where>: ...") if it does not fit."""
    if not isinstance(record, Mapping):
        raise TaskError(field, f"{where}: expected a JSON object, got {type(record).__name__}")
    answer = record.get(columns.answer)
    messages: tuple[dict[str, str], ...] | None = None
    if columns.messages is not None:
        messages, trailing = _chat(record, columns.messages, where, field)
        text = messages[-1]["content"]
        if answer is None:
            answer = trailing
    else:
        if columns.prompt not in record:
            raise TaskError(field, f"{where}: missing field {columns.prompt!r}")
        text = record[columns.prompt]
        if not isinstance(text, str) or not text.strip():
            raise TaskError(field, f"{where}: field {columns.prompt!r} must be a non-empty string")
    if answer is None and columns.answer_required:
        raise TaskError(field, f"{where}: missing field {columns.answer!r}")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float | None):
        raise TaskError(field, f"{where}: field {columns.answer!r} must be a string or a number")
    system = record.get(columns.system) if columns.system else None
    if system is not None and not isinstance(system, str):
        raise TaskError(field, f"{where}: field {columns.system!r} must be a string")
    meta = {k: v for k, v in record.items() if k not in columns.used}
    return Prompt(
        text=text, answer=None if answer is None else str(answer), meta=meta, messages=messages, system=system or None
    )


def _chat(record: Mapping, key: str, where: str, field: str) -> tuple[tuple[dict[str, str], ...], str | None]:
    """The conversation up to its last user message, and the content of a dropped trailing assistant message."""
    value = record.get(key)
    if not isinstance(value, list | tuple) or not value:
        raise TaskError(field, f"{where}: field {key!r} must be a non-empty list of {{role, content}} messages")
    messages = []
    for i, message in enumerate(value):
        role = message.get("role") if isinstance(message, Mapping) else None
        content = message.get("content") if isinstance(message, Mapping) else None
        if role not in CHAT_ROLES or not isinstance(content, str):
            raise TaskError(
                field,
                f"{where}: {key}[{i}] must be {{role: {'|'.join(CHAT_ROLES)}, content: <string>}}, got {message!r}",
            )
        messages.append({"role": role, "content": content})
    trailing = messages.pop()["content"] if messages[-1]["role"] == "assistant" else None
    if not messages or messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
        raise TaskError(field, f"{where}: field {key!r} must end with a non-empty user message (then an optional "
                        "assistant message, the reference)")  # fmt: skip
    return tuple(messages), trailing


def read_jsonl(path: Path, columns: Columns, *, shown_path: str | None = None, field: str = FIELD) -> list[Prompt]:
    """Every prompt in the file, checked line by line (errors name the line). Blank lines are skipped. A line
    without the answer field gets answer None (a reward may not need one) unless `answer_required`. Numbers as
    answers become strings. Other keys are kept in the prompt's meta, with the line number."""
    shown = shown_path or str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TaskUnreachable(field, f"file not found: {shown}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise TaskError(field, f"cannot read {shown}: {err}") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise TaskError(field, f"line {number}: not valid JSON ({err.msg} at column {err.colno})") from None
        prompt = row_prompt(record, columns, f"line {number}", field)
        prompts.append(Prompt(prompt.text, prompt.answer, {"line": number, **prompt.meta}, prompt.messages,
                              prompt.system))  # fmt: skip
    if not prompts:
        raise TaskError(field, f"no prompts in {shown}")
    return prompts


class Rows(Sequence[Prompt]):
    """Rows of a table converted to Prompts when read: `table[i]` gives a row mapping (an Arrow dataset does)."""

    def __init__(self, table: Any, columns: Columns, field: str, label: Callable[[int], str] = lambda i: f"row {i}"):
        self._table = table
        self._columns = columns
        self._field = field
        self._label = label

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return row_prompt(self._table[int(index)], self._columns, self._label(int(index)), self._field)


def epoch_order(seed: int, epoch: int, size: int) -> np.ndarray:
    """The row order of one epoch: a permutation drawn from (seed, epoch) alone, so any epoch is found directly."""
    return np.random.default_rng([seed, epoch]).permutation(size)


class DatasetTask(Task):
    name = "dataset"

    def __init__(self, rows: Sequence[Prompt], eval_rows: Sequence[Prompt] | None = None):
        self._rows = rows
        self._eval_rows = eval_rows

    def __len__(self) -> int:
        return len(self._rows)

    def prompts(self, seed: int) -> Iterator[Prompt]:
        """Every prompt once per epoch, in a fresh shuffled order each epoch (the same orders for the same seed)."""
        return self.stream(seed, 0)

    def stream(self, seed: int, start: int) -> Iterator[Prompt]:
        """`prompts(seed)` from position `start`, reading none of the rows before it."""
        size = len(self._rows)
        epoch, offset = divmod(start, size)
        while True:
            for index in epoch_order(seed, epoch, size)[offset:]:
                yield self._rows[int(index)]
            epoch, offset = epoch + 1, 0

    def eval_prompts(self) -> Sequence[Prompt] | None:
        return self._eval_rows

    def reward(self, prompt: Prompt, completion: str) -> float:
        raise TypeError("a dataset has no reward of its own: load_task wraps it with spec.task.reward's")
