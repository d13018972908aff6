"""Tracking: every step's figures (as in metrics.jsonl) and sample tables go to TensorBoard files, a real MLflow
server on loopback and W&B (offline), plus samples.jsonl; a restarted trainer continues the same runs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from grpolora.api.load import parse_job
from grpolora.workers.tracking import Tracking, TrackingError, flatten
from tests.helpers import job_doc
from tests.workers.trackservers import mlflow_server

RECORD = {
    "step": 1,
    "reward_mean": 0.5,
    "rewards": {"math": 0.25, "judge": 1.0},
    "on_policy": True,
    "seconds": {"train": 1.5},
    "eval_reward": 0.75,
    "time": 1.0,
}
SAMPLES = [{"prompt": "What is 1 + 1?", "answer": "2", "completion": "2 | yes\nok", "reward": 1.0, "advantage": 0.5}]


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


def spec(**tracking):
    return parse_job(job_doc(tracking=tracking)).spec


def test_flatten_keeps_numbers_and_joins_nested_names():
    assert flatten(RECORD) == {
        "reward_mean": 0.5,
        "rewards/math": 0.25,
        "rewards/judge": 1.0,
        "on_policy": 1.0,
        "seconds/train": 1.5,
        "eval_reward": 0.75,
    }


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_and_samples_are_always_written(tmp_path):
    tracking = Tracking(spec(), tmp_path, "demo")
    tracking.step(1, RECORD, SAMPLES)
    tracking.step(2, RECORD | {"reward_mean": 0.7})
    tracking.close()
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["reward_mean"] == [(1, 0.5), (2, pytest.approx(0.7))]
    assert scalars["rewards/math"] == [(1, 0.25), (2, 0.25)]
    assert [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == [
        {"step": 1, **SAMPLES[0]}
    ]
    assert not (tmp_path / "tracking.json").exists()


def test_a_resumed_run_shows_each_step_once_in_tensorboard_and_samples(tmp_path):
    """Killed after step 3 with its checkpoint at step 2, the run redoes step 3: metrics.jsonl was trimmed to the
    checkpoint, but samples.jsonl and the TensorBoard events kept the interrupted run's step 3 next to the new one."""
    killed = Tracking(spec(), tmp_path, "demo")
    for step in (1, 2, 3):
        killed.step(step, RECORD | {"reward_mean": step / 10}, SAMPLES)
    # Killed: never closed (every step was flushed). The rerun resumes from the checkpoint of step 2.
    rerun = Tracking(spec(), tmp_path, "demo", resume_step=2)
    for step in (3, 4):
        rerun.step(step, RECORD | {"reward_mean": 1 + step / 10}, SAMPLES)
    rerun.close()
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["reward_mean"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, pytest.approx(1.3)),
                                      (4, pytest.approx(1.4))]  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]


def test_samples_are_due_every_n_steps_and_at_the_last():
    tracking_spec = spec(samplesEverySteps=3)
    tracking = Tracking.__new__(Tracking)
    tracking.spec = tracking_spec.tracking
    assert [s for s in range(1, 11) if tracking.samples_due(s, last=s == 10)] == [3, 6, 9, 10]


def test_mlflow_run_holds_every_figure_and_the_samples_and_resumes(tmp_path, mlflow_uri):
    import mlflow

    job_spec = spec(mlflow={"trackingUri": mlflow_uri, "experiment": "grpo-test"})
    tracking = Tracking(job_spec, tmp_path, "demo")
    tracking.step(1, RECORD, SAMPLES)
    tracking.close()
    again = Tracking(job_spec, tmp_path, "demo")  # a restarted trainer, same output folder
    again.step(2, RECORD | {"reward_mean": 0.9})
    again.close()

    client = mlflow.MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name("grpo-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "demo" and run.info.status == "FINISHED"
    assert json.loads((tmp_path / "tracking.json").read_text()) == {"mlflow": run.info.run_id}
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.9)]
    assert client.get_metric_history(run.info.run_id, "rewards/judge")[0].value == 1.0
    assert set(run.data.metrics) == set(flatten(RECORD))
    artifact = client.download_artifacts(run.info.run_id, "samples/step-000001.json", str(tmp_path / "dl"))
    assert json.loads(Path(artifact).read_text()) == SAMPLES


def test_an_unreachable_mlflow_fails_at_start_naming_the_field(tmp_path, monkeypatch):
    from grpolora.testing.servers import free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with pytest.raises(TrackingError, match=r"^spec.tracking.mlflow: cannot start a run at http://127.0.0.1:"):
        Tracking(spec(mlflow={"trackingUri": f"http://127.0.0.1:{free_port()}"}), tmp_path, "demo")


def test_wandb_offline_run_in_the_output_folder(tmp_path, monkeypatch):
    secrets = tmp_path / "secrets" / "wandb"
    secrets.mkdir(parents=True)
    (secrets / "WANDB_SILENT").write_text("true")  # a key of the Secret becomes the trainer's environment
    monkeypatch.setenv("GRPOLORA_SECRETS_DIR", str(tmp_path / "secrets"))
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    out = tmp_path / "out"
    out.mkdir()
    tracking = Tracking(spec(wandb={"project": "grpo", "mode": "offline", "secretName": "wandb"}), out, "demo")
    tracking.step(1, RECORD, SAMPLES)
    tracking.step(2, RECORD | {"reward_mean": 0.9})
    tracking.close()
    import os

    assert os.environ["WANDB_SILENT"] == "true"
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    (log,) = run_dir.glob("run-*.wandb")
    # W&B's writer process flushes the run file after close() returns; under load that takes a moment.
    deadline = time.monotonic() + 30
    while len(history := wandb_history(log)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [(h["_step"], h["reward_mean"], h["rewards/judge"]) for h in history] == [(1, 0.5, 1.0), (2, 0.9, 1.0)]
    assert history[0]["samples/_type"] == "table-file" and "samples/_type" not in history[1]
    assert json.loads((out / "tracking.json").read_text())["wandb"] in run_dir.name


def wandb_history(path: Path) -> list[dict]:
    """The history rows of an offline W&B run file: a 7-byte `:W&B` header, then LevelDB-log records (7-byte
    header: crc, length, type) in 32 KiB blocks, each payload a wandb Record protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, position, pending, rows = path.read_bytes(), 7, b"", []
    while position + 7 <= len(data):
        room = 32768 - position % 32768
        if room < 7:  # a block's tail too short for a header is padding
            position += room
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_a_tracker_that_cannot_start_is_a_spec_error_not_a_crash():
    """The trainer's exit code for it is the spec-error one, which the operator does not restart: a restart would meet
    the same refusal (issue 26: MLflow's file store failed at step 0 with exit 1, and the job was restarted)."""
    from grpolora.api import contract
    from grpolora.workers.secrets import SecretError
    from grpolora.workers.trainer.main import exit_code
    from grpolora.workers.trainer.policy import ModelMismatch

    assert exit_code(TrackingError("spec.tracking.mlflow: cannot start a run at file:///x: ...")) == 78
    assert exit_code(SecretError("spec.tracking.mlflow.secretName: Secret 'mlflow' not found")) == 78
    assert exit_code(ModelMismatch("spec.lora.targetModules", "'q_projj' names no module of m")) == 78
    assert contract.EXIT_INVALID_SPEC == 78 and 78 in contract.TRAINER_INPUT_EXIT_CODES
    assert exit_code(RuntimeError("NCCL watchdog timeout")) == 1


def test_mlflow_refusing_file_stores_fails_at_start_and_validate_says_so_first(tmp_path, monkeypatch):
    from grpolora.cli import main
    from grpolora.workers.tracking import check_tracking

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = f"file://{tmp_path / 'mlruns'}"
    with pytest.raises(TrackingError, match="maintenance mode"):
        Tracking(spec(mlflow={"trackingUri": uri}), tmp_path, "demo")
    (found,) = check_tracking(spec(mlflow={"trackingUri": uri}))
    assert str(found).startswith(f"spec.tracking.mlflow.trackingUri: '{uri}' is a file store, which MLflow 3.")
    job = job_doc(tracking={"mlflow": {"trackingUri": uri}})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    assert main(["validate", str(path)]) == 1
    # The trainer's own opt-out, or a server, passes.
    job["spec"]["trainer"] = {"env": [{"name": "MLFLOW_ALLOW_FILE_STORE", "value": "true"}]}
    path.write_text(yaml.safe_dump(job))
    assert main(["validate", str(path)]) == 0
    assert check_tracking(spec(mlflow={"trackingUri": "http://mlflow.mlflow.svc:5000"})) == []
