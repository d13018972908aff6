"""Dataset tasks from Parquet, JSON, folders and (local, offline) Hugging Face datasets: column mapping, chat rows,
eval sets, a deterministic order that resumes without reading skipped rows, and errors that name the field."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpolora.api.spec import TaskSpec
from grpolora.workers.tasks import Prompt, TaskError, chat_messages, load_task
from grpolora.workers.tasks.dataset import DatasetTask


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """Arrow conversions of the test files go to the test's own folder, never the user's cache; nothing online."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


REWARD = [{"name": "math"}]


def task(dataset: dict, root: Path, **fields) -> object:
    return load_task(TaskSpec.model_validate({"dataset": dataset, "reward": REWARD, **fields}), root=root)


def write_parquet(path: Path, rows: dict[str, list]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows), path)
    return path


def sums(n: int, start: int = 0) -> dict[str, list]:
    return {"question": [f"What is {i} + 1?" for i in range(start, start + n)], "solution": list(range(1, n + 1))}


def test_parquet_file_with_column_mapping(tmp_path):
    write_parquet(tmp_path / "train.parquet", {**sums(6), "level": ["easy"] * 6})
    t = task({"path": "train.parquet", "promptField": "question", "answerField": "solution"}, tmp_path)
    prompts = list(itertools.islice(t.prompts(0), 12))
    assert sorted(p.text for p in prompts[:6]) == sorted(sums(6)["question"])  # every row once per epoch
    first = next(p for p in prompts if p.text == "What is 2 + 1?")
    assert first.answer == "3" and first.meta == {"level": "easy"}
    assert t.reward(first, "so the answer is \\boxed{3}") == 1.0 and t.reward(first, "4") == 0.0


def test_json_file_and_folder_of_jsonl_files(tmp_path):
    (tmp_path / "one.json").write_text(json.dumps([{"prompt": "a?", "answer": "1"}, {"prompt": "b?", "answer": 2}]))
    t = task({"path": "one.json"}, tmp_path)
    assert sorted((p.text, p.answer) for p in itertools.islice(t.prompts(0), 2)) == [("a?", "1"), ("b?", "2")]
    folder = tmp_path / "shards"
    folder.mkdir()
    for shard in range(3):
        (folder / f"part-{shard}.jsonl").write_text(
            "".join(json.dumps({"prompt": f"q{shard}{i}"}) + "\n" for i in range(2))
        )
    t = task({"path": "shards"}, tmp_path)
    assert sorted(p.text for p in itertools.islice(t.prompts(0), 6)) == sorted(
        f"q{s}{i}" for s in range(3) for i in range(2)
    )


def test_folder_with_splits_gives_train_and_eval(tmp_path):
    write_parquet(tmp_path / "data" / "train-00000-of-00001.parquet", sums(8))
    write_parquet(tmp_path / "data" / "test-00000-of-00001.parquet", sums(5, start=100))
    t = task(
        {
            "path": "data",
            "promptField": "question",
            "answerField": "solution",
            "eval": {"split": "test", "maxPrompts": 3},
        },
        tmp_path,
    )
    assert {p.text for p in itertools.islice(t.prompts(0), 8)} == set(sums(8)["question"])
    assert [p.text for p in t.eval_prompts()] == sums(3, start=100)["question"]  # file order, the first maxPrompts


def test_eval_path_is_resolved_like_the_dataset(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "t"}\n')
    (tmp_path / "eval.jsonl").write_text('{"prompt": "e1"}\n{"prompt": "e2"}\n')
    t = task({"path": "train.jsonl", "eval": {"path": "eval.jsonl"}}, tmp_path)
    assert [p.text for p in t.eval_prompts()] == ["e1", "e2"]
    assert task({"path": "train.jsonl"}, tmp_path).eval_prompts() is None


def test_chat_rows_keep_their_conversation_and_the_trailing_assistant_is_the_answer(tmp_path):
    chat = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
    ]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    t = task({"path": "chat.jsonl", "messagesField": "messages"}, tmp_path)
    prompt = next(t.prompts(0))
    assert prompt.text == "What is 2 + 2?" and prompt.answer == "4"
    assert chat_messages(prompt, "ignored: the row has its own") == chat[:4]
    # Without a system message in the row, the row's system field (else systemPrompt) goes first.
    row = Prompt(text="q", messages=({"role": "user", "content": "q"},), system="Row system.")
    assert chat_messages(row, "Task system.") == [{"role": "system", "content": "Row system."}, chat_messages("q")[0]]


def test_hub_dataset_from_a_local_repository_with_config_and_splits(tmp_path):
    repo = tmp_path / "acme-sums"
    write_parquet(repo / "main" / "train-00000-of-00001.parquet", sums(10))
    write_parquet(repo / "main" / "test-00000-of-00001.parquet", sums(4, start=50))
    write_parquet(repo / "hard" / "train-00000-of-00001.parquet", sums(3, start=900))
    (repo / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: main\n  data_files:\n"
        "  - {split: train, path: main/train-*}\n  - {split: test, path: main/test-*}\n"
        "- config_name: hard\n  data_files:\n  - {split: train, path: hard/train-*}\n---\n"
    )
    hub = {"id": str(repo), "config": "main", "split": "train"}
    t = task({"hub": hub, "promptField": "question", "answerField": "solution", "eval": {"split": "test"}}, tmp_path)
    assert {p.text for p in itertools.islice(t.prompts(0), 10)} == set(sums(10)["question"])
    assert [p.text for p in t.eval_prompts()] == sums(4, start=50)["question"]
    hard = task({"hub": {**hub, "config": "hard"}, "promptField": "question"}, tmp_path)
    assert {p.text for p in itertools.islice(hard.prompts(0), 3)} == set(sums(3, start=900)["question"])
    with pytest.raises(TaskError, match=r"^spec.task.dataset.eval.split: cannot load .*validation"):
        task({"hub": hub, "promptField": "question", "eval": {"split": "validation"}}, tmp_path)


def test_order_is_deterministic_per_seed_and_resumes_without_reading_skipped_rows(tmp_path):
    write_parquet(tmp_path / "train.parquet", sums(7))
    spec = {"path": "train.parquet", "promptField": "question"}
    t = task(spec, tmp_path)
    stream = [p.text for p in itertools.islice(t.prompts(5), 30)]
    assert stream == [p.text for p in itertools.islice(task(spec, tmp_path).prompts(5), 30)]
    assert stream != [p.text for p in itertools.islice(t.prompts(6), 30)]
    assert stream[:7] != stream[7:14]  # reshuffled each epoch
    for start in (0, 3, 7, 20):
        assert [p.text for p in itertools.islice(t.stream(5, start), 30 - start)] == stream[start:]

    read: list[int] = []

    class Counting(list):
        def __getitem__(self, index):
            read.append(index)
            return super().__getitem__(index)

    counted = DatasetTask(Counting(Prompt(text=str(i)) for i in range(1000)))
    next(counted.stream(0, 2500))
    assert len(read) == 1  # position 2500 is reached without reading the 2500 rows before it


def test_large_parquet_stays_on_disk(tmp_path):
    """The rows live in memory-mapped Arrow files: loading a 200k-row set allocates next to nothing."""
    rows = 200_000
    write_parquet(tmp_path / "big.parquet", {"prompt": [f"prompt number {i} " + "x" * 80 for i in range(rows)]})
    before = pa.total_allocated_bytes()
    t = task({"path": "big.parquet"}, tmp_path)
    prompts = list(itertools.islice(t.stream(0, 150_000), 100))
    assert len(prompts) == 100 and len(t._prompts_from) == rows
    assert pa.total_allocated_bytes() - before < 4 << 20  # the file is ~20 MB


@pytest.mark.parametrize(
    ("files", "dataset", "message"),
    [
        ({}, {"path": "nope.parquet"}, "spec.task.dataset.path: file not found: nope.parquet"),
        ({"x.csv": "a,b\n"}, {"path": "x.csv"}, "spec.task.dataset.path: x.csv: unsupported file type '.csv'"),
        (
            {"t.parquet": {"q": ["a"]}},
            {"path": "t.parquet"},
            "spec.task.dataset.path: t.parquet: no column 'prompt'; columns: q",
        ),
        (
            {"t.parquet": {"prompt": ["a"]}},
            {"path": "t.parquet", "answerField": "sol"},
            "spec.task.dataset.path: t.parquet: no column 'sol'",
        ),
        (
            {"t.parquet": {"prompt": [""]}},
            {"path": "t.parquet"},
            "spec.task.dataset.path: t.parquet: row 0: field 'prompt' must be a non-empty",
        ),
        (
            {"t.parquet": {"prompt": ["a"]}},
            {"path": "t.parquet", "eval": {"split": "test"}},
            "spec.task.dataset.eval.split: t.parquet is one file, it has no split 'test'",
        ),
        ({"d/readme.txt": "hi"}, {"path": "d"}, "spec.task.dataset.path: d: no .jsonl, .json or .parquet files"),
        (
            {"c.jsonl": json.dumps({"m": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]})},
            {"path": "c.jsonl", "messagesField": "m"},
            "spec.task.dataset.path: line 1: m[1] must be {role: system|user|assistant, content: <string>}",
        ),
        (
            {"c.jsonl": json.dumps({"m": [{"role": "assistant", "content": "b"}]})},
            {"path": "c.jsonl", "messagesField": "m"},
            "spec.task.dataset.path: line 1: field 'm' must end with a non-empty user message",
        ),
        ({}, {"hub": {"id": "no-such-org/no-such-set"}}, "spec.task.dataset.hub: "),
    ],
)
def test_dataset_errors_name_the_field(tmp_path, files, dataset, message):
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, dict):
            write_parquet(tmp_path / name, content)
        else:
            (tmp_path / name).write_text(content)
    with pytest.raises(TaskError) as raised:
        task(dataset, tmp_path)
    assert str(raised.value).startswith(message), str(raised.value)


def test_spec_refuses_a_dataset_with_no_source_or_two():
    for dataset, message in (
        ({}, "set `path`"),
        ({"path": "a.parquet", "hub": {"id": "a/b"}}, "set `path`"),
        ({"path": "a.parquet", "eval": {"split": "test", "path": "b.parquet"}}, "exactly one of `split`"),
    ):
        with pytest.raises(ValueError, match=message):
            TaskSpec.model_validate({"dataset": dataset, "reward": REWARD})


def test_rows_without_answers_load_the_same_in_the_worker(tmp_path):
    """The worker gets the spec as to_wire() JSON, defaults written out: an answerField left at its default must
    still be optional there (it was required in the worker only, failing jobs that `grpolora run` accepted)."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "no answer here"}\n')
    spec = TaskSpec.model_validate({"dataset": {"path": "p.jsonl"}, "reward": REWARD})
    in_worker = TaskSpec.model_validate(spec.model_dump(by_alias=True, mode="json", exclude_none=True))
    for task_spec in (spec, in_worker):
        assert next(load_task(task_spec, root=tmp_path).prompts(0)).answer is None
