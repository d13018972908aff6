"""`kubectl get glj` and `kubectl get rpool`: each printer column reads a field the CRD's schema has, with the
column's type, and a job's default columns say why it waits or what it does, its step out of the total, and its
ready pods out of the desired, through the long first minutes of a GPU job.

The rows are rendered as the API server renders them (apiextensions-apiserver, pkg/registry/customresource/
tableconvertor/tableconvertor.go, Kubernetes 1.33: each column's jsonPath wrapped as `{<path>}`, the first result
only, a missing field a nil cell, a `date` an age) and as kubectl prints them (a nil cell is `<none>`)."""

from __future__ import annotations

import datetime
import re
from typing import Any

import pytest

from grpolora.api.crd import crd, pool_crd
from grpolora.api.status import JobStatus
from grpolora.operator import names
from grpolora.operator.reconcile import Observed, decide
from tests.unit.test_operator_reconcile import NOW, applied_view, report, statefulset, trainer_job
from tests.unit.test_startup_deadline import UNSCHEDULABLE, later

CRDS = {"glj": crd, "rpool": pool_crd}
# apiextensions-apiserver validation.go, validateSimpleJSONPath: a path of the form .foo.bar, no empty part.
SIMPLE_JSON_PATH = re.compile(r"^(\.[A-Za-z0-9_-]+)+$")
# The column types the API server accepts, and the schema types each may read (a date is an RFC 3339 string).
READS = {"integer": {"integer"}, "number": {"number", "integer"}, "string": {"string"}, "date": {"string"}}


def columns(short: str) -> list[dict[str, Any]]:
    (version,) = CRDS[short]()["spec"]["versions"]
    return version["additionalPrinterColumns"]


def schema_at(short: str, path: str) -> dict[str, Any] | None:
    """The schema node a simple JSON path reads, or None when the schema has no such field."""
    (version,) = CRDS[short]()["spec"]["versions"]
    node: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    if path == ".metadata.creationTimestamp":  # ObjectMeta's, which a CRD's schema does not restate
        return {"type": "string", "format": "date-time"}
    for part in path.strip(".").split("."):
        node = (node.get("properties") or {}).get(part)
        if node is None:
            return None
    return node


@pytest.mark.parametrize("short", list(CRDS))
def test_every_column_reads_a_field_of_the_schema_with_the_columns_type(short):
    """A column whose path names no field (a rename in the status model) prints `<none>` for ever: the API server
    accepts any simple path."""
    for column in columns(short):
        path = column["jsonPath"]
        assert SIMPLE_JSON_PATH.match(path), path
        node = schema_at(short, path)
        assert node is not None, f"{column['name']}: {path} is no field of the {short} schema"
        assert node["type"] in READS[column["type"]], f"{column['name']}: a {column['type']} column reads {node}"


def cell(obj: dict[str, Any], column: dict[str, Any], now: datetime.datetime) -> str:
    value: Any = obj
    for part in column["jsonPath"].strip(".").split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return "<none>"
    if column["type"] == "date":
        seconds = (now - datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))).total_seconds()
        return f"{int(seconds // 60)}m"
    return str(value)


def row(status: JobStatus, *, wide: bool = False, now: datetime.datetime = NOW) -> dict[str, str]:
    """The job's row under `kubectl get glj` (with -o wide: every column), by column header."""
    obj = {"metadata": {"name": "demo", "creationTimestamp": "2026-01-01T11:50:00Z"}, "status": status.to_wire()}
    shown = [c for c in columns("glj") if wide or not c.get("priority", 0)]
    return {c["name"].upper(): cell(obj, c, now) for c in shown}


def test_the_default_columns_say_why_the_job_waits_its_step_of_the_total_and_its_ready_pods():
    """The first minutes of a GPU job: `Pending 0 0 <none> 0 0` said nothing; the reason, 0/total and 1/2 do."""
    view = applied_view()
    first = decide(view, JobStatus(), Observed(), NOW)
    assert list(row(first.status)) == ["PHASE", "REASON", "STEP", "SYNCROUND", "REWARD", "READY", "RESTARTS", "AGE"]
    created = row(first.status)
    assert (created["PHASE"], created["REASON"], created["STEP"]) == ("Pending", names.R_WAITING_FOR_PODS, "0/100")
    waiting = decide(view, first.status, Observed(trainer_job(active=1), statefulset(1), pods=(UNSCHEDULABLE,)), NOW)
    shown = row(waiting.status)
    assert [shown[k] for k in ("PHASE", "REASON", "STEP", "READY")] == ["Pending", "Unschedulable", "0/100", "1/2"]
    assert "Insufficient nvidia.com/gpu" in row(waiting.status, wide=True)["MESSAGE"]


def test_once_the_pods_are_ready_the_reason_follows_the_trainer_and_then_the_training():
    view = applied_view()
    first = decide(view, JobStatus(), Observed(), NOW)
    ready = Observed(trainer_job(active=1, ready=1), statefulset(1))
    forming = decide(view, first.status, ready, NOW)
    assert (row(forming.status)["REASON"], row(forming.status)["READY"]) == (names.R_WAITING_FOR_TRAINER, "2/2")
    trained = Observed(trainer_job(active=1, ready=1), statefulset(1), trainer=report(step=3, syncRound=3))
    running = decide(view, forming.status, trained, later(60))
    shown = row(running.status)
    assert (shown["PHASE"], shown["REASON"], shown["STEP"], shown["SYNCROUND"]) == ("Running", "Training", "3/100", "3")


def test_a_job_failed_at_its_startup_deadline_shows_the_reason():
    view = applied_view()
    first = decide(view, JobStatus(), Observed(), NOW)
    stuck = Observed(trainer_job(active=1), statefulset(1), pods=(UNSCHEDULABLE,))
    failed = decide(view, first.status, stuck, later(3600))
    assert (row(failed.status)["PHASE"], row(failed.status)["REASON"]) == ("Failed", names.R_STARTUP_DEADLINE)
