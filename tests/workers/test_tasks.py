"""Tasks: deterministic prompts, rewards on hand-written completions, and every way loading a task can fail."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from grpolora.api import constants
from grpolora.api.spec import TaskSpec
from grpolora.workers.tasks import BUILTIN_TASKS, Prompt, TaskError, chat_messages, load_task
from grpolora.workers.tasks.arithmetic import arithmetic_reward
from grpolora.workers.tasks.keyword import keyword_reward
from tests.helpers import ROOT


def first(task, seed: int, n: int = 50) -> list[Prompt]:
    return list(itertools.islice(task.prompts(seed), n))


def task_spec(**fields) -> TaskSpec:
    return TaskSpec.model_validate(fields)


def write_plugin(folder: Path, body: str) -> str:
    """A reward module with a unique name (imports are cached per process), returned as its module name."""
    name = f"plugin_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(body)
    return name


def write_jsonl(folder: Path, lines: list[str], name: str = "data.jsonl") -> str:
    (folder / name).write_text("\n".join(lines) + "\n")
    return name


# --- registry and determinism ---------------------------------------------------------------------------------------


def test_registry_names_equal_the_api_constants():
    assert tuple(BUILTIN_TASKS) == constants.BUILTIN_TASKS
    for name, cls in BUILTIN_TASKS.items():
        assert cls.name == name
        assert load_task(task_spec(name=name)).name == name


@pytest.mark.parametrize("name", constants.BUILTIN_TASKS)
def test_builtin_prompts_are_endless_and_deterministic_per_seed(name):
    task = BUILTIN_TASKS[name]()
    assert first(task, 7) == first(BUILTIN_TASKS[name](), 7)
    assert first(task, 7) != first(task, 8)
    assert len(first(task, 0, 5000)) == 5000
    assert len({p.text for p in first(task, 0, 200)}) > 100  # varied, not one prompt repeated


def test_arithmetic_prompts_carry_the_right_answer():
    for prompt in first(BUILTIN_TASKS["arithmetic"](), 0, 300):
        a, op, b = prompt.meta["expression"].split()
        value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert prompt.answer == str(value) and value >= 0
        assert prompt.text.startswith(f"What is {a} {op} {b}?") and "Answer: <integer>" in prompt.text


def test_keyword_prompts_name_their_keyword():
    for prompt in first(BUILTIN_TASKS["keyword"](), 0, 100):
        assert f'uses the word "{prompt.answer}"' in prompt.text
        assert prompt.meta["topic"] in prompt.text and prompt.answer == prompt.meta["keyword"]


# --- rewards --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("37 + 48 = 85.\nAnswer: 85", 1.1),  # right and formatted: 1.0 + 0.1
        ("**Answer:** 85", 1.1),  # markdown bold around the label still counts
        ("The sum is 85.", 1.0),  # right, no Answer line: last integer
        ("I think 85.\nAnswer: 86", 0.1),  # the Answer line wins over earlier numbers: wrong, formatted
        ("Answer: 84", 0.1),
        ("Answer: eighty-five", 0.0),  # no integer on the line: not the format, no number
        ("I do not know.", 0.0),
        ("", 0.0),
    ],
)
def test_arithmetic_reward(completion, expected):
    assert arithmetic_reward(completion, "85") == pytest.approx(expected)


def test_arithmetic_reward_thousands_and_negative():
    assert arithmetic_reward("Answer: 1,188", "1188") == pytest.approx(1.1)
    assert arithmetic_reward("it is -3", "-3") == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("A warm cup of tea.", 1.0),  # 5 words, uses "warm"
        ("WARM days are here again", 1.0),  # case-insensitive
        ("It's warm today", 1.0),  # 3 words ("It's" is one): the shortest full-credit sentence
        ("Warm.", 0.0),  # a lone keyword is not a sentence
        ("Warmth fills the quiet old house tonight", 0.0),  # "warmth" is another word
        ("A cup of tea by the fire", 0.0),  # short but no keyword
        # 17 words with the keyword: (25 - 17) / 15 = 0.5333333
        ("the warm wind moved over the fields and the long road while we walked home slowly together", 8 / 15),
        (" ".join(["warm"] + ["word"] * 24), 0.0),  # 25 words: no brevity credit left
        ("", 0.0),
    ],
)
def test_keyword_reward(completion, expected):
    assert keyword_reward(completion, "warm") == pytest.approx(expected)


def test_builtin_task_reward_uses_the_prompt_answer():
    arithmetic = BUILTIN_TASKS["arithmetic"]()
    prompt = next(arithmetic.prompts(0))
    assert arithmetic.reward(prompt, f"Answer: {prompt.answer}") == pytest.approx(1.1)
    keyword = BUILTIN_TASKS["keyword"]()
    prompt = next(keyword.prompts(0))
    assert keyword.reward(prompt, f"This is {prompt.answer} indeed.") == 1.0


def test_chat_messages():
    prompt = Prompt(text="What is 2 + 2?")
    assert chat_messages(prompt) == [{"role": "user", "content": "What is 2 + 2?"}]
    assert chat_messages("Hi", "Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


# --- dataset tasks --------------------------------------------------------------------------------------------------

REWARD_BODY = "def score(prompt, completion, answer):\n    return float(answer is not None and answer in completion)\n"


def test_dataset_task_reads_shuffles_per_epoch_and_scores(tmp_path):
    path = write_jsonl(
        tmp_path,
        [json.dumps({"q": f"Capital number {i}?", "a": f"city{i}", "source": "test"}) for i in range(5)] + ["   "],
    )
    module = write_plugin(tmp_path, REWARD_BODY)
    spec = task_spec(dataset={"path": path, "promptField": "q", "answerField": "a"}, reward=f"{module}:score")
    task = load_task(spec, root=tmp_path)
    prompts = first(task, 3, 15)
    for epoch in range(3):  # every prompt once per epoch
        assert sorted(p.text for p in prompts[epoch * 5 : epoch * 5 + 5]) == [f"Capital number {i}?" for i in range(5)]
    assert prompts == first(load_task(spec, root=tmp_path), 3, 15)
    assert prompts != first(task, 4, 15)
    prompt = next(p for p in prompts if p.text == "Capital number 2?")
    assert prompt.answer == "city2" and prompt.meta == {"line": 3, "source": "test"}
    assert task.reward(prompt, "It is city2.") == 1.0 and task.reward(prompt, "No idea") == 0.0


def test_dataset_answers_may_be_numbers_or_absent_by_default(tmp_path):
    path = write_jsonl(tmp_path, ['{"prompt": "2+2?", "answer": 4}', '{"prompt": "Say hi"}'])
    task = load_task(task_spec(dataset={"path": path}, reward=f"{write_plugin(tmp_path, REWARD_BODY)}:score"), tmp_path)
    assert sorted((p.text, p.answer) for p in first(task, 0, 2)) == [("2+2?", "4"), ("Say hi", None)]


def test_example_dataset_and_plugin_load(monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = task_spec(dataset={"path": "examples/capitals.jsonl"}, reward="examples.rewards:contains_answer")
    task = load_task(spec)
    prompt = next(task.prompts(0))
    assert task.reward(prompt, f"The answer is {prompt.answer}.") == 1.0
    assert task.reward(prompt, "I am not sure.") == 0.0


@pytest.mark.parametrize(
    ("lines", "dataset", "message"),
    [
        (None, {"path": "x.jsonl"}, "spec.task.dataset.path: file not found: x.jsonl"),
        ([], {}, "spec.task.dataset.path: no prompts in data.jsonl"),
        (['{"prompt": "a"}', "{bad json"], {}, "spec.task.dataset.path: line 2: not valid JSON"),
        (['["prompt"]'], {}, "spec.task.dataset.path: line 1: expected a JSON object, got list"),
        (['{"prompt": "a"}', "", '{"question": "b"}'], {}, "spec.task.dataset.path: line 3: missing field 'prompt'"),
        (['{"prompt": ""}'], {}, "spec.task.dataset.path: line 1: field 'prompt' must be a non-empty string"),
        (['{"prompt": "a", "answer": [1]}'], {}, "spec.task.dataset.path: line 1: field 'answer' must be a string or"),
        # An answer field named on purpose must be on every line.
        (
            ['{"q": "a", "sol": "1"}', '{"q": "b"}'],
            {"promptField": "q", "answerField": "sol"},
            "spec.task.dataset.path: line 2: missing field 'sol'",
        ),
    ],
)
def test_dataset_errors_name_the_field_and_line(tmp_path, lines, dataset, message):
    path = write_jsonl(tmp_path, lines) if lines is not None else None
    spec = task_spec(dataset={"path": path, **dataset}, reward=f"{write_plugin(tmp_path, REWARD_BODY)}:score")
    with pytest.raises(TaskError) as raised:
        load_task(spec, root=tmp_path)
    assert str(raised.value).startswith(message)


# --- reward plugins -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "function", "message"),
    [
        (None, "score", "spec.task.reward: cannot import module 'no_such_module_xyz'"),
        ("import no_such_dependency_xyz\n", "score", "spec.task.reward: importing module '{m}' failed: No module"),
        (
            "raise RuntimeError('boom')\n",
            "score",
            "spec.task.reward: importing module '{m}' failed: RuntimeError: boom",
        ),
        (REWARD_BODY, "baz", "spec.task.reward: '{m}' has no function 'baz'"),
        ("score = 3\n", "score", "spec.task.reward: '{m}:score' is not callable (it is a int)"),
        (
            "def score(prompt, completion):\n    return 1.0\n",
            "score",
            "spec.task.reward: '{m}:score' cannot be called as score(prompt, completion, answer): "
            "its signature is score(prompt, completion)",
        ),
        (
            "def score(prompt, completion, answer, *, judge):\n    return 1.0\n",
            "score",
            "spec.task.reward: '{m}:score' cannot be called as score(prompt, completion, answer)",
        ),
        ("async def score(p, c, a):\n    return 1.0\n", "score", "spec.task.reward: '{m}:score' is async"),
    ],
)
def test_reward_plugin_errors(tmp_path, body, function, message):
    module = write_plugin(tmp_path, body) if body is not None else "no_such_module_xyz"
    with pytest.raises(TaskError) as raised:
        load_task(task_spec(name="keyword", reward=f"{module}:{function}"), root=tmp_path)
    assert str(raised.value).startswith(message.format(m=module))
    assert raised.value.path == "spec.task.reward"


def test_reward_plugin_with_extra_defaults_or_varargs_is_accepted(tmp_path):
    for body in (
        "def score(prompt, completion, answer=None, scale=1.0):\n    return scale\n",
        "def score(*args):\n    return 1.0\n",
        "class Score:\n    def __call__(self, prompt, completion, answer):\n        return 1.0\nscore = Score()\n",
    ):
        task = load_task(task_spec(name="keyword", reward=f"{write_plugin(tmp_path, body)}:score"), root=tmp_path)
        assert task.reward(next(task.prompts(0)), "anything") == 1.0


def test_reward_plugin_overrides_a_builtin_reward_and_gets_the_answer(tmp_path):
    body = "def score(prompt, completion, answer):\n    return len(prompt) + 100 * (answer in prompt)\n"
    task = load_task(task_spec(name="keyword", reward=f"{write_plugin(tmp_path, body)}:score"), root=tmp_path)
    prompt = next(task.prompts(0))
    assert task.name == "keyword"
    assert prompt == next(BUILTIN_TASKS["keyword"]().prompts(0))
    assert task.reward(prompt, "ignored") == len(prompt.text) + 100


@pytest.mark.parametrize("value", ["'1.0'", "None", "float('nan')", "True"])
def test_reward_plugin_must_return_a_finite_number(tmp_path, value):
    body = f"def score(prompt, completion, answer):\n    return {value}\n"
    module = write_plugin(tmp_path, body)
    task = load_task(task_spec(name="arithmetic", reward=f"{module}:score"), root=tmp_path)
    with pytest.raises(TaskError, match=rf"^spec.task.reward: '{module}:score' returned .* must return a finite float"):
        task.reward(next(task.prompts(0)), "x")


def test_plugin_folder_is_appended_to_the_import_path_once(tmp_path):
    # Appended (an installed module of the same name wins) and kept (a plugin may import a sibling lazily).
    body = "def score(prompt, completion, answer):\n    import helper_{h}\n    return helper_{h}.VALUE\n"
    helper = uuid.uuid4().hex[:8]
    (tmp_path / f"helper_{helper}.py").write_text("VALUE = 0.5\n")
    module = write_plugin(tmp_path, body.format(h=helper))
    before = list(sys.path)
    for _ in range(2):
        task = load_task(task_spec(name="keyword", reward=f"{module}:score"), root=tmp_path)
    assert sys.path == [*before, str(tmp_path.resolve())]
    assert task.reward(next(task.prompts(0)), "x") == 0.5


def test_tasks_import_without_torch():
    code = "import sys, grpolora.workers.tasks\nassert 'torch' not in sys.modules, 'tasks imported torch'\n"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# A chat template that reads `enable_thinking` as Qwen3's does: unless it is false, the model is left to think first;
# false closes an empty think block in the generation prompt.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_chat_template_args_reach_the_prompt_tokens_the_replicas_get():
    from transformers import AutoTokenizer

    from grpolora.workers.models import resolve_model
    from grpolora.workers.trainer.evaluate import tokenize_prompt

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("offline:tiny-llama"))
    tokenizer.chat_template = THINKING_TEMPLATE
    prompt = Prompt(text="What is 2 + 3?")
    thinking = tokenize_prompt(tokenizer, prompt, None)
    direct = tokenize_prompt(tokenizer, prompt, None, {"enable_thinking": False})
    assert tokenizer.decode(thinking).endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(direct).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # These ids are what the trainer sends (RolloutClient posts prompt_token_ids; vLLM never renders the text) and
    # what it trains on (the group keeps them for build_batch): one rendering serves both sides.
    assert direct[: len(thinking)] == thinking and len(direct) > len(thinking)
