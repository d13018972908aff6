"""Experiment tracking on trainer rank 0: every step's metrics.jsonl figures, and every `samplesEverySteps` a table
of sample completions, to TensorBoard (always, `<output>/tensorboard`), MLflow and W&B (when configured) and
`<output>/samples.jsonl`.

A restarted trainer continues the same MLflow/W&B run: its id is kept in `<output>/tracking.json`. A tracker that
fails while logging is reported and dropped (training goes on: the figures are also in metrics.jsonl); one that
cannot start fails the job at start, naming the field.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from grpolora.api.spec import GRPOLoraJobSpec, MlflowSpec, WandbSpec
from grpolora.workers.secrets import export_secret

log = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
RUN_IDS_FILE = "tracking.json"
TENSORBOARD_DIR = "tensorboard"
FILE_STORE_OPT_OUT = "MLFLOW_ALLOW_FILE_STORE"


def drop_records_after(path: Path, step: int) -> int:
    """A resumed run redoes the steps after its checkpoint: drop the interrupted run's records of them from a
    JSON-lines file whose records carry their `step` (and a line cut off mid-write), so that each step is there
    once. Returns how many lines were dropped."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return 0
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            pass
    if len(kept) != len(lines):
        path.write_text("".join(f"{line}\n" for line in kept))
    return len(lines) - len(kept)


def metrics_line(record: Mapping[str, Any]) -> str:
    """One metrics.jsonl line. A non-finite number (JSON has no NaN or Infinity: json.dumps would write tokens that
    strict readers refuse) is written as null and logged by its name; the GRPO math keeps its figures finite, so
    this is a guard, not a path a healthy run takes."""
    bad: list[str] = []

    def finite(value: Any, name: str) -> Any:
        if isinstance(value, Mapping):
            return {key: finite(v, f"{name}{key}/") for key, v in value.items()}
        if isinstance(value, float) and not math.isfinite(value):
            bad.append(name.rstrip("/"))
            return None
        return value

    clean = finite(record, "")
    if bad:
        log.error("metrics.jsonl: step %s: non-finite %s written as null", record.get("step"), ", ".join(bad))
    return json.dumps(clean) + "\n"


def check_tracking(spec: GRPOLoraJobSpec) -> list[TrackingError]:
    """What `grpolora validate` can tell of the trackers from here, before a trainer fails on it at start: an MLflow
    file store, which MLflow 3 refuses ("in maintenance mode") unless the trainer's env sets the opt-out."""
    mlflow = spec.tracking.mlflow if spec.tracking else None
    if mlflow is None or urlparse(mlflow.tracking_uri).scheme not in ("", "file"):
        return []
    opted_out = any(isinstance(v, Mapping) and v.get("name") == FILE_STORE_OPT_OUT for v in spec.trainer.env)
    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE  # MLflow 3.x
    except ImportError:  # an MLflow that still takes file stores (or none installed here)
        return []
    if opted_out or MLFLOW_ALLOW_FILE_STORE.get():
        return []
    import mlflow as installed

    return [
        TrackingError(
            f"spec.tracking.mlflow.trackingUri: {mlflow.tracking_uri!r} is a file store, which MLflow "
            f"{installed.__version__} refuses (its file backend is in maintenance mode): use a tracking server "
            f"(http://...) or a database (sqlite:///<file on the output volume>), or set {FILE_STORE_OPT_OUT}=true "
            "in spec.trainer.env"
        )
    ]


class TrackingError(RuntimeError):
    """A tracker that could not start (the message starts with the spec field)."""


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric figures of a metrics record, nested dicts joined with `/` (seconds/train, rewards/math)."""
    flat: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= flatten(value, f"{name}/")
        elif isinstance(value, int | float) and math.isfinite(value) and key not in ("step", "time"):  # bools too
            flat[name] = float(value)
    return flat


class Tracker(Protocol):
    def metrics(self, step: int, figures: dict[str, float]) -> None: ...

    def samples(self, step: int, rows: Sequence[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


class TensorBoard:
    def __init__(self, folder: Path, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # Hides the events an interrupted run wrote after the checkpoint this run resumes from (TensorBoard's
        # readers purge what came before, from that step on), so each redone step shows once.
        self._writer = SummaryWriter(log_dir=str(folder), purge_step=resume_step + 1)

    def metrics(self, step: int, figures: dict[str, float]) -> None:
        for name, value in figures.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def samples(self, step: int, rows: Sequence[dict[str, Any]]) -> None:
        header = "| prompt | completion | reward | advantage |\n|---|---|---|---|\n"
        cells = [
            f"| {_cell(r['prompt'])} | {_cell(r['completion'])} | {r['reward']:.3f} | {r['advantage']:.3f} |"
            for r in rows
        ]
        self._writer.add_text("samples", header + "\n".join(cells), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


class Mlflow:
    def __init__(self, spec: MlflowSpec, run_name: str, run_id: str | None):
        import mlflow

        export_secret(spec.secret_name, "spec.tracking.mlflow.secretName")
        try:
            self._client = mlflow.MlflowClient(tracking_uri=spec.tracking_uri)
            experiment = self._client.get_experiment_by_name(spec.experiment)
            experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(spec.experiment)
            if run_id is None:
                run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
            else:
                self._client.update_run(run_id, status="RUNNING")
        except Exception as err:
            raise TrackingError(f"spec.tracking.mlflow: cannot start a run at {spec.tracking_uri}: {err}") from err
        self.run_id = run_id

    def metrics(self, step: int, figures: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = _millis()
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in figures.items()])

    def samples(self, step: int, rows: Sequence[dict[str, Any]]) -> None:
        self._client.log_dict(self.run_id, list(rows), f"samples/step-{step:06d}.json")

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


class Wandb:
    def __init__(self, spec: WandbSpec, run_name: str, run_id: str | None, folder: Path):
        import wandb

        export_secret(spec.secret_name, "spec.tracking.wandb.secretName")
        try:
            self._run = wandb.init(
                project=spec.project,
                entity=spec.entity,
                name=run_name,
                id=run_id,
                resume="allow",
                mode=spec.mode,
                dir=str(folder),
                settings=wandb.Settings(silent=True, console="off"),
            )
        except Exception as err:
            raise TrackingError(f"spec.tracking.wandb: cannot start a run: {err}") from err
        self.run_id = self._run.id
        self._table_class = wandb.Table

    def metrics(self, step: int, figures: dict[str, float]) -> None:
        self._run.log(figures, step=step)

    def samples(self, step: int, rows: Sequence[dict[str, Any]]) -> None:
        columns = ["prompt", "completion", "reward", "advantage"]
        table = self._table_class(columns=columns, data=[[r[c] for c in columns] for r in rows])
        self._run.log({"samples": table}, step=step)

    def close(self) -> None:
        self._run.finish()


class Tracking:
    """All trackers of a job, plus samples.jsonl. Call `step()` once per step, `close()` at the end."""

    def __init__(self, spec: GRPOLoraJobSpec, output_dir: Path, run_name: str, resume_step: int = 0):
        """`resume_step`: the checkpoint's step this run starts after; what an interrupted run logged after it is
        dropped from samples.jsonl and hidden in TensorBoard, as metrics.jsonl drops it (the steps are redone)."""
        self.spec = spec.tracking
        self._samples_file = output_dir / SAMPLES_FILE
        drop_records_after(self._samples_file, resume_step)
        self._ids_file = output_dir / RUN_IDS_FILE
        ids = json.loads(self._ids_file.read_text()) if self._ids_file.exists() else {}
        self._trackers: dict[str, Tracker] = {"tensorboard": TensorBoard(output_dir / TENSORBOARD_DIR, resume_step)}
        if self.spec.mlflow is not None:
            self._trackers["mlflow"] = tracker = Mlflow(self.spec.mlflow, run_name, ids.get("mlflow"))
            ids["mlflow"] = tracker.run_id
        if self.spec.wandb is not None:
            self._trackers["wandb"] = wandb = Wandb(self.spec.wandb, run_name, ids.get("wandb"), output_dir)
            ids["wandb"] = wandb.run_id
        if ids:
            self._ids_file.write_text(json.dumps(ids))

    def samples_due(self, step: int, last: bool) -> bool:
        return last or step % self.spec.samples_every_steps == 0

    def step(self, step: int, record: Mapping[str, Any], samples: Sequence[dict[str, Any]] | None = None) -> None:
        """Log one step's record (as in metrics.jsonl) and, if given, its sample table."""
        figures = flatten(record)
        if samples:
            with self._samples_file.open("a") as handle:
                for row in samples:
                    handle.write(json.dumps({"step": step, **row}) + "\n")
        for name, tracker in list(self._trackers.items()):
            try:
                tracker.metrics(step, figures)
                if samples:
                    tracker.samples(step, samples)
            except Exception:
                log.exception("tracking: %s failed at step %d; dropped (metrics.jsonl has every figure)", name, step)
                self._trackers.pop(name)

    def close(self) -> None:
        for name, tracker in self._trackers.items():
            try:
                tracker.close()
            except Exception:
                log.exception("tracking: closing %s failed", name)
        self._trackers = {}


def _millis() -> int:
    import time

    return int(time.time() * 1000)
