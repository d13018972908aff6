"""`grpolora run` with grpo.maxStaleness: 2, end to end on one vLLM replica: the replica generates ahead of the
trainer into the rollout buffer, every trained group is at most 2 adapter versions behind the trainer, the
off-policy steps carry behaviour importance weights, and a checkpoint does not count buffered groups as consumed."""

from __future__ import annotations

import json

import pytest
import torch

from grpolora.api.status import TrainerStatus
from tests.workers.test_local_run import grpolora_run, records

pytestmark = pytest.mark.vllm

K = 2
PROMPTS = 2
JOB = {
    "apiVersion": "grpolora.dev/v1alpha1",
    "kind": "GRPOLoraJob",
    "metadata": {"name": "stale"},
    "spec": {
        "model": {"name": "offline:tiny-llama", "dtype": "float32"},
        "lora": {"rank": 8, "alpha": 16},
        "grpo": {
            "steps": 4,
            "promptsPerStep": PROMPTS,
            "generationsPerPrompt": 3,
            "maxNewTokens": 8,
            "learningRate": 1.0e-3,
            "maxStaleness": K,
        },
        "task": {"name": "keyword"},
        "trainer": {"gpusPerReplica": 0},
        "inference": {"replicas": 1, "gpusPerReplica": 0, "kvCacheGiB": 1, "maxModelLen": 128, "maxLoras": K + 1},
        "sync": {"backend": "gloo", "timeoutSeconds": 60},
        "checkpoint": {"everySteps": 2},
    },
}


def test_a_run_with_staleness_2_trains_only_groups_within_2_versions(tmp_path):
    run_dir = tmp_path / "run"
    result = grpolora_run(json.loads(json.dumps(JOB)), tmp_path, run_dir)
    assert result.returncode == 0, result.stderr[-6000:]
    steps = records(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        lag = r["trainer_version"] - r["rollout_version"]
        assert 0 <= lag == r["staleness_max"] <= K, r
        # On-policy exactly when the rollouts came from the trainer's current weights (synced every step).
        assert r["on_policy"] == (lag == 0), r
        if r["on_policy"]:
            assert r["importance_weight_mean"] == 0.0 and r["mismatch_max_abs"] <= 1e-3
        else:  # every token weighted by pi_trainer / pi_vllm, a positive number, truncated at the cap (2.0)
            assert r["importance_weight_mean"] > 0 and r["importance_weight_max"] >= r["importance_weight_mean"]
            assert 0.0 <= r["truncated_fraction"] <= 1.0
    # The replica ran ahead: the first steps' rollouts all came from version 0, before the trainer synced.
    assert steps[0]["on_policy"] and any(r["staleness_max"] >= 1 for r in steps)
    assert [r["trainer_version"] for r in steps] == [0, 1, 2, 3]
    # The producer is bounded, so nothing went stale enough to drop, and the status says the same.
    assert sum(r["dropped_stale"] for r in steps) == steps[-1]["dropped_stale_total"] == 0
    status = TrainerStatus.model_validate_json((run_dir / "status.json").read_text())
    assert status.phase == "Succeeded" and status.dropped_stale == 0 and status.staleness <= K
    # Step 2's checkpoint was written while later groups were buffered or in flight: only the trained prompts count.
    state = torch.load(run_dir / "checkpoints" / "step-00000002" / "trainer_state.pt", weights_only=False)
    assert state["progress"]["prompts_consumed"] == 2 * PROMPTS
