"""`grpolora run` of examples/calculator-agent.yaml end to end (issue 48's check: "the agent example, cut to 2 steps,
runs to the end on CPUs with conversations of more than one assistant turn and trainer-vs-vLLM mismatch <= 1e-3"),
in one run: the example as its file says, cut to 2 steps of 1 prompt x 2 episodes. SmolLM2-135M answers the
example's `openai` agent (examples/calculator_agent.py: a calculator tool, then a follow-up question) through chat
sessions on the job's own replica; the agent runs in the trainer's environment processes, and the trainer trains the
sessions' tokens as the replica generated them."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import yaml

from grpolora.api.status import TrainerStatus
from tests.helpers import ROOT, example

pytestmark = pytest.mark.vllm

EXAMPLE = example("calculator-agent.yaml")
STEPS = 2


def test_the_agent_example_runs_to_the_end_with_several_assistant_turns_and_matching_logprobs(tmp_path):
    job = copy.deepcopy(EXAMPLE)
    job["spec"]["grpo"] |= {"steps": STEPS, "promptsPerStep": 1, "generationsPerPrompt": 2}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    shutil.copy(ROOT / "examples" / "calculator_agent.py", tmp_path)  # next to the job, as the example's folder has it
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "grpolora.cli", "run", "job.yaml", "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-8000:]
    folder = run_dir  # one job: its outputs are the run's
    status = TrainerStatus.model_validate_json((folder / "status.json").read_text())
    assert status.phase == "Succeeded" and status.step == STEPS and f"Succeeded after {STEPS}/{STEPS} steps" in out
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    print([(r["episode_turns_mean"], r["episode_tool_calls"], r["mismatch_max_abs"]) for r in records])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # Both steps on-policy (maxStaleness 0): the trainer's logprobs of the generated tokens, the tools' answers and
    # the follow-up masked out, are vLLM's.
    assert all(r["on_policy"] and r["mismatch_max_abs"] <= 1e-3 for r in records)
    assert all(r["environment_errors"] == 0 and r["environment_faults"] == 0 for r in records)
    assert all(r["episode_turns_mean"] >= 2 and r["agent_segments_dropped"] == 0 for r in records)
    assert samples
    for row in samples:  # whole conversations as the session held them: the follow-up answered last
        said = [m for m in row["messages"] if m["role"] == "assistant"]
        assert len(said) == row["turns"] >= 2 and said[-1]["content"] == row["completion"]
        assert row["messages"][-2]["content"].startswith("Check your result")
