"""Prometheus metrics of an inference server (all declared here; served at GET /metrics)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

ADAPTER_VERSION = Gauge(
    "grpolora_inference_adapter_version", "Adapter version serving new requests (0 = base model)", registry=REGISTRY
)
GENERATED_TOKENS = Counter(
    "grpolora_inference_generated_tokens_total", "Completion tokens generated", registry=REGISTRY
)
REQUESTS = Counter("grpolora_inference_requests_total", "Generate requests by outcome", ["status"], registry=REGISTRY)
REQUEST_SECONDS = Histogram(
    "grpolora_inference_request_seconds",
    "Generate request latency",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
    registry=REGISTRY,
)
ACTIVATION_SECONDS = Histogram(
    "grpolora_inference_adapter_activation_seconds",
    "From verified buffers to the new adapter version serving (write + load + switch)",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=REGISTRY,
)
SYNC_FAILURES = Counter(
    "grpolora_inference_sync_failures_total",
    "Sync rounds or group formations that failed here, by reason",
    ["reason"],
    registry=REGISTRY,
)
