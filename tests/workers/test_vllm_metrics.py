"""vLLM's own statistics beside ours on an inference server's /metrics: the KV-cache usage, the requests running and
waiting, and the preemptions, which are what maxNumSeqs and gpuMemoryUtilization are tuned with. vLLM records them
only with its stats on (`disable_log_stats=False`): its PrometheusStatLogger (vllm/v1/metrics/loggers.py) registers
`vllm:*` series in prometheus_client's global registry, or a multiprocess one when PROMETHEUS_MULTIPROC_DIR is set
(vllm/v1/metrics/prometheus.py, get_prometheus_registry). A real CPU engine, the tiny Llama."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from grpolora.testing.servers import ServerProcess, tiny_cpu_job
from grpolora.workers.inference.metrics import VLLM_SERIES
from tests.workers.parity import greedy

pytestmark = pytest.mark.vllm


def sample(text: str, name: str) -> float | None:
    """The value of the first sample of `name` in a Prometheus text exposition."""
    found = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def test_the_engines_statistics_are_served_beside_ours(tmp_path):
    server = ServerProcess(tiny_cpu_job(), 0, tmp_path)
    try:
        server.wait_healthy()
        out = greedy(server.url, [1, 2, 3, 4], None, max_tokens=8)
        assert len(out["token_ids"]) == 8
        # The engine's logger records each step's stats as its output arrives: wait for this request's tokens.
        deadline = time.monotonic() + 30
        while (sample(text := httpx.get(f"{server.url}/metrics").text, "vllm:generation_tokens_total") or 0) < 8:
            assert time.monotonic() < deadline, text[-3000:]
            time.sleep(0.2)
        for name in VLLM_SERIES:
            assert sample(text, name) is not None, f"{name} missing from /metrics"
        assert 0 <= sample(text, "vllm:kv_cache_usage_perc") <= 1
        assert "grpolora_inference_generated_tokens_total" in text  # ours, as before
        # One exposition: every family once (a scraper refuses a repeated HELP/TYPE).
        families = re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE)
        assert len(families) == len(set(families))
    finally:
        server.stop()
