"""`grpolora run` end to end, as a user runs it: a trainer and two vLLM inference replicas as Ray actors on this
machine, a tiny model, real adapter sync every step; then a second run resumes from the checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from grpolora.api.status import TrainerStatus
from tests.helpers import ROOT

pytestmark = pytest.mark.vllm

JOB = {
    "apiVersion": "grpolora.dev/v1alpha1",
    "kind": "GRPOLoraJob",
    "metadata": {"name": "e2e"},
    "spec": {
        "model": {"name": "offline:tiny-llama", "dtype": "float32"},
        "lora": {"rank": 8, "alpha": 16},
        "grpo": {
            "steps": 3,
            "promptsPerStep": 2,
            "generationsPerPrompt": 4,
            "maxNewTokens": 16,
            "learningRate": 1.0e-3,
        },
        "task": {"name": "keyword"},
        "trainer": {"gpusPerReplica": 0},
        "inference": {"replicas": 2, "gpusPerReplica": 0, "kvCacheGiB": 1, "maxModelLen": 256},
        "sync": {"backend": "gloo", "timeoutSeconds": 60},
        "checkpoint": {"everySteps": 2},
    },
}


def grpolora_run(job: dict, tmp_path: Path, run_dir: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / f"{job['spec']['grpo']['steps']}-steps.yaml"
    path.write_text(yaml.safe_dump(job))
    return subprocess.run(
        [sys.executable, "-P", "-m", "grpolora.cli", "run", str(path), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local-run")
    run_dir = tmp / "run"
    result = grpolora_run(JOB, tmp, run_dir)
    assert result.returncode == 0, result.stderr[-6000:]
    return tmp, run_dir, result


def test_every_step_syncs_with_exact_logprobs(first_run):
    _, run_dir, result = first_run
    steps = records(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["sync_round"] for r in steps] == [1, 2, 3]  # syncRound equals steps
    assert all(r["on_policy"] and r["rollout_version"] == r["step"] - 1 for r in steps)
    worst = max(r["mismatch_max_abs"] for r in steps)
    print(f"largest |logprob_trainer - logprob_vllm| over the run: {worst:.2e}")
    assert worst <= 1e-3
    assert all(r["sync_bytes"] > 0 and r["seconds"]["sync"] > 0 for r in steps)
    assert "mean reward, first 3 steps" in result.stdout


def test_run_folder_holds_adapter_plot_logs_and_final_status(first_run):
    _, run_dir, _ = first_run
    from peft import PeftConfig

    config = PeftConfig.from_pretrained(run_dir / "final-adapter")  # the standard peft format
    assert config.r == 8
    assert (run_dir / "plot.png").stat().st_size > 10_000
    assert {p.name for p in (run_dir / "logs").iterdir()} == {"trainer-0.log", "inference-0.log", "inference-1.log"}
    status = TrainerStatus.model_validate_json((run_dir / "status.json").read_text())
    assert status.phase == "Succeeded" and status.step == status.total_steps == 3 and status.sync_round == 3
    assert set(status.sync_members) == {0, 1}


def test_status_contract_is_the_documented_one():
    documented = (ROOT / "docs" / "status.md").read_text()
    for field in TrainerStatus.model_fields.values():
        assert f"`{field.alias}`" in documented, f"document {field.alias} in docs/status.md"


def test_a_second_run_resumes_from_the_checkpoint_and_pipelines(first_run):
    tmp, run_dir, _ = first_run
    longer = json.loads(json.dumps(JOB))
    longer["spec"]["grpo"]["steps"] = 5
    longer["spec"]["grpo"]["pipelined"] = True
    result = grpolora_run(longer, tmp, run_dir)
    assert result.returncode == 0, result.stderr[-6000:]
    steps = records(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]  # the step count continues
    rounds = [r["sync_round"] for r in steps]
    assert rounds == sorted(rounds) and len(set(rounds)) == 5  # and sync rounds never go back
    assert steps[3]["epoch"] > steps[2]["epoch"]
    # Pipelined: step 5's rollouts were generated while step 4 trained, from the adapter before step 4's update.
    assert steps[3]["on_policy"] and not steps[4]["on_policy"]
    assert steps[4]["rollout_version"] == steps[3]["rollout_version"] < steps[3]["sync_round"]
    # The step-4 checkpoint was written after step 5's prompts had been drawn for the pipelined generation: it
    # records the prompts trained on (4 steps), so a run resumed from it trains on step 5's prompts, not past them.
    state = torch.load(run_dir / "checkpoints" / "step-00000004" / "trainer_state.pt", weights_only=True)
    assert state["progress"]["prompts_consumed"] == 4 * JOB["spec"]["grpo"]["promptsPerStep"]


def test_a_bad_reward_plugin_fails_before_any_worker_starts(tmp_path):
    job = json.loads(json.dumps(JOB))
    job["spec"]["task"] = {"name": "keyword", "reward": "no_such_module:score"}
    result = grpolora_run(job, tmp_path, tmp_path / "run")
    assert result.returncode == 1
    assert "spec.task.reward" in result.stderr and "no_such_module" in result.stderr
    assert not (tmp_path / "run" / "logs").exists()


def test_a_failing_worker_stops_the_run_with_its_error(tmp_path):
    job = json.loads(json.dumps(JOB))
    job["spec"]["model"]["name"] = "/nonexistent/model"
    result = grpolora_run(job, tmp_path, tmp_path / "run")
    assert result.returncode == 1
    assert "exited with code 1" in result.stderr and "model path /nonexistent/model does not exist" in result.stderr
    leftovers = subprocess.run(["pgrep", "-f", "grpolora.cli worker"], capture_output=True, text=True).stdout
    assert not leftovers.strip(), f"worker processes left running: {leftovers}"
