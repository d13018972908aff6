"""Every Prometheus metric of the operator, declared here and nowhere else (served at :<metrics-port>/metrics).

Per-job and per-pool figures are read from in-memory tables at scrape time (custom collectors) rather than kept in
labelled gauges, so a deleted job's or pool's series disappear with it and a restarted operator reports the current
values at once. A pool's figures are those of its status (the pass that wrote it computed them once).
`grpolora_job_sync_rounds_total` is a counter whose value is the job's syncRound: it only grows (the status never
lets it go back), and Prometheus handles the reset to 0 when the operator restarts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from grpolora.api.status import JobStatus, PoolStatus

PHASES: Final = ("Pending", "Running", "Succeeded", "Failed", "Suspended")
JOB_LABELS: Final = ("namespace", "job")
POOL_LABELS: Final = ("namespace", "pool")
# The `handler` label: Kopf's reconcile handler (create/resume/update) and the per-job monitor passes.
HANDLERS: Final = ("reconcile", "monitor")
# Reconcile passes make a handful of API calls: milliseconds normally, seconds when the API server is slow.
DURATION_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class JobFigures:
    phase: str | None
    sync_round: int
    step: int
    last_sync_seconds: float | None
    last_sync_bytes: int | None

    @classmethod
    def of(cls, status: JobStatus) -> JobFigures:
        return cls(
            phase=status.phase,
            sync_round=status.sync_round or 0,
            step=status.step or 0,
            last_sync_seconds=status.last_sync_seconds,
            last_sync_bytes=status.last_sync_bytes,
        )


class _JobTable(Collector):
    def __init__(self) -> None:
        self.jobs: dict[tuple[str, str], JobFigures] = {}

    def collect(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("grpolora_jobs", "GRPOLoraJobs known to this operator, by phase.", labels=["phase"])
        counts = dict.fromkeys(PHASES, 0)
        for figures in self.jobs.values():
            if figures.phase in counts:
                counts[figures.phase] += 1
        for phase, count in counts.items():
            jobs.add_metric([phase], count)
        yield jobs

        rounds = CounterMetricFamily(
            "grpolora_job_sync_rounds", "Adapter sync rounds completed (the job's syncRound).", labels=JOB_LABELS
        )
        seconds = GaugeMetricFamily(
            "grpolora_job_last_sync_seconds", "Duration of the job's last adapter sync round.", labels=JOB_LABELS
        )
        size = GaugeMetricFamily(
            "grpolora_job_last_sync_bytes", "Bytes broadcast in the job's last adapter sync round.", labels=JOB_LABELS
        )
        step = GaugeMetricFamily("grpolora_job_step", "Optimizer steps the job has completed.", labels=JOB_LABELS)
        for (namespace, name), figures in sorted(self.jobs.items()):
            labels = [namespace, name]
            rounds.add_metric(labels, figures.sync_round)
            step.add_metric(labels, figures.step)
            if figures.last_sync_seconds is not None:
                seconds.add_metric(labels, figures.last_sync_seconds)
            if figures.last_sync_bytes is not None:
                size.add_metric(labels, figures.last_sync_bytes)
        yield from (rounds, seconds, size, step)


@dataclass(frozen=True)
class PoolFigures:
    replicas_desired: int
    replicas_ready: int
    jobs_attached: int
    jobs_waiting: int
    lora_slots: int
    lora_slots_free: int

    @classmethod
    def of(cls, status: PoolStatus) -> PoolFigures:
        replicas = status.replicas
        slots = status.slots or 0
        return cls(
            replicas_desired=replicas.desired if replicas else 0,
            replicas_ready=replicas.ready if replicas else 0,
            jobs_attached=len(status.attached_jobs),
            jobs_waiting=len(status.waiting_jobs),
            lora_slots=slots,
            lora_slots_free=max(slots - (status.slots_in_use or 0), 0),
        )


# Each pool gauge: (name, help, the PoolFigures field it reads).
POOL_GAUGES: Final = (
    ("grpolora_pool_replicas_desired", "Server replicas the RolloutPool asks for (spec.replicas).", "replicas_desired"),
    ("grpolora_pool_replicas_ready", "Server replicas of the RolloutPool that are ready.", "replicas_ready"),
    ("grpolora_pool_jobs_attached", "Jobs the RolloutPool's servers serve.", "jobs_attached"),
    ("grpolora_pool_jobs_waiting", "Jobs waiting for a place on the RolloutPool.", "jobs_waiting"),
    ("grpolora_pool_lora_slots", "LoRA slots of each of the RolloutPool's engines (maxJobs x adaptersPerJob).",
     "lora_slots"),
    ("grpolora_pool_lora_slots_free", "LoRA slots no attached job reserves (adaptersPerJob each).", "lora_slots_free"),
)  # fmt: skip


class _PoolTable(Collector):
    def __init__(self) -> None:
        self.pools: dict[tuple[str, str], PoolFigures] = {}

    def collect(self) -> Iterator[Metric]:
        for name, documentation, field in POOL_GAUGES:
            gauge = GaugeMetricFamily(name, documentation, labels=POOL_LABELS)
            for (namespace, pool), figures in sorted(self.pools.items()):
                gauge.add_metric([namespace, pool], getattr(figures, field))
            yield gauge


class Metrics:
    """One instance per operator (own registry: two operators in one test process do not collide)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._table = _JobTable()
        self.registry.register(self._table)
        self._pools = _PoolTable()
        self.registry.register(self._pools)
        self.reconcile_errors = Counter(
            "grpolora_reconcile_errors",
            "Reconcile passes that failed (and were retried), by handler.",
            ["handler"],
            registry=self.registry,
        )
        self.reconcile_duration = Histogram(
            "grpolora_reconcile_duration_seconds",
            "Wall time of one reconcile pass, by handler.",
            ["handler"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.trainer_status_refused = Counter(
            "grpolora_trainer_status_refused",
            "Answers of trainers' /status (and pool servers' /v1/adapter) the operator refused, by reason: too_large "
            "(over grpolora.operator.trainer_client.MAX_STATUS_BYTES), too_deep (JSON nested deeper than the parser "
            "recurses), timeout.",
            ["reason"],
            registry=self.registry,
        )
        for reason in ("too_large", "too_deep", "timeout"):
            self.trainer_status_refused.labels(reason=reason)
        for handler in HANDLERS:  # exported from the start, so that rate() and alerts see a 0 rather than nothing
            self.reconcile_errors.labels(handler=handler)
            self.reconcile_duration.labels(handler=handler)

    def set_job(self, namespace: str, name: str, status: JobStatus) -> None:
        self._table.jobs[(namespace, name)] = JobFigures.of(status)

    def forget_job(self, namespace: str, name: str) -> None:
        self._table.jobs.pop((namespace, name), None)

    def set_pool(self, namespace: str, name: str, status: PoolStatus) -> None:
        self._pools.pools[(namespace, name)] = PoolFigures.of(status)

    def forget_pool(self, namespace: str, name: str) -> None:
        self._pools.pools.pop((namespace, name), None)

    @contextmanager
    def timed(self, handler: str) -> Iterator[None]:
        """Observe the duration of a pass; count it as an error if it raises."""
        start = time.perf_counter()
        try:
            yield
        except Exception:  # cancellation is not an error
            self.reconcile_errors.labels(handler=handler).inc()
            raise
        finally:
            self.reconcile_duration.labels(handler=handler).observe(time.perf_counter() - start)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
