"""Prometheus metrics of an inference server (all declared here; served at GET /metrics).

Every series carries a `job` label, "<namespace>/<name>" (grpolora.api.pool.job_key): a pool's server serves
several jobs, a job's own server labels with its own job, so a dashboard reads both alike."""

import sys
import threading
import time
from collections import deque
from collections.abc import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry(auto_describe=True)
JOB = "job"

ADAPTER_VERSION = Gauge(
    "grpolora_inference_adapter_version",
    "Adapter version serving the job's new requests (0 = base model)",
    [JOB],
    registry=REGISTRY,
)
GENERATED_TOKENS = Counter(
    "grpolora_inference_generated_tokens_total", "Completion tokens generated", [JOB], registry=REGISTRY
)
REQUESTS = Counter(
    "grpolora_inference_requests_total", "Generate requests by outcome", [JOB, "status"], registry=REGISTRY
)
CALL_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
"""A generate request's and a session call's latency alike (one request to the engine each), so the two compare."""
REQUEST_SECONDS = Histogram(
    "grpolora_inference_request_seconds",
    "Generate request latency",
    [JOB],
    buckets=CALL_SECONDS_BUCKETS,
    registry=REGISTRY,
)
ACTIVATION_SECONDS = Histogram(
    "grpolora_inference_adapter_activation_seconds",
    "From verified buffers to the new adapter version serving (write + load + switch)",
    [JOB],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=REGISTRY,
)
SYNC_FAILURES = Counter(
    "grpolora_inference_sync_failures_total",
    "Sync rounds or group formations that failed here, by reason",
    [JOB, "reason"],
    registry=REGISTRY,
)
IN_FLIGHT = Gauge(
    "grpolora_inference_sequences_in_flight",
    "Sequences (prompts x completions) of the job generating in vLLM now",
    [JOB],
    registry=REGISTRY,
)
WAITING = Gauge(
    "grpolora_inference_sequences_waiting",
    "Sequences of the job waiting for its in-flight cap (a pool's maxInFlightPerJob)",
    [JOB],
    registry=REGISTRY,
)
SESSIONS_OPEN = Gauge(
    "grpolora_inference_sessions_open",
    "Chat sessions this server holds (their first call answered, not yet closed or forgotten)",
    [JOB],
    registry=REGISTRY,
)
SESSIONS_OPENED = Counter(
    "grpolora_inference_sessions_opened_total",
    "Chat sessions opened (a session counts once its first call is answered: a refused one leaves nothing)",
    [JOB],
    registry=REGISTRY,
)
SESSIONS_CLOSED = Counter(
    "grpolora_inference_sessions_closed_total",
    "Chat sessions that left this server, by reason (closed: by its client; idle: forgotten idle to make room; "
    "detached: their job was detached from this server)",
    [JOB, "reason"],
    registry=REGISTRY,
)
CALLS_PER_SESSION = Histogram(
    "grpolora_inference_calls_per_session",
    "Answered chat completion calls of a session, observed as it leaves (closed or forgotten)",
    [JOB],
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256),
    registry=REGISTRY,
)
TOKENS_PER_SESSION = Histogram(
    "grpolora_inference_tokens_per_session",
    "Token ids a session holds as it leaves, over its segments: all of them (kind=all: prompts, the agent's "
    "messages and the generated ids, what the trainer trains on) or the generated ones (kind=generated)",
    [JOB, "kind"],
    buckets=(64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072),
    registry=REGISTRY,
)
SESSION_CALLS = Counter(
    "grpolora_inference_session_calls_total",
    "Chat completion calls of sessions by outcome (ok, or the reason of a refusal: SESSION_CALL_STATUSES)",
    [JOB, "status"],
    registry=REGISTRY,
)
SESSION_CALL_SECONDS = Histogram(
    "grpolora_inference_session_call_seconds",
    "Latency of an answered chat completion call (the route's own time: rendering, generation, parsing)",
    [JOB],
    buckets=CALL_SECONDS_BUCKETS,
    registry=REGISTRY,
)
SESSION_CALL_STATUSES = ("ok", "invalid", "limit", "version_unavailable", "pinned", "full", "error")
"""The `status` values of SESSION_CALLS, a bounded set (workers/inference/sessions.py, call_status): `invalid` a
request the session cannot serve (4xx: its body, the model's length, its template), `limit` a call past the bounds
the trainer opened the session with (maxTurns, maxEpisodeTokens: the episode is truncated), `version_unavailable` its
adapter version not served here, `pinned` a version other than the session's, `full` no room for another session,
`error` the server's own failure (5xx)."""
SESSION_LEAVE_REASONS = ("closed", "idle", "detached")
BY_JOB = {  # every metric, with its label names (in declaration order)
    ADAPTER_VERSION: (JOB,),
    GENERATED_TOKENS: (JOB,),
    REQUESTS: (JOB, "status"),
    REQUEST_SECONDS: (JOB,),
    ACTIVATION_SECONDS: (JOB,),
    SYNC_FAILURES: (JOB, "reason"),
    IN_FLIGHT: (JOB,),
    WAITING: (JOB,),
    SESSIONS_OPEN: (JOB,),
    SESSIONS_OPENED: (JOB,),
    SESSIONS_CLOSED: (JOB, "reason"),
    CALLS_PER_SESSION: (JOB,),
    TOKENS_PER_SESSION: (JOB, "kind"),
    SESSION_CALLS: (JOB, "status"),
    SESSION_CALL_SECONDS: (JOB,),
}


# vLLM's own series that this project reads (the Grafana dashboard, charts/grpo-lora-operator/dashboards/): its
# KV-cache usage, running and waiting requests, preemptions and generated tokens. Its names, not ours: a vLLM upgrade
# that renames one fails tests/workers/test_inference_sync.py.
VLLM_SERIES = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
    "vllm:generation_tokens_total",
)


def exposition() -> bytes:
    """What GET /metrics serves: ours, then vLLM's own statistics (KV-cache usage, requests running and waiting,
    preemptions, token counts; no job label: one engine serves every job of a pool). vLLM's PrometheusStatLogger
    registers its `vllm:*` series in prometheus_client's global registry, or in a multiprocess one when
    PROMETHEUS_MULTIPROC_DIR is set (vllm/v1/metrics/prometheus.py, get_prometheus_registry), which is asked only
    once vLLM is loaded. The global registry also holds prometheus_client's process and Python collectors."""
    vllm_metrics = sys.modules.get("vllm.v1.metrics.prometheus")
    engine = vllm_metrics.get_prometheus_registry() if vllm_metrics is not None else prometheus_client.REGISTRY
    return generate_latest(REGISTRY) + generate_latest(engine)


def forget(job: str) -> None:
    """Drop a detached job's series (a pool sees many jobs come and go over its life). Found through collect(),
    the public API of every prometheus_client version we allow (remove_by_labels is recent)."""
    for metric, names in BY_JOB.items():
        found = {
            tuple(sample.labels[name] for name in names)
            for family in metric.collect()
            for sample in family.samples
            if sample.labels.get(JOB) == job
        }
        for values in found:
            metric.remove(*values)


def session_opened(job: str) -> None:
    SESSIONS_OPENED.labels(job=job).inc()
    SESSIONS_OPEN.labels(job=job).inc()


def session_call(job: str, status: str, seconds: float | None = None) -> None:
    """A session's chat call by outcome (SESSION_CALL_STATUSES), among the server's requests too; `seconds`: an
    answered call's latency."""
    SESSION_CALLS.labels(job=job, status=status).inc()
    REQUESTS.labels(job=job, status=status).inc()
    if seconds is not None:
        SESSION_CALL_SECONDS.labels(job=job).observe(seconds)
        REQUEST_SECONDS.labels(job=job).observe(seconds)


def session_left(job: str, reason: str, *, calls: int, tokens: int, generated: int) -> None:
    """A session that answered calls leaves (reason: SESSION_LEAVE_REASONS): its length in calls and tokens."""
    assert reason in SESSION_LEAVE_REASONS, reason
    SESSIONS_OPEN.labels(job=job).dec()
    SESSIONS_CLOSED.labels(job=job, reason=reason).inc()
    CALLS_PER_SESSION.labels(job=job).observe(calls)
    TOKENS_PER_SESSION.labels(job=job, kind="all").observe(tokens)
    TOKENS_PER_SESSION.labels(job=job, kind="generated").observe(generated)


class TokenRate:
    """Completion tokens per second over the last `window_seconds`, all jobs together: what GET /v1/adapter reports
    and the RolloutPool's Tokens/s column sums over replicas (a Prometheus rate would need a Prometheus)."""

    def __init__(self, window_seconds: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self._window = window_seconds
        self._clock = clock
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, tokens: int) -> None:
        with self._lock:
            self._events.append((self._clock(), tokens))

    def per_second(self) -> float:
        with self._lock:
            start = self._clock() - self._window
            while self._events and self._events[0][0] <= start:
                self._events.popleft()
            return sum(tokens for _, tokens in self._events) / self._window


TOKEN_RATE = TokenRate()
