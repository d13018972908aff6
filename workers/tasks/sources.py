"""Where a dataset's rows come from: `spec.task.dataset` resolved to row sequences (train and eval).

A small .jsonl file is read whole and checked line by line (errors name the line). Everything else (Parquet,
JSON, a JSONL file above JSONL_IN_MEMORY_BYTES, a folder, a Hugging Face dataset) goes through the `datasets`
library: it converts the files once into Arrow files in its cache and maps them into memory, so a dataset far
larger than RAM trains with the memory of the rows in use (the `Rows` of a step), not of the set.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpolora.api.spec import DatasetSpec
from grpolora.workers.tasks.base import Prompt, TaskError, TaskUnreachable
from grpolora.workers.tasks.dataset import Columns, Rows, read_jsonl, row_prompt

FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}
JSONL_IN_MEMORY_BYTES = 64 << 20
TRAIN_SPLIT = "train"


def columns_of(spec: DatasetSpec) -> Columns:
    return Columns(
        prompt=spec.prompt_field,
        answer=spec.answer_field,
        messages=spec.messages_field,
        system=spec.system_field,
        # Compared with the default, not model_fields_set: the worker gets the spec with defaults written out.
        answer_required=spec.answer_field != type(spec).model_fields["answer_field"].default,
    )


def resolve(path: str | None, root: Path) -> Path:
    """A dataset path as the trainer sees it: relative paths (all paths, with a pvc) under `root`."""
    return root / path if path else root


def load_rows(spec: DatasetSpec, root: Path, shown_root: str = "") -> Sequence[Prompt]:
    """The training rows of `spec`. `root` is where relative paths start (the dataset volume's mount with a pvc).
    Raises TaskError naming spec.task.dataset.path|hub."""
    columns = columns_of(spec)
    if spec.hub is not None:
        field = "spec.task.dataset.hub"
        table = _hub_split(spec, spec.hub.split, field)
        return _checked(table, columns, field, f"{spec.hub.id} ({spec.hub.split})")
    field = "spec.task.dataset.path"
    return _files(resolve(spec.path, root), spec.path or shown_root or str(root), TRAIN_SPLIT, columns, field)


def load_eval_rows(spec: DatasetSpec, root: Path) -> Sequence[Prompt] | None:
    """The held-out rows of `spec.eval` (at most maxPrompts, the first ones), or None without `eval`."""
    if spec.eval is None:
        return None
    columns = columns_of(spec)
    evaluation = spec.eval
    if evaluation.path is not None:
        field = "spec.task.dataset.eval.path"
        rows = _files(resolve(evaluation.path, root), evaluation.path, TRAIN_SPLIT, columns, field)
    elif spec.hub is not None:
        field = "spec.task.dataset.eval.split"
        rows = _checked(_hub_split(spec, evaluation.split or "", field), columns, field, evaluation.split or "")
    else:
        field = "spec.task.dataset.eval.split"
        rows = _files(resolve(spec.path, root), spec.path or str(root), evaluation.split or "", columns, field)
    if evaluation.max_prompts is not None and len(rows) > evaluation.max_prompts:
        rows = rows[: evaluation.max_prompts]
    return rows


def _files(path: Path, shown: str, split: str, columns: Columns, field: str) -> Sequence[Prompt]:
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix not in FILE_BUILDERS:
            raise TaskError(field, f"{shown}: unsupported file type {suffix!r}; use .jsonl, .json or .parquet")
        if split != TRAIN_SPLIT:
            raise TaskError(field, f"{shown} is one file, it has no split {split!r}; give the eval set as "
                            "`eval.path`, or point `path` at a folder with train/test files")  # fmt: skip
        if suffix == ".jsonl" and path.stat().st_size <= JSONL_IN_MEMORY_BYTES:
            return read_jsonl(path, columns, shown_path=shown, field=field)
        table = _load(field, FILE_BUILDERS[suffix], data_files=str(path), split=TRAIN_SPLIT)
        return _checked(table, columns, field, shown)
    if not path.exists():  # may live in a volume or the image: only "not checked" for `grpolora validate`
        raise TaskUnreachable(field, f"file not found: {shown}")
    found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FILE_BUILDERS)
    kinds = {FILE_BUILDERS[p.suffix.lower()] for p in found}
    if not found:
        raise TaskError(field, f"{shown}: no .jsonl, .json or .parquet files in this folder")
    if len(kinds) > 1:
        raise TaskError(field, f"{shown}: mixes Parquet and JSON files; keep one format per folder")
    # The `datasets` convention names the split of each file (train.parquet, data/test-00000-of-00001.parquet, ...);
    # files named after no split are all `train`.
    table = _load(field, kinds.pop(), data_dir=str(path), split=split)
    return _checked(table, columns, field, f"{shown} ({split})")


def _hub_split(spec: DatasetSpec, split: str, field: str) -> Any:
    hub = spec.hub
    assert hub is not None
    return _load(field, hub.id, name=hub.config, split=split, revision=hub.revision)


def _load(field: str, path: str, **kwargs: Any) -> Any:
    import datasets

    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(path, **kwargs)
    except (FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as err:
        raise TaskError(field, f"dataset not found: {err}") from None
    except Exception as err:  # the library's own errors (unknown split or config, bad files) told as they are
        raise TaskError(field, f"cannot load {path}: {type(err).__name__}: {err}") from None


def _checked(table: Any, columns: Columns, field: str, shown: str) -> Sequence[Prompt]:
    """Rows of an Arrow dataset, its columns checked now and its first row converted (a typo fails at once)."""
    if len(table) == 0:
        raise TaskError(field, f"no prompts in {shown}")
    names = list(table.column_names)
    needed = [columns.messages or columns.prompt]
    if columns.answer_required:
        needed.append(columns.answer)
    if columns.system:
        needed.append(columns.system)
    missing = [n for n in needed if n not in names]
    if missing:
        raise TaskError(field, f"{shown}: no column {missing[0]!r}; columns: {', '.join(names)}")
    rows = Rows(table, columns, field, label=lambda i: f"{shown}: row {i}")
    row_prompt(table[0], columns, f"{shown}: row 0", field)
    return rows
