"""`grpolora run` with two trainer ranks (FSDP2 over gloo on CPUs) and one vLLM replica, end to end: every
collective between rank 0 and its follower matches (steps, syncs every other step, checkpoints, the final adapter),
across a run interrupted mid-way and resumed from its checkpoint on both ranks. One module fixture runs the job
(engine starts dominate the time); each test asserts one behaviour on what it left.

The job syncs every second step, so it also shows the off-policy accounting: a step whose rollouts came from an
adapter older than the trainer's weights is off-policy, and one whose rollouts came from exactly its weights is
on-policy."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from grpolora.api.status import TrainerStatus
from tests.workers.test_local_run import RunningCommand, grpolora_run, records

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
        # The interrupt comes once step 2's checkpoint is written; the next is the last step's, so the rerun
        # always resumes from step 2.
        "checkpoint": {"everySteps": 2},
    },
}


@dataclass
class TwoRankRun:
    run_dir: Path
    interrupt_code: int
    stderr_before_interrupt: str
    steps_before_interrupt: int
    rerun: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> TwoRankRun:
    """The job, interrupted with Ctrl-C once its second checkpoint is written, then run again to the end."""
    tmp = tmp_path_factory.mktemp("two-ranks")
    run_dir = tmp / "run"
    first = RunningCommand(JOB, tmp, run_dir)
    try:
        deadline = time.monotonic() + 600
        while not (run_dir / "checkpoints" / "step-00000002").exists():
            assert first.proc.poll() is None, first.stderr[-6000:]
            assert time.monotonic() < deadline, "the first run never reached its second checkpoint"
            time.sleep(0.1)
        first.proc.send_signal(signal.SIGINT)  # Ctrl-C
        code = first.finish(timeout=120)
    finally:
        if first.proc.poll() is None:
            os.killpg(first.proc.pid, signal.SIGKILL)
    done = len(records(run_dir))
    rerun = grpolora_run(JOB, tmp, run_dir)
    return TwoRankRun(run_dir, code, first.stderr, done, rerun)


def test_an_interrupted_two_rank_run_stops_after_its_checkpoint(two_rank_run):
    assert two_rank_run.interrupt_code == 130, two_rank_run.stderr_before_interrupt[-6000:]
    assert 2 <= two_rank_run.steps_before_interrupt < JOB["spec"]["grpo"]["steps"]
    assert (two_rank_run.run_dir / "checkpoints" / "step-00000002").exists()


def test_two_trainer_ranks_resume_and_run_to_the_end_with_a_final_adapter(two_rank_run):
    run_dir = two_rank_run.run_dir
    assert two_rank_run.rerun.returncode == 0, two_rank_run.rerun.stderr[-6000:]
    status = TrainerStatus.model_validate_json((run_dir / "status.json").read_text())
    assert status.phase == "Succeeded" and status.step == 4
    from peft import PeftConfig

    assert PeftConfig.from_pretrained(run_dir / "final-adapter").r == 8
    assert (run_dir / "final-adapter" / "adapter_model.safetensors").exists()
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4]  # each step once across the restart


def test_steps_are_on_policy_only_when_sampled_from_the_trainers_exact_weights(two_rank_run):
    steps = records(two_rank_run.run_dir)
    # The first run syncs after step 2. Step 1 samples version 0 = the trainer's initial weights (on-policy); step 2
    # samples version 0 again, but the trainer's weights moved in step 1: off-policy, the ratio uses vLLM's
    # behaviour logprobs.
    assert [r["rollout_version"] for r in steps[:2]] == [0, 0]
    assert [r["sync_round"] for r in steps[:2]] == [0, 1]
    # The rerun restores step 2's checkpoint on both ranks and syncs it as a new version (versions never go back):
    # step 3 samples exactly those weights (on-policy), step 4 the same version after step 3 moved them
    # (off-policy); the next sync is after step 4, the last.
    resumed = steps[2]["rollout_version"]
    assert resumed > 1 and [r["rollout_version"] for r in steps[2:]] == [resumed, resumed]
    assert [r["sync_round"] for r in steps[2:]] == [resumed, resumed + 1]
    assert [r["on_policy"] for r in steps] == [True, False, True, False]
    assert all(r["mismatch_max_abs"] <= 1e-3 for r in steps if r["on_policy"])
