"""The environment protocol (issue 39): the built-in calculator, plugin loading with errors that name the field, and
malformed answers turned into episode faults. Pure: no model, no engine."""

from __future__ import annotations

import itertools
import sys
import textwrap
import threading
import time

import pytest

from grpolora.api import constants as c
from grpolora.api.spec import EnvironmentSpec
from grpolora.workers.environments import BUILTIN_ENVIRONMENTS, EnvironmentFault, Opening, Reply, load_environment
from grpolora.workers.environments.base import checked_opening, checked_reply
from grpolora.workers.environments.calculator import calculate
from grpolora.workers.tasks import Prompt, TaskError, TaskUnreachable
from grpolora.workers.tasks.arithmetic import ArithmeticTask
from grpolora.workers.trainer.rollout import Sampling


def test_builtin_names_agree_with_the_schema():
    assert tuple(BUILTIN_ENVIRONMENTS) == c.BUILTIN_ENVIRONMENTS


def test_calculator_episode_answers_a_call_and_ends_on_the_answer():
    prompt = next(ArithmeticTask().prompts(0))
    env = load_environment(EnvironmentSpec(builtin="calculator"))()
    opening = env.reset(prompt)
    # A worked example (user, call, result, answer) before the prompt: a small model imitates it.
    assert [m["role"] for m in opening.messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert opening.messages[-1]["content"] == f"What is {prompt.meta['expression']}?"
    assert "<calc>" in opening.messages[0]["content"]
    # Another task's prompt (no expression in its meta) is asked as it is.
    assert env.reset(Prompt("How much is 2 + 2?")).messages[-1]["content"] == "How much is 2 + 2?"
    expression = prompt.meta["expression"]
    reply = env.step({"role": "assistant", "content": f"Let me compute. <calc>{expression}</calc>"})
    assert reply == Reply([{"role": "tool", "content": f"<result>{prompt.answer}</result>"}], done=False)
    final = env.step({"role": "assistant", "content": f"Answer: {prompt.answer}"})
    assert final.done and final.reward is None  # the task's reward scores the last message


@pytest.mark.parametrize(
    ("expression", "value"),
    [("12*7", 84), ("(3 + 4) * 2", 14), ("-5 + 2", -3), ("7 / 2", 3.5), ("8 / 2", 4), ("2 ** 10", 1024)],
)
def test_calculate(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        ("__import__('os')", "not arithmetic"),
        ("1 / 0", "division by zero"),
        ("2 ** 1000", "exponent"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 300, "longer than"),
    ],
)
def test_calculate_refuses_what_is_not_arithmetic(expression, says):
    with pytest.raises(ValueError, match=says):
        calculate(expression)


@pytest.mark.parametrize(
    "expression",
    [
        "(((((9**64)**64)**64)**64)**64)",  # 31 characters, ~3.4 Gbit: hours in one long_pow holding the GIL
        "((9**64)**64)**64",  # 831k bits
        "(2**64)**64*(2**64)**64*(2**64)**64",  # products grow as powers do
        "(10.0**64)**64",  # float overflow: OverflowError, which escaped calculate
        "(9**64)**8/3",  # an integer too large for true division's float
    ],
)
def test_the_calculator_refuses_what_it_cannot_compute_quickly_and_answers_with_an_error(expression):
    """Issue 46: the built-in calculator ran in the trainer's process, and a nested power froze it (one C call holding
    the GIL); an OverflowError escaped it. Each is now refused before it is computed, as the tool's error answer."""
    with pytest.raises(ValueError, match=r"too large|overflow"):
        calculate(expression)
    reply = BUILTIN_ENVIRONMENTS["calculator"]().step({"role": "assistant", "content": f"<calc>{expression}</calc>"})
    assert not reply.done and reply.messages[0]["content"].startswith("<result>error: ")


def test_a_call_cut_at_its_stop_string_is_answered():
    # grpo.stop: ["</calc>"] ends the turn at the call; vLLM's text leaves the stop string out.
    reply = BUILTIN_ENVIRONMENTS["calculator"]().step({"role": "assistant", "content": "So <calc>6 * 7"})
    assert reply.messages == [{"role": "tool", "content": "<result>42</result>"}] and not reply.done


def test_a_bad_call_is_the_tools_answer_not_a_fault():
    env = BUILTIN_ENVIRONMENTS["calculator"]()
    reply = env.step({"role": "assistant", "content": "<calc>1/0</calc>"})
    assert not reply.done and reply.messages[0]["content"] == "<result>error: division by zero</result>"


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "guess_env.py").write_text(
        textwrap.dedent("""
        class Guess:
            def reset(self, prompt):
                return [{"role": "user", "content": "Guess a number from 1 to 10."}]
            def step(self, message):
                right = message["content"].strip() == "7"
                return ([] if right else [{"role": "user", "content": "No."}]), right, (1.0 if right else None)

        def make():
            return Guess()

        def broken():
            return object()

        NOT_CALLABLE = 3
    """)
    )
    yield tmp_path
    for name in ("guess_env",):
        sys.modules.pop(name, None)


def test_a_plugin_loads_and_plays(plugin_dir):
    factory = load_environment(EnvironmentSpec(plugin="guess_env:make"), root=plugin_dir)
    env = factory()
    assert checked_opening(env.reset(None)) == Opening([{"role": "user", "content": "Guess a number from 1 to 10."}])
    assert checked_reply(env.step({"role": "assistant", "content": "3"})) == Reply(
        [{"role": "user", "content": "No."}], False, None
    )
    assert checked_reply(env.step({"role": "assistant", "content": "7"})) == Reply([], True, 1.0)


@pytest.mark.parametrize(
    ("ref", "error", "says"),
    [
        ("no_such_env_module:make", TaskUnreachable, "cannot import module"),
        ("guess_env:nothing", TaskError, "no callable 'nothing'"),
        ("guess_env:NOT_CALLABLE", TaskError, "no callable"),
        ("guess_env:broken", TaskError, "without reset and step"),
    ],
)
def test_plugin_errors_name_the_field(plugin_dir, ref, error, says):
    with pytest.raises(error) as info:
        load_environment(EnvironmentSpec(plugin=ref), root=plugin_dir)
    assert str(info.value).startswith("spec.environment.plugin: ") and says in str(info.value)


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        ("text", "expected a Reply or (messages, done, reward)"),
        (([{"role": "narrator", "content": "x"}], False, None), "role: 'narrator'; valid: system, user"),
        (([{"role": "user", "content": 3}], False, None), "content: expected a string"),
        (([], "yes", None), "done: expected a bool"),
        (([], True, float("nan")), "reward: expected a finite float"),
        (([], False, None), "not done and no messages"),
    ],
)
def test_malformed_replies_are_faults_that_say_what_is_wrong(answer, says):
    with pytest.raises(EnvironmentFault) as info:
        checked_reply(answer)
    assert says in str(info.value)


def test_malformed_openings_are_faults():
    with pytest.raises(EnvironmentFault, match="empty"):
        checked_opening([])
    with pytest.raises(EnvironmentFault, match="tools"):
        checked_opening(Opening([{"role": "user", "content": "hi"}], tools="calc"))


# ---- environment processes (spec.environment.processes) -------------------------------------------------------------


@pytest.fixture
def hostile_dir(tmp_path):
    """Plugins that misbehave in their process: hold the GIL in C for hours, allocate past the limit, die once."""
    (tmp_path / "hostile_env.py").write_text(
        textwrap.dedent("""
        import os, re, threading
        from pathlib import Path

        TOGETHER = threading.Barrier(2, timeout=20)

        class Hostile:
            def reset(self, prompt):
                return [{"role": "user", "content": prompt.text}]

            def step(self, message):
                what = message["content"]
                if what == "regex":  # catastrophic backtracking: one C call (sre) holding the GIL for hours
                    re.match(r"(a|aa)+$", "a" * 64 + "b")
                if what == "memory":
                    bytearray(2 << 30)
                if what == "together":  # returns only once two steps are in at the same time
                    TOGETHER.wait()
                if what == "die-once":
                    marker = Path(os.environ["HOSTILE_MARKER"])
                    if not marker.exists():
                        marker.write_text("died")
                        os._exit(3)
                return [], True, 1.0

        def make():
            return Hostile()
    """)
    )
    yield tmp_path
    sys.modules.pop("hostile_env", None)


def _process_runner(tokenizer, spec):
    from grpolora.workers.environments.episode import ChatDelta
    from grpolora.workers.environments.processes import EnvironmentProcesses
    from grpolora.workers.environments.runner import EpisodeLimits, EpisodeRunner

    factory = EnvironmentProcesses(spec).start()
    return EpisodeRunner(factory, ChatDelta(tokenizer), EpisodeLimits.of(spec, 16, None)), factory


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from grpolora.workers.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("offline:smollm2-135m-instruct"))


def test_a_step_that_holds_the_gil_for_hours_ends_its_episode_at_the_step_timeout(tokenizer, hostile_dir, monkeypatch):
    """Issue 46: environment code ran on the trainer's threads, so a step holding the GIL in C froze training (and
    could not be timed out). In its own process it is ended (SIGKILL) at stepTimeoutSeconds; meanwhile the
    trainer's threads run: a heartbeat thread here keeps ticking while the step hangs."""
    from tests.workers.test_episodes import PROMPT, ScriptedReplicas

    monkeypatch.syspath_prepend(str(hostile_dir))
    spec = EnvironmentSpec(plugin="hostile_env:make", step_timeout_seconds=2.0, processes=2, episode_retries=0)
    runner, processes = _process_runner(tokenizer, spec)
    beats, stop = [], threading.Event()

    def heartbeat():
        while not stop.wait(0.05):
            beats.append(time.monotonic())

    beating = threading.Thread(target=heartbeat, daemon=True)
    beating.start()
    try:
        replicas = ScriptedReplicas(tokenizer, {0: ["regex"], 1: ["fine"]})
        pids = [w.process.pid for w in processes._workers if w is not None]
        started = time.monotonic()
        [[hog, fine]] = runner.run([PROMPT], [[1]], [0], Sampling(2, 1.0, 1.0, 8), replicas, replicas=[0], version=1)
        ended = time.monotonic()
    finally:
        stop.set()
        beating.join()
    assert "step() took longer than stepTimeoutSeconds (2 s)" in hog.episode.error
    assert fine.episode.error is None and fine.episode.reward == 1.0  # on the other process
    # The trainer's own threads ran all along: no gap of a second between heartbeats while the step hung.
    during = [b for b in beats if started <= b <= ended]
    assert len(during) > 10 and max(b - a for a, b in itertools.pairwise(during)) < 1.0
    # Its process was ended at the bound (by the call's own wait, which started as the runner's did).
    # Its process is ended (by its call's own wait, which began with the runner's): waited for as a state.
    hog_worker = processes._workers[0]
    deadline = time.monotonic() + 10
    while (hog_worker.dead is None or hog_worker.process.poll() is None) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "took longer than stepTimeoutSeconds" in hog_worker.dead and hog_worker.process.pid in pids
    assert hog_worker.process.poll() == -9  # SIGKILL
    runner.close()


def test_memory_past_the_limit_fails_in_the_environments_process_and_a_dead_one_is_replaced(
    tokenizer, hostile_dir, monkeypatch, tmp_path
):
    from tests.workers.test_episodes import PROMPT, ScriptedReplicas

    monkeypatch.syspath_prepend(str(hostile_dir))
    monkeypatch.setenv("HOSTILE_MARKER", str(tmp_path / "marker"))
    spec = EnvironmentSpec(plugin="hostile_env:make", processes=1, process_memory_mib=512, episode_retries=1,
                           error_reward=-1.0)  # fmt: skip
    runner, _ = _process_runner(tokenizer, spec)
    replicas = ScriptedReplicas(tokenizer, {0: ["memory"], 1: ["die-once"]})
    [[greedy, dying]] = runner.run([PROMPT], [[1]], [0], Sampling(2, 1.0, 1.0, 8), replicas, replicas=[0], version=1)
    # 2 GiB past a 512 MiB address space: MemoryError in its process, the episode's fault (scored), not the trainer's.
    assert greedy.episode.fault == "the environment raised MemoryError: " and greedy.episode.reward == -1.0
    # A process that died: the episode is played again on a fresh process and environment, and ends well.
    assert (dying.episode.error, dying.episode.reward) == (None, 1.0)
    assert (tmp_path / "marker").read_text() == "died"
    runner.close()


def test_steps_of_different_episodes_overlap_in_one_environment_process(tokenizer, hostile_dir, monkeypatch):
    """Two episodes' steps in one process run at once (each step waits for the other at a barrier): a process answers
    each call on a thread of its own, so I/O-bound tools are not queued one behind another."""
    from tests.workers.test_episodes import PROMPT, ScriptedReplicas

    monkeypatch.syspath_prepend(str(hostile_dir))
    runner, _ = _process_runner(tokenizer, EnvironmentSpec(plugin="hostile_env:make", processes=1, episode_retries=0))
    replicas = ScriptedReplicas(tokenizer, {0: ["together"], 1: ["together"]})
    [[one, two]] = runner.run([PROMPT], [[1]], [0], Sampling(2, 1.0, 1.0, 8), replicas, replicas=[0], version=1)
    assert (one.episode.fault, one.episode.reward, two.episode.fault, two.episode.reward) == (None, 1.0, None, 1.0)
    runner.close()


def test_a_plugin_that_cannot_load_fails_the_start_naming_the_field(plugin_dir):
    from grpolora.workers.environments.processes import EnvironmentProcesses

    with pytest.raises(TaskError, match=r"^spec.environment.plugin: 'guess_env:broken\(\)' made|without reset"):
        EnvironmentProcesses(EnvironmentSpec(plugin="guess_env:broken"), root=plugin_dir).start()
