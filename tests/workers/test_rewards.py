"""Weighted rewards: built-ins (math through math-verify), plugins, and a remote service on loopback with bounded
concurrency, retries and a bounded, clear failure; each reward's scores kept apart."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from grpolora.api import constants, contract
from grpolora.api.spec import TaskSpec
from grpolora.workers.remote_service import AuthRefused
from grpolora.workers.tasks import Prompt, TaskError, load_task
from grpolora.workers.tasks.rewards import BUILTIN_REWARDS, RewardError, math_reward
from grpolora.workers.trainer.main import exit_code
from tests.workers.rewardserver import TOKEN, RewardServer


@pytest.fixture(scope="module")
def server():
    started = RewardServer(fail_first=2, slow_seconds=5).start()
    yield started
    started.stop()


def rewarded(reward, root: Path | None = None, name: str = "arithmetic"):
    return load_task(TaskSpec.model_validate({"name": name, "reward": reward}), root=root)


ITEMS = [(Prompt(text=f"q{i}", answer=str(i)), f"the answer is {i if i % 2 else i + 1}") for i in range(10)]
EXPECTED = [0.0 if i % 2 == 0 else 1.0 for i in range(10)]


def test_builtin_names_equal_the_api_constants():
    assert tuple(BUILTIN_REWARDS) == constants.BUILTIN_REWARDS


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("so the result is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("The answer is 72.", "72", 1.0),
        ("I think 70", "72", 0.0),
        ("$x = 2\\sqrt{2}$", "\\sqrt{8}", 1.0),
        ("no idea", "3", 0.0),
        ("42", None, 0.0),
    ],
)
def test_math_reward_checks_equivalence(completion, answer, expected):
    assert math_reward("q", completion, answer) == expected


def test_weighted_rewards_are_summed_and_reported_apart(tmp_path, server):
    module = f"fmt_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        "def short(prompt, completion, answer):\n    return float(len(completion) < 17)\n"
    )
    task = rewarded(
        [
            {"name": "math", "weight": 1.0},
            {"function": f"{module}:short", "weight": 0.2},
            {"url": f"{server.url}/score", "weight": 0.5, "label": "judge"},
        ],
        tmp_path,
    )
    scores = task.score(ITEMS)
    short = [float(len(c) < 17) for _, c in ITEMS]
    assert scores.parts == {"math": EXPECTED, "short": short, "judge": EXPECTED}
    assert scores.total == pytest.approx([1.5 * e + 0.2 * s for e, s in zip(EXPECTED, short, strict=True)])
    assert task.reward(*ITEMS[1]) == pytest.approx(1.5 + 0.2 * short[1])


def test_the_single_plugin_string_stays_one_reward_of_weight_one(tmp_path):
    module = f"one_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text("def score(prompt, completion, answer):\n    return 2.0\n")
    scores = rewarded(f"{module}:score", tmp_path).score(ITEMS[:3])
    assert scores.total == [2.0, 2.0, 2.0] and scores.parts == {}


def test_remote_reward_batches_with_bounded_concurrency(server):
    before = len(server.record.requests)
    server.record.most_in_flight = 0
    task = rewarded([{"url": f"{server.url}/score", "batchSize": 2, "concurrency": 3}])
    items = ITEMS * 3
    assert task.score(items).total == EXPECTED * 3
    bodies = server.record.requests[before:]
    assert len(bodies) == 15 and all(len(b["items"]) == 2 for b in bodies)
    assert {"prompt": "q0", "completion": "the answer is 1", "answer": "0"} in [i for b in bodies for i in b["items"]]
    assert 2 <= server.record.most_in_flight <= 3


def test_remote_reward_retries_transient_failures(server):
    task = rewarded([{"url": f"{server.url}/flaky", "retries": 2, "batchSize": 7}])
    assert task.score(ITEMS[:7]).total == EXPECTED[:7]  # two 503s, then an answer
    failing = rewarded([{"url": f"{server.url}/flaky", "retries": 1, "batchSize": 3}])
    with pytest.raises(RewardError, match=r"^spec.task.reward\[0\].url: .*/flaky failed 2 time\(s\).*HTTP 503"):
        failing.score(ITEMS[:3])


def test_a_slow_service_is_a_bounded_clear_error(server):
    task = rewarded([{"url": f"{server.url}/slow", "timeoutSeconds": 0.3, "retries": 1}])
    started = time.monotonic()
    with pytest.raises(RewardError, match=r"failed 2 time\(s\) for a batch of 2: no answer within 0.3 s"):
        task.score(ITEMS[:2])
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("route", "message"),
    [
        ("refuse", r"/refuse refused the request: HTTP 400"),
        ("short", r"/short returned 2 scores for 3 items; expected 3"),
    ],
)
def test_a_wrong_answer_fails_at_once(server, route, message):
    task = rewarded([{"url": f"{server.url}/{route}", "retries": 3}])
    started = time.monotonic()
    with pytest.raises(RewardError, match=message):
        task.score(ITEMS[:3])
    assert time.monotonic() - started < 2  # not retried


def test_unreachable_service(server):
    from grpolora.testing.servers import free_port

    task = rewarded([{"url": f"http://127.0.0.1:{free_port()}/score", "retries": 0}])
    with pytest.raises(RewardError, match=r"failed 1 time\(s\).*cannot reach it"):
        task.score(ITEMS[:1])


def test_headers_come_from_a_mounted_secret(tmp_path, server, monkeypatch):
    secret = tmp_path / "secrets" / "reward-auth"
    secret.mkdir(parents=True)
    (secret / "Authorization").write_text(TOKEN + "\n")
    (secret / "..data").mkdir()  # what Kubernetes puts next to the keys
    monkeypatch.setenv("GRPOLORA_SECRETS_DIR", str(tmp_path / "secrets"))
    server.app.state.auth = True
    try:
        task = rewarded([{"url": f"{server.url}/score", "headersFrom": {"secretName": "reward-auth"}}])
        assert task.score(ITEMS[:2]).total == EXPECTED[:2]
        assert server.record.headers[-1]["authorization"] == TOKEN
        # Refused credentials are a setting to fix, not a flaky service: not retried, and the trainer exits
        # EXIT_INVALID_SPEC (78), as for a Secret that is not there.
        asked = len(server.record.requests)
        with pytest.raises(AuthRefused, match=r"^spec.task.reward\[0\].url: .*/score refused the job's credentials: "
                           r"HTTP 401.*check headersFrom"):  # fmt: skip
            rewarded([{"url": f"{server.url}/score", "retries": 3}]).score(ITEMS[:1])
        assert len(server.record.requests) == asked + 1  # asked once: not retried
        assert exit_code(AuthRefused("spec.task.reward[0].url", "refused")) == contract.EXIT_INVALID_SPEC
        with pytest.raises(TaskError, match=r"^spec.task.reward\[0\].headersFrom: Secret 'other' not found"):
            rewarded([{"url": f"{server.url}/score", "headersFrom": {"secretName": "other"}}])
    finally:
        server.app.state.auth = False


@pytest.mark.parametrize(
    ("reward", "path", "message"),
    [
        ([{"name": "math", "url": "http://x"}], "spec.task.reward[0]", "set exactly one of"),
        ([{"name": "nope"}], "spec.task.reward[0].name", "unknown built-in reward 'nope'; valid: math,"),
        ([{"name": "math", "concurrency": 3}], "spec.task.reward[0].concurrency", "applies to a remote reward"),
        ([{"url": "reward:8000"}], "spec.task.reward[0].url", "should match pattern"),
        ([{"name": "math"}, {"name": "math"}], "spec.task.reward[1].label", "'math' is already the label"),
        ([], "spec.task.reward", "an empty list"),
        ("nocolon", "spec.task.reward", "should match pattern"),
    ],
)
def test_reward_spec_errors_name_the_field(reward, path, message):
    from grpolora.api.load import InvalidJob, parse_job
    from tests.helpers import job_doc

    with pytest.raises(InvalidJob) as raised:
        parse_job(job_doc(task={"name": "arithmetic", "reward": reward}))
    assert any(p.path == path and message in p.message for p in raised.value.problems), raised.value.problems


def test_plugin_errors_in_a_list_name_the_entry(tmp_path):
    with pytest.raises(TaskError, match=r"^spec.task.reward\[1\].function: cannot import module 'no_such_mod_q'"):
        rewarded([{"name": "math"}, {"function": "no_such_mod_q:f"}], tmp_path)


def test_a_reward_list_survives_the_trip_through_the_worker_env():
    """The spec travels to the workers as to_wire() JSON, defaults included: it must validate again unchanged."""
    from grpolora.api.load import parse_job
    from grpolora.api.spec import GRPOLoraJobSpec
    from tests.helpers import job_doc

    rewards = [{"url": "http://r:1/score", "concurrency": 2}, {"name": "math", "weight": 0.5}]
    spec = parse_job(job_doc(task={"name": "arithmetic", "reward": rewards})).spec
    assert GRPOLoraJobSpec.model_validate(spec.to_wire()) == spec


def test_two_services_on_one_host_get_labels_from_host_and_path():
    """Two remote rewards on one host were both labelled by the host, and refused as a clash until each was given a
    `label`; the default now takes the path too (a service at the host's root keeps the host alone)."""
    from grpolora.api.load import parse_job
    from tests.helpers import job_doc

    rewards = [{"url": "http://rewards.svc:8000/score"}, {"url": "http://rewards.svc:8000/v1/length?x=1"},
               {"url": "https://judge.example.com"}, {"url": "http://judge2.example.com/"}]  # fmt: skip
    job = parse_job(job_doc(task={"name": "arithmetic", "reward": rewards}))
    labels = [r.metric_label for r in job.spec.task.reward]
    assert labels == ["rewards.svc_score", "rewards.svc_v1_length", "judge.example.com", "judge2.example.com"]


TRL_STYLE = '''
calls = []


def judged(prompts, completions, answer, difficulty, **kwargs):
    """TRL's shape: the whole batch at once, the dataset's other columns as keyword arguments."""
    calls.append(len(completions))
    return [None if d == "skip" else float(c.endswith(a)) * d for c, a, d in zip(completions, answer, difficulty)]


def lengths(prompts, completions):
    return [len(c) / 10 for c in completions]


def wrong_length(prompts, completions, **kwargs):
    return [1.0]
'''


def test_a_trl_style_reward_scores_the_batch_at_once_with_the_dataset_columns(tmp_path):
    """f(prompts, completions, **columns) -> list[float | None], as TRL's GRPOTrainer calls reward functions; None
    means the reward does not apply to that sample (it adds nothing to the total, and is left out of its label's
    mean), as TRL's nansum does."""
    import importlib
    import math

    module = f"trl_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(TRL_STYLE)
    task = rewarded([{"function": f"{module}:judged"}, {"function": f"{module}:lengths", "weight": 0.5}], tmp_path)
    items = [
        (Prompt(text="q0", answer="7", meta={"difficulty": 2.0}), "it is 7"),
        (Prompt(text="q1", answer="8", meta={"difficulty": 1.0}), "it is 9"),
        (Prompt(text="q2", answer="9", meta={"difficulty": "skip"}), "it is 9"),
    ]
    scores = task.score(items)
    assert importlib.import_module(module).calls == [3]  # one call for the whole batch
    judged = scores.parts["judged"]
    assert judged[:2] == [2.0, 0.0] and math.isnan(judged[2])
    assert scores.parts["lengths"] == [0.7, 0.7, 0.7]
    assert scores.total == pytest.approx([2.35, 0.35, 0.35])  # the None adds nothing
    # Metrics and samples: its mean over the samples it applies to; a sample it skips shows no score for it.
    assert scores.part_means() == pytest.approx({"judged": 1.0, "lengths": 0.7})
    import torch

    from grpolora.workers.trainer.scoring import Scored

    parts = {label: torch.tensor(v).view(1, -1) for label, v in scores.parts.items()}
    total = torch.tensor(scores.total).view(1, -1)
    assert Scored(total, parts, total, batch=None).part_means() == pytest.approx({"judged": 1.0, "lengths": 0.7})


def test_a_trl_style_reward_that_returns_the_wrong_number_of_scores_names_the_field(tmp_path):
    module = f"trl_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(TRL_STYLE)
    task = rewarded([{"function": f"{module}:wrong_length"}], tmp_path)
    with pytest.raises(RewardError, match=r"^spec.task.reward\[0\].function: .*returned 1 scores for 3 completions"):
        task.score(ITEMS[:3])


def test_a_completion_every_reward_skipped_is_unscorable_not_zero(tmp_path):
    """TRL (>= 1.x) marks a completion for which every reward function returned None unscorable (NaN), so that it
    neither enters its group's baseline nor gets an advantage; a None beside a real score still adds nothing."""
    import math

    module = f"trl_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(TRL_STYLE)
    task = rewarded([{"function": f"{module}:judged"}], tmp_path)
    items = [
        (Prompt(text="q0", answer="7", meta={"difficulty": 2.0}), "it is 7"),
        (Prompt(text="q2", answer="9", meta={"difficulty": "skip"}), "it is 9"),
    ]
    total = task.score(items).total
    assert total[0] == 2.0 and math.isnan(total[1])
