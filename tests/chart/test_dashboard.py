"""The Grafana dashboard parses, queries only metrics the operator and workers export, and covers what matters."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from grpolora.operator.metrics import POOL_GAUGES
from grpolora.workers.inference.metrics import VLLM_SERIES
from tests.chart.chart import CHART

DASHBOARD = CHART / "dashboards" / "grpo-lora.json"
# vLLM's own series on an inference server's /metrics (a real engine serves each: tests/workers/test_inference_sync.py).
# The chart's PodMonitor scrapes a job's own servers with `job` = the GRPOLoraJob's name (its jobLabel, the pods'
# grpolora.dev/job label) and the target's `namespace`: the labels the per-job panels filter on. A RolloutPool's
# servers carry no grpolora.dev/job label and are not its targets (a PodMonitor of their own scrapes them with `job` =
# the pool's name): the pool row reads the operator's grpolora_pool_* series (the ServiceMonitor keeps their own
# namespace and pool labels: honorLabels).
POOL_SERIES = {name for name, _, _ in POOL_GAUGES}

# The metric contract of the operator (issue 5) and the workers (trainer rank 0 and inference /metrics).
GAUGES_AND_COUNTERS = {
    # operator
    "grpolora_jobs",
    "grpolora_job_sync_rounds_total",
    "grpolora_job_last_sync_seconds",
    "grpolora_job_last_sync_bytes",
    "grpolora_job_step",
    "grpolora_reconcile_errors_total",
    # trainer rank 0
    "grpolora_trainer_step",
    "grpolora_trainer_sync_round",
    "grpolora_trainer_sync_epoch",
    "grpolora_trainer_sync_bytes_total",
    "grpolora_trainer_reward_mean",
    "grpolora_trainer_kl",
    "grpolora_trainer_logprob_mismatch",
    # inference
    "grpolora_inference_adapter_version",
    "grpolora_inference_generated_tokens_total",
    "grpolora_inference_requests_total",
    "grpolora_inference_sync_failures_total",
    "grpolora_inference_sessions_open",
    "grpolora_inference_sessions_opened_total",
    "grpolora_inference_sessions_closed_total",
    "grpolora_inference_session_calls_total",
    *VLLM_SERIES,
    *POOL_SERIES,
}
HISTOGRAMS = {
    "grpolora_reconcile_duration_seconds",
    "grpolora_trainer_sync_seconds",
    "grpolora_trainer_phase_seconds",
    "grpolora_inference_request_seconds",
    "grpolora_inference_adapter_activation_seconds",
    "grpolora_inference_session_call_seconds",
    "grpolora_inference_calls_per_session",
    "grpolora_inference_tokens_per_session",
}
KNOWN = GAUGES_AND_COUNTERS | {f"{h}_{suffix}" for h in HISTOGRAMS for suffix in ("bucket", "sum", "count")}
# What a platform engineer must see on it (issue 6): sync rounds, sync seconds and bytes, step, reward, KL,
# mismatch, generation tokens/s, reconcile errors and latency.
REQUIRED = {
    "grpolora_job_sync_rounds_total",
    "grpolora_job_last_sync_seconds",
    "grpolora_job_last_sync_bytes",
    "grpolora_job_step",
    "grpolora_trainer_sync_seconds_bucket",
    "grpolora_trainer_sync_bytes_total",
    "grpolora_trainer_reward_mean",
    "grpolora_trainer_kl",
    "grpolora_trainer_logprob_mismatch",
    "grpolora_inference_generated_tokens_total",
    "grpolora_reconcile_errors_total",
    "grpolora_reconcile_duration_seconds_bucket",
    # vLLM's own figures, what maxNumSeqs and gpuMemoryUtilization are tuned with (issue 38).
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
    # A RolloutPool: its attached jobs, its LoRA slots, its queue.
    "grpolora_pool_jobs_attached",
    "grpolora_pool_jobs_waiting",
    "grpolora_pool_lora_slots",
    "grpolora_pool_lora_slots_free",
    # Agents' chat sessions on the replicas (issue 48): how many, how they end, their calls' outcomes and latency.
    "grpolora_inference_sessions_open",
    "grpolora_inference_session_calls_total",
    "grpolora_inference_session_call_seconds_bucket",
}
PROMQL_FUNCTIONS = {"sum", "rate", "increase", "histogram_quantile", "max", "min", "avg", "count", "label_values"}
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset"}


def identifiers(expr: str) -> list[str]:
    """Metric names and function names in a PromQL expression (labels, strings, ranges and groupings removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r",\s*[a-z_]+\s*\)", ")", text)  # the label argument of label_values(metric, label)
    return re.findall(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", text)


def metrics_in(expr: str) -> set[str]:
    return {i for i in identifiers(expr) if i not in PROMQL_FUNCTIONS | PROMQL_KEYWORDS}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out += panel.get("panels", [])  # collapsed rows keep their panels inside
    return out


def queries(board: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(board) for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return exprs


def test_identifier_extraction():
    expr = 'histogram_quantile(0.95, sum by (le, job) (rate(grpolora_x_bucket{job=~"$job", a="b}"}[5m])))'
    assert metrics_in(expr) == {"grpolora_x_bucket"}
    assert metrics_in("sum by (phase) (grpolora_jobs) / on (phase) up") == {"grpolora_jobs", "up"}
    assert metrics_in('label_values(grpolora_job_step{namespace=~"$namespace"}, job)') == {"grpolora_job_step"}


def test_dashboard_is_a_grafana_dashboard():
    board = dashboard()
    assert board["uid"] == "grpo-lora" and board["title"] and board["schemaVersion"] >= 36
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["datasource", "namespace", "job", "pool"]
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(board):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_panels_do_not_overlap():
    occupied: dict[tuple[int, int], str] = {}
    for panel in panels(dashboard()):
        pos = panel["gridPos"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in occupied, f"{panel['title']} overlaps {occupied[(x, y)]}"
                occupied[(x, y)] = panel["title"]


@pytest.mark.parametrize("expr", queries(dashboard()))
def test_every_query_uses_only_exported_metrics(expr):
    found = metrics_in(expr)
    assert found, f"no metric in {expr!r}"
    unknown = found - KNOWN
    assert not unknown, f"{sorted(unknown)} are not exported by the operator or the workers"
    for name in found:
        if any(name == f"{h}_bucket" for h in HISTOGRAMS):
            assert "histogram_quantile" in expr and "le" in expr, f"{name} without histogram_quantile by le"
        if name.endswith("_total"):
            assert re.search(rf"(rate|increase)\({name}\b", expr) or expr.strip().startswith(name), expr


def test_dashboard_covers_what_an_operator_of_the_system_needs():
    used = set().union(*(metrics_in(q) for q in queries(dashboard())))
    assert not REQUIRED - used, f"not on the dashboard: {sorted(REQUIRED - used)}"


def test_per_job_panels_filter_by_the_namespace_and_job_variables():
    for panel in panels(dashboard()):
        for target in panel.get("targets", []):
            expr = target["expr"]
            used = metrics_in(expr)
            per_job = used - {"grpolora_jobs"} - {m for m in KNOWN if "reconcile" in m} - POOL_SERIES
            if per_job:
                assert 'namespace=~"$namespace"' in expr and 'job=~"$job"' in expr, (panel["title"], expr)
            if used & POOL_SERIES:
                assert not per_job, (panel["title"], "a pool's series beside a job's")
                assert 'namespace=~"$namespace"' in expr and 'pool=~"$pool"' in expr, (panel["title"], expr)


def test_the_pool_variable_lists_the_pools_the_operator_reports():
    (pool,) = [v for v in dashboard()["templating"]["list"] if v["name"] == "pool"]
    assert metrics_in(pool["query"]["query"]) <= POOL_SERIES and pool["multi"] and pool["includeAll"]
    assert 'namespace=~"$namespace"' in pool["query"]["query"] and pool["query"]["query"].endswith(", pool)")
