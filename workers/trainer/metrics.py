"""Prometheus metrics of trainer rank 0 (all declared here; served at GET /metrics on the status port)."""

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

STEP = Gauge("grpolora_trainer_step", "Optimizer steps completed", registry=REGISTRY)
SYNC_ROUND = Gauge(
    "grpolora_trainer_sync_round", "Adapter version last sent to the inference replicas", registry=REGISTRY
)
SYNC_EPOCH = Gauge("grpolora_trainer_sync_epoch", "Sync-group epoch (grows when the group re-forms)", registry=REGISTRY)
SYNC_SECONDS = Histogram(
    "grpolora_trainer_sync_seconds",
    "Wall time of a sync round (pack, broadcast, verify)",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
SYNC_BYTES = Counter("grpolora_trainer_sync_bytes_total", "Adapter bytes broadcast", registry=REGISTRY)
REWARD_MEAN = Gauge("grpolora_trainer_reward_mean", "Mean reward of the last step", registry=REGISTRY)
EVAL_REWARD = Gauge(
    "grpolora_trainer_eval_reward", "Mean reward of the last evaluation on the held-out prompts", registry=REGISTRY
)
KL = Gauge("grpolora_trainer_kl", "Mean k3 KL to the reference policy at the last step", registry=REGISTRY)
ENTROPY = Gauge(
    "grpolora_trainer_entropy",
    "The policy's mean token entropy (nats) over the last step's completion tokens, token-weighted, before its "
    "update (TRL's entropy averages its micro-batches' means instead)",
    registry=REGISTRY,
)
MISMATCH = Gauge(
    "grpolora_trainer_logprob_mismatch",
    "Mean exp(|logprob_trainer - logprob_vllm|) - 1 over the tokens of the last on-policy step (numerics only)",
    registry=REGISTRY,
)
POLICY_DRIFT = Gauge(
    "grpolora_trainer_policy_drift",
    "The same figure on the last off-policy step: how far the trainer moved since the version that sampled",
    registry=REGISTRY,
)
PHASE_SECONDS = Histogram(
    "grpolora_trainer_phase_seconds",
    "Time per step phase",
    ["phase"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
    registry=REGISTRY,
)
PUSH_FAILURES = Counter(
    "grpolora_trainer_push_failures_total",
    "Adapter pushes to spec.output.push that failed (during training: reported, training goes on)",
    registry=REGISTRY,
)
FRAC_REWARD_ZERO_STD = Gauge(
    "grpolora_trainer_frac_reward_zero_std",
    "Share of the last step's groups whose rewards were all equal (no signal; TRL's frac_reward_zero_std)",
    registry=REGISTRY,
)
COMPLETION_LENGTH = Gauge(
    "grpolora_trainer_completion_length_mean",
    "Mean tokens generated per completion at the last step (TRL's completions/mean_length)",
    registry=REGISTRY,
)
CLIPPED_RATIO = Gauge(
    "grpolora_trainer_completions_clipped_ratio",
    "Share of the last step's completions cut at maxNewTokens (TRL's completions/clipped_ratio)",
    registry=REGISTRY,
)


def set_step_figures(record: Mapping[str, Any]) -> None:
    """The step gauges read from its metrics.jsonl record (one source for both)."""
    FRAC_REWARD_ZERO_STD.set(record["frac_reward_zero_std"])
    COMPLETION_LENGTH.set(record["completions"]["mean_length"])
    CLIPPED_RATIO.set(record["completions"]["clipped_ratio"])
