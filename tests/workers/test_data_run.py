"""`grpolora run` on a user's data: a Parquet dataset with a held-out split, a remote reward service plus a built-in
reward, MLflow tracking and periodic evaluation, all on loopback. The run must leave the adapter (naming its base
model), samples, eval figures and an MLflow run holding the metrics."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpolora.api.status import TrainerStatus
from tests.workers.hubserver import TOKEN, HubServer
from tests.workers.rewardserver import RewardServer
from tests.workers.test_local_run import grpolora_run, records
from tests.workers.test_tracking import tensorboard_scalars
from tests.workers.trackservers import mlflow_server

pytestmark = pytest.mark.vllm

STEPS = 3
LONG_PROMPT = "Please add these numbers: " + " + ".join(str(i) for i in range(300))


def job(reward_url: str, mlflow_uri: str, hub_url: str) -> dict:
    return {
        "apiVersion": "grpolora.dev/v1alpha1",
        "kind": "GRPOLoraJob",
        "metadata": {"name": "data-run"},
        "spec": {
            "model": {"name": "offline:tiny-llama", "dtype": "float32"},
            "lora": {"rank": 8, "alpha": 16},
            # A recipe beyond the default (two passes in two mini-batches, a cosine schedule after one warmup step,
            # the soft length penalty) so that the figures it adds are checked on the path a run takes.
            "grpo": {
                "steps": STEPS,
                "promptsPerStep": 2,
                "generationsPerPrompt": 4,
                "maxNewTokens": 8,
                "updatesPerBatch": 2,
                "miniBatches": 2,
                "lrSchedule": "cosine",
                "warmupSteps": 1,
                "overlongBuffer": 4,
                # Synced after steps 2 and 3 only: step 2 samples the adapter from before step 1's update.
                "syncEverySteps": 2,
            },
            "task": {
                "dataset": {
                    "path": "data",
                    "promptField": "question",
                    "answerField": "solution",
                    "eval": {"split": "test", "maxPrompts": 3},
                },
                "reward": [
                    {"url": reward_url, "label": "judge", "weight": 1.0, "batchSize": 3, "concurrency": 2},
                    {"name": "math", "weight": 0.5},
                ],
            },
            "trainer": {"gpusPerReplica": 0},
            "inference": {"replicas": 1, "gpusPerReplica": 0, "kvCacheGiB": 1, "maxModelLen": 256},
            "sync": {"backend": "gloo", "timeoutSeconds": 60},
            "checkpoint": {"everySteps": STEPS},
            # The adapter of step 2 is pushed in the background while step 3 trains; the final one at the end.
            "output": {
                "push": {
                    "hub": {"repo": "org/data-run", "endpoint": hub_url, "secretName": "hf-hub"},
                    "everySteps": 2,
                }
            },
            "tracking": {"mlflow": {"trackingUri": mlflow_uri, "experiment": "data-run"}, "samplesEverySteps": 2},
            "eval": {"everySteps": 2, "maxNewTokens": 6},
        },
    }


@pytest.fixture(scope="module")
def data_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data-run")
    for split, count in (("train", 3), ("test", 5)):
        rows = {"question": [f"What is {i} + {i}?" for i in range(count)], "solution": [2 * i for i in range(count)]}
        if split == "train":  # a prompt longer than the model length (256): skipped, never sent to the replicas
            rows["question"].append(LONG_PROMPT)
            rows["solution"].append(0)
        (tmp / "data").mkdir(exist_ok=True)
        pq.write_table(pa.table(rows), tmp / "data" / f"{split}-00000-of-00001.parquet")
    (tmp / "secrets" / "hf-hub").mkdir(parents=True)
    (tmp / "secrets" / "hf-hub" / "HF_TOKEN").write_text(TOKEN)
    reward, hub = RewardServer().start(), HubServer().start()
    try:
        # The trainer reads the Secret from GRPOLORA_SECRETS_DIR; the emulator speaks LFS, not Xet.
        with mlflow_server(tmp / "mlflow") as uri, pytest.MonkeyPatch.context() as env:
            env.setenv("GRPOLORA_SECRETS_DIR", str(tmp / "secrets"))
            env.setenv("HF_HUB_DISABLE_XET", "1")
            result = grpolora_run(job(f"{reward.url}/score", uri, hub.url), tmp, tmp / "run")
            assert result.returncode == 0, result.stderr[-6000:]
            yield tmp / "run", uri, reward.record, result, hub
    finally:
        reward.stop()
        hub.stop()


def test_metrics_hold_each_reward_and_the_evaluations(data_run):
    run_dir, _, served, _, _ = data_run
    steps = records(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(set(r["rewards"]) == {"judge", "math"} for r in steps)
    assert all(r["reward_mean"] == pytest.approx(r["rewards"]["judge"] + 0.5 * r["rewards"]["math"]) for r in steps)
    # The recipe: 2 x 2 updates a step at the cosine's rates (warmup 1: 1, then (1 + cos(pi * s / 2)) / 2 for
    # s = 0, 1 of the 2 decay steps), and the length penalty of completions near the 8-token limit.
    assert [r["updates"] for r in steps] == [4, 4, 4]
    assert [r["learning_rate"] for r in steps] == pytest.approx([1e-5, 1e-5, 0.5e-5])
    assert all(-1.0 <= r["overlong_penalty_mean"] <= 0 and 0 <= r["completions_truncated"] <= 8 for r in steps)
    assert [r["step"] for r in steps if "eval_reward" in r] == [2, 3]  # every 2 steps and after the last
    assert all(r["eval_prompts"] == 3 for r in steps if "eval_reward" in r)
    # The service saw the training completions (2 prompts x 4 per step) and the held-out ones (3 per evaluation).
    prompts = {item["prompt"] for body in served.requests for item in body["items"]}
    assert {"What is 0 + 0?", "What is 1 + 1?", "What is 2 + 2?"} <= prompts  # the test split's first 3
    assert sum(len(b["items"]) for b in served.requests) == STEPS * 8 + 2 * 3
    # 6 prompts trained from 3 short rows: two epochs, each also drawing (and skipping) the long row.
    assert LONG_PROMPT not in prompts and status_of(run_dir).prompts_skipped >= 1
    assert steps[-1]["prompts_skipped"] == status_of(run_dir).prompts_skipped
    status = TrainerStatus.model_validate_json((run_dir / "status.json").read_text())
    assert status.phase == "Succeeded" and status.eval_reward == steps[-1]["eval_reward"] and status.eval_step == 3
    assert status.adapter_path == str((run_dir / "final-adapter").resolve())


def test_steps_are_on_policy_only_when_sampled_from_the_trainers_exact_weights(data_run):
    """grpo.syncEverySteps 2: step 1 samples version 0, the trainer's initial weights (on-policy); step 2 samples
    version 0 again, but step 1 moved the trainer's weights: off-policy, its ratio uses vLLM's behaviour logprobs.
    The sync after step 2 sends version 1, exactly the weights step 3 trains from: on-policy again."""
    steps = records(data_run[0])
    assert [r["rollout_version"] for r in steps] == [0, 0, 1]
    assert [r["sync_round"] for r in steps] == [0, 1, 2]
    assert [r["on_policy"] for r in steps] == [True, False, True]
    assert all(r["mismatch_max_abs"] <= 1e-3 for r in steps if r["on_policy"])
    assert steps[1]["importance_weight_mean"] > 0
    assert 0 < steps[1]["importance_weight_ess"] <= 1 + 1e-6  # (sum w)^2 / (n sum w^2), float32 sums


def test_the_figures_a_trl_user_reads_first_are_there_under_trls_names(data_run):
    """frac_reward_zero_std, completions/{mean,min,max}_length, completions/clipped_ratio and clip_ratio/* as TRL's
    GRPOTrainer logs them (issue 47), in metrics.jsonl and in every tracker; `tokens` is the step's completion
    tokens (docs/metrics.md); no NaN or Infinity anywhere in the file."""
    run_dir, uri, _, _, _ = data_run

    def refuse(constant: str):
        raise AssertionError(f"metrics.jsonl holds {constant}, which is not JSON")

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line, parse_constant=refuse) for line in lines]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    for r in steps:
        c = r["completions"]
        assert 1 <= c["min_length"] <= c["mean_length"] <= c["max_length"] <= 8, c
        assert c["clipped_ratio"] == r["completions_truncated"] / 8  # 2 prompts x 4 completions
        assert (c["max_terminated_length"] == 0) == (r["completions_truncated"] == 8)
        assert r["tokens"] == round(c["mean_length"] * 8)  # every generated token is in the loss here
        assert r["frac_reward_zero_std"] in (0.0, 0.5, 1.0)  # 2 groups a step
        clip = r["clip_ratio"]
        assert clip["region_mean"] == pytest.approx(clip["low_mean"] + clip["high_mean"])
        assert clip["region_mean"] <= r["clip_fraction"] + 1e-12
        # TRL's entropy averaging (mean of the groups' token means) equals the token mean when every completion
        # has the same length, and weighs short groups more otherwise.
        if c["min_length"] == c["max_length"]:
            assert r["entropy_group_mean"] == pytest.approx(r["entropy"], rel=1e-6)
        assert r["entropy_group_mean"] > 0
        # The samples of steps 2 and 3 hold all 8 completions, group after group: the flat share recomputed.
        rows = [s for s in samples if s["step"] == r["step"]]
        if rows:
            groups = [{s["reward"] for s in rows[i : i + 4] if s["reward"] is not None} for i in (0, 4)]
            assert r["frac_reward_zero_std"] == sum(len(g) <= 1 for g in groups) / 2
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    for name in ("frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio", "clip_ratio/low_mean"):
        assert [s for s, _ in scalars[name]] == [1, 2, 3], name
    import mlflow

    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("data-run").experiment_id])
    assert {"frac_reward_zero_std", "completions/max_length", "clip_ratio/region_mean"} <= set(run.data.metrics)


def status_of(run_dir) -> TrainerStatus:
    return TrainerStatus.model_validate_json((run_dir / "status.json").read_text())


def test_adapter_samples_and_tensorboard_in_the_run_folder(data_run):
    run_dir, _, _, result, _ = data_run
    config = json.loads((run_dir / "final-adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "offline:tiny-llama"
    assert "base model: `offline:tiny-llama`" in (run_dir / "final-adapter" / "README.md").read_text()
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == [2, 3] and len(samples) == 2 * 2 * 4
    assert set(samples[0]) == {"step", "prompt", "answer", "completion", "reward", "advantage", "rewards"}
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert [s for s, _ in scalars["reward_mean"]] == [1, 2, 3] and [s for s, _ in scalars["eval_reward"]] == [2, 3]
    assert (run_dir / "plot.png").exists() and "samples.jsonl" in result.stdout
    # The terminal progress shows the first sample of each sampled step.
    shown = [line for line in result.stderr.splitlines() if " sample: " in line]
    assert [line.split(" sample: ")[0] for line in shown] == ["step 2", "step 3"], result.stderr[-3000:]
    assert f'"{samples[0]["prompt"][:5]}' in shown[0] and "(reward " in shown[0]


def test_the_adapter_of_every_2_steps_and_the_final_one_are_commits_on_the_hub(data_run):
    run_dir, _, _, _, hub = data_run
    assert hub.messages("org/data-run") == [
        "initial commit",
        "grpolora data-run: adapter at step 2",
        "grpolora data-run: final adapter after step 3",
    ]
    final = run_dir / "final-adapter"
    stored = hub.files("org/data-run")
    assert {name: stored[name] for name in ("README.md", "adapter_config.json", "adapter_model.safetensors")} == {
        f.name: f.read_bytes() for f in final.iterdir()
    }
    status = status_of(run_dir)
    head = hub.state.repos["org/data-run"].head("main")
    assert (status.last_push, status.last_push_step, status.push_error) == (
        f"{hub.url}/org/data-run/commit/{head.oid}",
        STEPS,
        None,
    )
    assert "pushed to" in status.message and not list(run_dir.glob(".push-*"))


def test_the_mlflow_run_holds_the_metrics(data_run):
    import mlflow

    run_dir, uri, _, _, _ = data_run
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("data-run").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "data-run"
    steps = records(run_dir)
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["reward_mean"])) for r in steps]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_reward")] == [2, 3]
    assert {"rewards/judge", "rewards/math", "kl", "seconds/sync"} <= set(run.data.metrics)
    assert len(client.list_artifacts(run.info.run_id, "samples")) == 2


def test_grpolora_eval_compares_the_saved_adapter_with_the_base_model(data_run):
    import subprocess
    import sys

    run_dir, _, served, _, _ = data_run
    tmp = run_dir.parent
    before = sum(len(b["items"]) for b in served.requests)
    result = subprocess.run(
        [sys.executable, "-P", "-m", "grpolora.cli", "eval", str(tmp / f"{STEPS}-steps.yaml"), "--adapter",
         str(run_dir / "final-adapter"), "--out", str(tmp / "eval.json")],
        capture_output=True, text=True, timeout=600, cwd=tmp,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    figures = json.loads((tmp / "eval.json").read_text())
    assert set(figures) == {"base", "adapter"} and all(f["eval_prompts"] == 3 for f in figures.values())
    assert set(figures["adapter"]["eval_rewards"]) == {"judge", "math"}
    assert "base     eval_reward" in result.stdout and "adapter  eval_reward" in result.stdout
    # Scored by the same rewards (the service saw 3 held-out prompts twice) ...
    assert sum(len(b["items"]) for b in served.requests) - before == 2 * 3
    # ... and, greedy on the same prompts, the final adapter scores what the run's last evaluation measured.
    last = records(run_dir)[-1]
    assert figures["adapter"]["eval_reward"] == pytest.approx(last["eval_reward"])
    assert figures["adapter"]["eval_completion_length_mean"] == pytest.approx(last["eval_completion_length_mean"])
