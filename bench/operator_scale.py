"""Operator scale benchmark: N GRPOLoraJobs created against the Kubernetes API emulator.

The operator runs as users run it (`grpolora operator`, its own process, logged in through a kubeconfig); the
emulator (kmock, extended as in the tests) runs in this process and timestamps every object it creates. Reported:
time until every job has all its children, per-job create->children latency (p50/p99: from the job's creation to
the last of its seven children), the operator's peak RSS (VmHWM), and the API requests the operator makes per job
and minute once every job has its children (steady state: nothing changes; no trainer answers here, so this is
what the operator costs the API server beyond polling the trainers' /status).

Scenarios (`--scenario`), one steady-state row each:
- running: every job has its children, every pod ready (the default; the burst's figures are measured here only).
- queued: every job carries a Kueue queue label and nobody admits its Workload, so no job gets its trainer Job or
  StatefulSet (they wait for Kueue).
- pool-waiting: every job names one RolloutPool of maxJobs 1 whose servers never get ready, so no job is attached
  and none gets its trainer Job.
- reporting: as running, and every job's trainer rank 0 answers /status with a step that advances every
  `--step-seconds` (one fake trainer in this process answers for all: the operator's process resolves every `*.svc`
  name to it, kmock's resolver interception). Reported besides: the status writes per job and minute and per step
  (at most one per step: a write only when the status changed), and the other requests per job and minute.

With `--foreign N`, another tenant shares the namespace: N Jobs and N Services that are not the operator's (half of
them labelled by another manager), made before the operator starts, and every one of those Jobs changes once as
the steady window begins. Reported besides: the objects the operator's watch streams delivered to it (in all, in the
steady window, and of them the tenant's) and their bytes, as the emulator counts them (`Emulator.watch_objects`).

    python bench/operator_scale.py --jobs 500            # all at once (a burst)
    python bench/operator_scale.py --jobs 500 --rate 50  # paced: 50 jobs per second
    python bench/operator_scale.py --jobs 500 --scenario queued --settle 60
    python bench/operator_scale.py --jobs 500 --foreign 2000 --settle 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from grpolora.api import constants as c
from grpolora.testing.jobs import job_doc
from grpolora.testing.kube_emulator import running_cluster
from grpolora.testing.servers import cpu_seconds

NAMESPACE = "bench"
SCENARIOS = ("running", "queued", "pool-waiting", "reporting")
# Run in the operator's process for `reporting`: every `*.svc` name resolves to the bench's fake trainer.
_INTERCEPTED = (
    "import asyncio, os, re, sys, kmock; "
    "host, port = os.environ['GRPOLORA_BENCH_TRAINER'].split(':'); "
    "asyncio.run(kmock.AiohttpInterceptor(host, int(port), extra=re.compile(r'.+[.]svc')).__aenter__()); "
    "from grpolora.cli import main; sys.exit(main(sys.argv[1:]))"
)
POOL = "shared"
CHILDREN = (
    ("secrets", "{}-grpolora-token"),
    ("services", "{}-trainer"),
    ("services", "{}-inference"),
    ("networkpolicies", "{}"),
    ("poddisruptionbudgets", "{}-inference"),
    ("jobs", "{}-trainer"),
    ("statefulsets", "{}-inference"),
)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/<pid>/status")


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


async def run(
    jobs: int,
    rate: float,
    concurrency: int,
    timeout: float,
    log_path: str | None = None,
    log_level: str = "warning",
    profile_path: str | None = None,
    settle: float = 15.0,
    resync: float = 600.0,
    scenario: str = "running",
    step_seconds: float = 20.0,
    foreign: int = 0,
) -> dict[str, Any]:
    # Without the emulator's schema validation: this measures the operator, not the emulator (the operator tests
    # run with it).
    trainer = _StepTrainer(step_seconds)
    async with running_cluster(validate=False) as cluster, trainer:
        emulator = cluster.emulator
        with tempfile.TemporaryDirectory() as tmp, open(log_path or Path(tmp) / "operator.log", "wb") as log:
            kubeconfig = Path(tmp) / "kubeconfig"
            kubeconfig.write_text(
                yaml.safe_dump(
                    {
                        "apiVersion": "v1",
                        "kind": "Config",
                        "clusters": [{"name": "emulator", "cluster": {"server": cluster.url}}],
                        "users": [{"name": "bench", "user": {}}],
                        "contexts": [{"name": "bench", "context": {"cluster": "emulator", "user": "bench"}}],
                        "current-context": "bench",
                    }
                )
            )
            profile = ["-m", "cProfile", "-o", profile_path] if profile_path else []
            flags = ["--namespace", NAMESPACE, "--standalone", "--metrics-port", "0", "--health-port", "0"]
            flags += ["--resync-interval", str(resync)]
            entry = ["-c", _INTERCEPTED] if scenario == "reporting" else [*profile, "-m", "grpolora.cli"]
            await _add_tenant(cluster, foreign, concurrency)
            operator = await asyncio.create_subprocess_exec(
                *[sys.executable, "-P", *entry, "operator", *flags, "--log-level", log_level],
                env={**os.environ, "KUBECONFIG": str(kubeconfig), "GRPOLORA_BENCH_TRAINER": trainer.address},
                stdout=asyncio.subprocess.DEVNULL,
                stderr=log.fileno(),
            )
            try:
                await _wait_until_watching(emulator)
                idle_rss = peak_rss_mib(operator.pid)
                names = [f"job-{i:04d}" for i in range(jobs)]
                if scenario == "pool-waiting":
                    await cluster.apply(_pool_doc())
                cpu_before = cpu_seconds(operator.pid)
                started = time.monotonic()
                await _create_all(cluster, names, rate, concurrency, scenario)
                posted = time.monotonic()
                missing = await _wait_for_children(emulator, names, timeout, scenario)
                finished = time.monotonic()
                until_children = list(emulator.log)
                creation_cpu = cpu_seconds(operator.pid) - cpu_before
                creation_rss = peak_rss_mib(operator.pid)
                # Steady state: play the Job and StatefulSet controllers (every pod ready; no trainer is active, so
                # no /status poll), let the jobs see it, then count the operator's API requests for `settle` s.
                if scenario in ("running", "reporting"):
                    await _all_ready(cluster, names, concurrency)
                if scenario == "reporting":  # never quiet: every job writes its steps; wait until all report one
                    quiet_after = await _wait_until_reporting(cluster, names, timeout)
                else:
                    quiet_after = await _wait_until_quiet(emulator, timeout)
                steps_before = trainer.step()
                requests_before = len(emulator.log)
                delivered_before = sum(emulator.watch_objects.values())
                await _tenant_churn(cluster, foreign, concurrency)
                await asyncio.sleep(settle)
                steady_log = emulator.log[requests_before:]
                steady_requests = len(steady_log)
                steps = trainer.step() - steps_before
                delivered_steady = sum(emulator.watch_objects.values()) - delivered_before
                rss = peak_rss_mib(operator.pid)
            finally:
                operator.terminate()
                await operator.wait()
            errors = Path(log.name).read_text()[-5000:]
    if missing:
        raise SystemExit(f"{len(missing)} jobs lack children after {timeout} s, e.g. {missing[:3]}\n{errors}")
    latencies = []
    for name in names:
        job_created = emulator.created_at[("grpolorajobs", NAMESPACE, name)]
        last_child = max(
            emulator.created_at[(kind, NAMESPACE, pattern.format(name))] for kind, pattern in _children(scenario)
        )
        latencies.append(last_child - job_created)
    duplicates = len(emulator.created) - len(set(emulator.created))
    return {
        "scenario": scenario,
        "jobs": jobs,
        "rate_per_second": rate or "burst",
        "create_seconds": round(posted - started, 2),
        "all_children_seconds": round(finished - started, 2),
        "p50_ms": round(statistics.median(latencies) * 1000, 1),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 1),
        "max_ms": round(max(latencies) * 1000, 1),
        "operator_cpu_ms_per_job": round(creation_cpu / jobs * 1000, 1),
        "operator_idle_rss_mib": round(idle_rss, 1),
        "operator_peak_rss_mib_creating": round(creation_rss, 1),
        "operator_peak_rss_mib": round(rss, 1),
        "steady_requests_per_second": round(steady_requests / settle, 1) if settle else None,
        "steady_requests_per_job_per_minute": round(steady_requests / jobs / (settle / 60), 2) if settle else None,
        "steady_seconds": settle,
        **(_status_writes(steady_log, jobs, settle, steps) if scenario == "reporting" else {}),
        "quiet_after_seconds": quiet_after,
        "foreign_objects": 2 * foreign,
        "watch_objects_delivered": sum(emulator.watch_objects.values()),
        "watch_objects_delivered_steady": delivered_steady,
        "foreign_objects_delivered": _of_tenant(emulator.watch_objects),
        "watch_mib_delivered": round(sum(emulator.watch_bytes.values()) / 2**20, 2),
        "foreign_mib_delivered": round(_of_tenant(emulator.watch_bytes) / 2**20, 2),
        "steady_requests": dict(Counter(f"{verb} {res}" for verb, res, _ in steady_log).most_common()),
        "operator_api_requests": len(emulator.log),
        # What the operator asked until every job had its children (the burst is paced by the client rate limit).
        "requests_per_job_until_children": round(len(until_children) / jobs, 2),
        "requests_until_children": dict(Counter(f"{verb} {res}" for verb, res, _ in until_children).most_common()),
        "duplicate_creates": duplicates,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


async def _wait_until_quiet(emulator: Any, timeout: float, quiet: float = 10.0) -> float | None:
    """Wait until the operator has written nothing for `quiet` seconds (every job's status shows what it waits for:
    steady state), at most `timeout` seconds; the seconds it took, None if it never fell quiet."""
    started = time.monotonic()
    seen, last_write = 0, started
    while time.monotonic() - started < timeout:
        await asyncio.sleep(0.5)
        log = emulator.log
        if any(verb in ("create", "patch", "update", "delete") for verb, _, _ in log[seen:]):
            last_write = time.monotonic()
        seen = len(log)
        if time.monotonic() - last_write >= quiet:
            return round(last_write - started, 1)
    return None


def _status_writes(log: list[tuple[str, str, Any]], jobs: int, settle: float, steps: int) -> dict[str, Any]:
    """The status writes of the steady window against the steps the trainers made in it, and the rest."""
    writes = sum(1 for verb, resource, _ in log if (verb, resource) == ("patch", f"{c.PLURAL}/status"))
    others = len(log) - writes
    return {
        "steps_in_window": steps,
        "status_writes_per_job_per_minute": round(writes / jobs / (settle / 60), 2),
        "status_writes_per_step": round(writes / jobs / steps, 2) if steps else None,
        "other_requests_per_job_per_minute": round(others / jobs / (settle / 60), 2),
    }


class _StepTrainer:
    """Every trainer rank 0's /status: a step that advances every `step_seconds` from the start (all jobs alike)."""

    def __init__(self, step_seconds: float):
        self.step_seconds, self.started = step_seconds, time.monotonic()
        self.address = ""
        self._runner: web.AppRunner | None = None

    def step(self) -> int:
        return int((time.monotonic() - self.started) / self.step_seconds)

    async def _status(self, _: web.Request) -> web.Response:
        step = self.step()
        report = {"phase": "Running", "totalSteps": 1_000_000, "step": step, "syncRound": step, "epoch": 1,
                  "syncMembers": [0]}  # fmt: skip
        return web.json_response(report)

    async def __aenter__(self) -> _StepTrainer:
        app = web.Application()
        app.router.add_get("/status", self._status)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.address = f"127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def _wait_until_reporting(cluster: Any, names: list[str], timeout: float) -> float | None:
    """Wait until every job's status carries a step from its trainer; the seconds it took, None if not in time."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        jobs = cluster.objects(f"{c.GROUP}/{c.VERSION}/{c.PLURAL}", NAMESPACE)
        if all((jobs.get(name) or {}).get("status", {}).get("step") is not None for name in names):
            return round(time.monotonic() - started, 1)
        await asyncio.sleep(0.5)
    return None


async def _wait_until_watching(emulator: Any) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(verb == "watch" for verb, _, _ in emulator.log):
            return
        await asyncio.sleep(0.05)
    raise SystemExit("the operator did not start watching within 60 s")


def _children(scenario: str) -> tuple[tuple[str, str], ...]:
    """The children each job has in steady state: a queued job's workloads wait for Kueue (its Workload stands in
    for them), a job waiting for its pool has its token Secret only (its other children come with its attachment)."""
    if scenario == "queued":
        return (*CHILDREN[:5], ("workloads", "{}"))
    if scenario == "pool-waiting":
        return (("secrets", "{}" + c.TOKEN_SECRET_SUFFIX),)
    return CHILDREN


def _tenants(name: str) -> bool:
    return name.startswith("tenant-")


def _of_tenant(counts: Counter[tuple[str, str]]) -> int:
    """The sum of a per-(resource, name) count over the tenant's objects."""
    return sum(n for (_, name), n in counts.items() if _tenants(name))


def _tenant_doc(plural: str, index: int) -> dict[str, Any]:
    """Another tenant's Job or Service: half labelled by another manager, none by the operator."""
    labels = {c.LABEL_MANAGED_BY: "helm"} if index % 2 else {}
    meta = {"name": f"tenant-{index:05d}", "namespace": NAMESPACE, "labels": labels}
    if plural == "services":
        return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {"ports": [{"port": 80}]}}
    pod = {"spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": "busybox:1"}]}}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": {"template": pod}}


async def _each(count: int, concurrency: int, call: Any) -> None:
    semaphore = asyncio.Semaphore(concurrency)

    async def one(index: int) -> None:
        async with semaphore:
            await call(index)

    await asyncio.gather(*(one(index) for index in range(count)))


async def _add_tenant(cluster: Any, count: int, concurrency: int) -> None:
    async def add(index: int) -> None:
        await cluster._call("POST", f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs", _tenant_doc("jobs", index))
        await cluster._call("POST", f"/api/v1/namespaces/{NAMESPACE}/services", _tenant_doc("services", index))

    await _each(count, concurrency, add)


async def _tenant_churn(cluster: Any, count: int, concurrency: int) -> None:
    """Every one of the tenant's Jobs changes once (its controller reports a pod active)."""

    async def change(index: int) -> None:
        await cluster.set_status("batch/v1/jobs", f"tenant-{index:05d}", {"active": 1}, namespace=NAMESPACE)

    await _each(count, concurrency, change)


def _pool_doc() -> dict[str, Any]:
    return {
        "apiVersion": "grpolora.dev/v1alpha1",
        "kind": "RolloutPool",
        "metadata": {"name": POOL, "namespace": NAMESPACE},
        "spec": {"model": {"name": "Qwen/Qwen3-0.6B", "dtype": "bfloat16"}, "replicas": 1, "maxJobs": 1},
    }


def _job(name: str, scenario: str) -> dict[str, Any]:
    if scenario == "pool-waiting":
        doc = job_doc(model={"name": "Qwen/Qwen3-0.6B", "dtype": "bfloat16"}, inference={"poolRef": {"name": POOL}})
    else:
        doc = job_doc()
    doc["metadata"] = {"name": name, "namespace": NAMESPACE}
    if scenario == "queued":
        doc["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "gpu-queue"}
    return doc


async def _create_all(cluster: Any, names: list[str], rate: float, concurrency: int, scenario: str) -> None:
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for item in enumerate(names):
        queue.put_nowait(item)
    start = time.monotonic()

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            index, name = queue.get_nowait()
            if rate:
                await asyncio.sleep(max(0.0, start + index / rate - time.monotonic()))
            doc = _job(name, scenario)
            path = f"{cluster.url}/apis/grpolora.dev/v1alpha1/namespaces/{NAMESPACE}/grpolorajobs"
            async with session.post(path, json=doc) as response:
                assert response.status < 300, await response.text()

    async with aiohttp.ClientSession(headers={"User-Agent": "grpolora-tests/bench"}) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))


async def _all_ready(cluster: Any, names: list[str], concurrency: int) -> None:
    semaphore = asyncio.Semaphore(concurrency)

    async def ready(name: str) -> None:
        async with semaphore:
            await cluster.set_status("batch/v1/jobs", f"{name}-trainer", {"active": 1, "ready": 1}, namespace=NAMESPACE)
            await cluster.set_status(
                "apps/v1/statefulsets", f"{name}-inference", {"replicas": 1, "readyReplicas": 1}, namespace=NAMESPACE
            )

    await asyncio.gather(*(ready(name) for name in names))


async def _wait_for_children(emulator: Any, names: list[str], timeout: float, scenario: str) -> list[str]:
    deadline = time.monotonic() + timeout
    children = _children(scenario)
    while True:
        missing = [
            name
            for name in names
            if any((kind, NAMESPACE, pattern.format(name)) not in emulator.created_at for kind, pattern in children)
        ]
        if not missing or time.monotonic() > deadline:
            return missing
        await asyncio.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--rate", type=float, default=0.0, help="jobs created per second; 0 = all at once")
    parser.add_argument("--concurrency", type=int, default=16, help="parallel create requests")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--operator-log", metavar="PATH", help="keep the operator's log here")
    parser.add_argument("--log-level", default="warning", help="the operator's --log-level")
    parser.add_argument("--settle", type=float, default=60.0, help="seconds of steady state to count requests over")
    parser.add_argument("--scenario", choices=SCENARIOS, default="running", help="what the jobs wait for (see above)")
    parser.add_argument("--resync-interval", type=float, default=600.0, help="the operator's --resync-interval")
    parser.add_argument("--step-seconds", type=float, default=20.0, help="reporting: seconds per trainer step")
    parser.add_argument("--foreign", type=int, default=0, help="another tenant's Jobs and Services (N of each)")
    args = parser.parse_args()
    result = asyncio.run(
        run(
            args.jobs,
            args.rate,
            args.concurrency,
            args.timeout,
            args.operator_log,
            args.log_level,
            settle=args.settle,
            resync=args.resync_interval,
            scenario=args.scenario,
            step_seconds=args.step_seconds,
            foreign=args.foreign,
        )
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
