"""`grpolora run` with two trainer ranks (FSDP2 over gloo on CPUs) and one vLLM replica, end to end: every
collective between rank 0 and its follower matches (steps, syncs every other step, checkpoints, the final adapter),
then a run interrupted mid-way resumes from its checkpoint on both ranks.

The job syncs every second step, so it also shows the off-policy accounting: a step whose rollouts came from an
adapter older than the trainer's weights is off-policy, and one whose rollouts came from exactly its weights is
on-policy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from grpolora.api.status import TrainerStatus

pytestmark = pytest.mark.vllm

JOB = {
    "apiVersion": "grpolora.dev/v1alpha1",
    "kind": "GRPOLoraJob",
    "metadata": {"name": "ranks"},
    "spec": {
        "model": {"name": "offline:tiny-llama", "dtype": "float32"},
        "lora": {"rank": 8, "alpha": 16},
        "grpo": {
            "steps": 4,
            # 3 prompts x 3 samples = 9 sequences over 2 ranks and micro-batches of 2: rank 1 holds 4 sequences
            # and rank 0 five, so rank 1 meets a micro-batch with nothing in it.
            "promptsPerStep": 3,
            "generationsPerPrompt": 3,
            "microBatchSize": 2,
            "maxNewTokens": 12,
            "learningRate": 1.0e-3,
            "syncEverySteps": 2,
        },
        "task": {"name": "keyword"},
        "trainer": {"replicas": 2, "gpusPerReplica": 0},
        "inference": {"replicas": 1, "gpusPerReplica": 0, "kvCacheGiB": 1, "maxModelLen": 256},
        "sync": {"backend": "gloo", "timeoutSeconds": 60},
        "checkpoint": {"everySteps": 1},
    },
}


def command(job: dict, tmp_path: Path, run_dir: Path) -> list[str]:
    path = tmp_path / f"{job['metadata']['name']}-{job['spec']['grpo']['steps']}.yaml"
    path.write_text(yaml.safe_dump(job))
    return [sys.executable, "-P", "-m", "grpolora.cli", "run", str(path), "--run-dir", str(run_dir)]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_trainer_ranks_run_to_the_end_with_a_final_adapter(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(command(JOB, tmp_path, run_dir), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-6000:]
    status = TrainerStatus.model_validate_json((run_dir / "status.json").read_text())
    assert status.phase == "Succeeded" and status.step == 4
    from peft import PeftConfig

    assert PeftConfig.from_pretrained(run_dir / "final-adapter").r == 8
    steps = records(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # Syncs after steps 2 and 4. Step 1 samples version 0 = the trainer's initial weights (on-policy); step 2
    # samples version 0 again, but the trainer's weights moved in step 1: off-policy, the ratio uses vLLM's
    # behaviour logprobs. Step 3 samples version 1, exactly the trainer's weights after step 2's sync.
    assert [r["rollout_version"] for r in steps] == [0, 0, 1, 1]
    assert [r["on_policy"] for r in steps] == [True, False, True, False]
    assert [r["sync_round"] for r in steps] == [0, 1, 1, 2]
    assert all(r["mismatch_max_abs"] <= 1e-3 for r in steps if r["on_policy"])


def test_an_interrupted_two_rank_run_resumes_from_its_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    job = json.loads(json.dumps(JOB))
    job["spec"]["grpo"]["steps"] = 5
    first = subprocess.Popen(command(job, tmp_path, run_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (run_dir / "checkpoints" / "step-00000002").exists():
            assert first.poll() is None, first.communicate()[1][-6000:]
            assert time.monotonic() < deadline, "the first run never reached its second checkpoint"
            time.sleep(0.5)
        os.kill(first.pid, signal.SIGINT)  # Ctrl-C
        assert first.wait(timeout=120) == 130
    finally:
        if first.poll() is None:
            first.kill()
    done = len(records(run_dir))
    assert 2 <= done < 5
    second = subprocess.run(command(job, tmp_path, run_dir), capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-6000:]
    status = TrainerStatus.model_validate_json((run_dir / "status.json").read_text())
    assert status.phase == "Succeeded" and status.step == 5
    steps = records(run_dir)
    assert steps[-1]["step"] == 5
    rounds = [r["sync_round"] for r in steps]
    assert rounds == sorted(rounds)  # sync rounds never go back across the restart
    assert (run_dir / "final-adapter" / "adapter_model.safetensors").exists()
