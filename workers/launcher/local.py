"""`grpolora run job.yaml`: the same job on one machine, on Ray.

Each trainer replica and each inference replica is a Ray actor with its own resources (on a GPU machine, its
own GPUs: trainer and inference never share one). An actor runs the very worker entry point a pod runs,
`grpolora worker <role>`, with the env contract that plan() gives the operator, built for the loopback network.
The driver watches trainer rank 0's /status (as the operator does), draws a progress bar, and at the end writes
the run folder: metrics.jsonl, the final adapter, checkpoints, worker logs and plot.png.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from grpolora.api import contract
from grpolora.api.load import InvalidJob, job_warnings, load_jobs
from grpolora.api.plan import JobPlan, LoopbackNetwork, Role, plan
from grpolora.api.spec import GRPOLoraJob
from grpolora.api.status import TrainerStatus

POLL_SECONDS = 1.0
STOP_GRACE_SECONDS = 30.0


class RunFailed(RuntimeError):
    """A worker failed; the message names it and carries the end of its log."""


@dataclass(frozen=True)
class Worker:
    role: Role
    index: int
    gpus: int
    log: Path


def free_ports(count: int, *, consecutive: bool = False) -> list[int]:
    """Ports nobody listens on now (the run binds them moments later)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        candidates = list(range(first, first + count)) if consecutive else [first]
        if all(_is_free(p) for p in candidates):
            if consecutive:
                return candidates
            return [first, *free_ports(count - 1)] if count > 1 else [first]
    raise RuntimeError(f"no {count} free ports found")


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return port < 65536


def local_job(job: GRPOLoraJob) -> GRPOLoraJob:
    """The job with free ports on this machine: spec ports are cluster ports and may be taken here."""
    master, status, sync = free_ports(3)
    inference_base = free_ports(job.spec.inference.replicas, consecutive=True)[0]
    spec = job.spec.model_copy(
        update={
            "trainer": job.spec.trainer.model_copy(update={"master_port": master, "status_port": status}),
            "inference": job.spec.inference.model_copy(update={"port": inference_base}),
            "sync": job.spec.sync.model_copy(update={"port": sync}),
        }
    )
    return job.model_copy(update={"spec": spec})


def local_plan(job: GRPOLoraJob, run_dir: Path) -> JobPlan:
    return plan(
        local_job(job),
        LoopbackNetwork(),
        checkpoint_dir=str((run_dir / "checkpoints").resolve()),
        output_dir=str(run_dir.resolve()),
    )


def _worker_actor_class():
    import ray

    @ray.remote(max_restarts=0)
    class WorkerProcess:
        """Holds one worker process: the actor's resources (GPUs via CUDA_VISIBLE_DEVICES) are the worker's."""

        def __init__(self, env: dict[str, str], log_path: str, role: str, cpus: list[int] | None = None):
            if cpus:
                os.sched_setaffinity(0, cpus)  # the worker (and vLLM's engine processes) inherit it
            full_env = dict(os.environ) | env
            with open(log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "grpolora.cli", "worker", role],
                    env=full_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # one group: stopping it stops vLLM's engine processes too
                    preexec_fn=_die_with_parent,  # an actor killed by Ray (e.g. for memory) takes its worker along
                )

        def pgid(self) -> int:
            return self.proc.pid

        def poll(self) -> int | None:
            return self.proc.poll()

        def stop(self, grace: float) -> int | None:
            if self.proc.poll() is None:
                _signal_group(self.proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(grace)
            _signal_group(self.proc.pid, signal.SIGKILL)  # whatever of the group is left
            return self.proc.wait()

    return WorkerProcess


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _die_with_parent() -> None:
    """In the worker, before exec: Linux sends it SIGKILL when the actor process dies."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class LocalRun:
    def __init__(
        self,
        job: GRPOLoraJob,
        run_dir: Path,
        *,
        ray_address: str | None,
        show_progress: bool = True,
        cpus: dict[str, list[int]] | None = None,
        role_env: dict[str, dict[str, str]] | None = None,
    ):
        """`cpus` pins each role's workers to cores and `role_env` adds environment variables per role: on one CPU
        machine, that keeps trainer and inference off each other's cores, as separate node pools would."""
        self.job = job
        self.cpus = cpus or {}
        self.role_env = role_env or {}
        self.run_dir = run_dir
        self.ray_address = ray_address
        self.show_progress = show_progress
        self.plan = local_plan(job, run_dir)
        self.token = secrets.token_urlsafe(24)
        self.workers: list[Worker] = []
        self._actors: list = []
        self._started_ray = False

    def _threads_per_worker(self) -> int:
        workers = self.job.spec.trainer.replicas + self.job.spec.inference.replicas
        # Sequential GRPO alternates generation and training, so workers rarely compute at once: give each the
        # machine rather than a slice of it, unless the user said otherwise.
        return max(1, (os.cpu_count() or 1) if workers <= 4 else math.ceil((os.cpu_count() or 1) / 2))

    def start(self) -> None:
        import ray

        if self.ray_address:
            ray.init(address=self.ray_address, log_to_driver=False)
        else:
            workers = self.job.spec.trainer.replicas + self.job.spec.inference.replicas
            # Logical CPUs: one per worker process even on a smaller machine (they mostly take turns).
            ray.init(num_cpus=max(os.cpu_count() or 1, workers), include_dashboard=False, log_to_driver=False)
            self._started_ray = True
        actor_class = _worker_actor_class()
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        threads = str(self._threads_per_worker())
        for role in ("inference", "trainer"):
            role_plan = self.plan.role(role)
            for index in range(role_plan.replicas):
                worker = Worker(role, index, role_plan.placement.gpus, logs / f"{role}-{index}.log")
                env = self.plan.env_for(role, index, token=self.token) | self.role_env.get(role, {})
                # Workers run `python -m ...` from the user's directory: never let a folder there shadow a module
                # (the repository's own operator/ would shadow the stdlib's `operator`).
                env["PYTHONSAFEPATH"] = "1"
                if role == "trainer" and index > 0:
                    # Pods have an address each; here every trainer replica shares 127.0.0.1, so the /health
                    # endpoint of replicas > 0 (rank 0 alone serves /status) needs a port of its own.
                    env[contract.STATUS_PORT] = str(free_ports(1)[0])
                env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", threads))
                actor = actor_class.options(
                    name=f"{self.job.name}-{role}-{index}-{os.getpid()}",
                    num_cpus=1,
                    num_gpus=worker.gpus,
                ).remote(env, str(worker.log), role, self.cpus.get(role))
                self.workers.append(worker)
                self._actors.append(actor)
        # Worker process groups on this machine: stop() kills what is left of them even if an actor is gone.
        self._groups = ray.get([a.pgid.remote() for a in self._actors]) if self._started_ray else []

    def wait(self) -> TrainerStatus | None:
        """Until trainer rank 0 exits: progress from its /status; a failed worker stops the run (RunFailed)."""
        import ray

        status_url = f"http://127.0.0.1:{self.plan.job.spec.trainer.status_port}/status"
        progress = _Progress(self.job.spec.grpo.steps, enabled=self.show_progress)
        last: TrainerStatus | None = None
        client = httpx.Client(timeout=2.0)
        try:
            while True:
                codes = ray.get([a.poll.remote() for a in self._actors])
                for worker, code in zip(self.workers, codes, strict=True):
                    if code is None:
                        continue
                    if worker.role == "trainer" and worker.index == 0 and code == 0:
                        progress.close(last)
                        return last
                    raise RunFailed(
                        f"{worker.role} {worker.index} exited with code {code}; end of {worker.log}:\n"
                        + _tail(worker.log)
                    )
                try:
                    last = TrainerStatus.model_validate(client.get(status_url).json())
                    progress.update(last)
                except (httpx.HTTPError, ValueError):
                    pass  # the trainer is still starting
                time.sleep(POLL_SECONDS)
        finally:
            client.close()
            progress.close(None)

    def stop(self) -> None:
        import ray

        if self._actors:
            for actor in self._actors:
                with contextlib.suppress(Exception):  # an actor already dead (e.g. killed for memory)
                    ray.get(actor.stop.remote(STOP_GRACE_SECONDS))
                ray.kill(actor)
            self._actors = []
        for group in getattr(self, "_groups", []):
            _signal_group(group, signal.SIGKILL)
        self._groups = []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


class _Progress:
    """A progress bar on a terminal; one line per step otherwise (CI logs, files)."""

    def __init__(self, total: int, *, enabled: bool):
        self._bar = None
        self._enabled = enabled
        self._last_line: tuple | None = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="GRPO", unit="step", dynamic_ncols=True)

    def update(self, status: TrainerStatus) -> None:
        if self._bar is None:
            if self._enabled and (status.phase, status.step) != self._last_line:
                self._last_line = (status.phase, status.step)
                reward = "" if status.reward_mean is None else f" reward {status.reward_mean:.3f}"
                kl = "" if status.kl is None else f" kl {status.kl:.4f}"
                sync = "" if status.last_sync_seconds is None else f" sync {status.last_sync_seconds * 1000:.0f} ms"
                print(f"[{status.phase}] step {status.step}/{status.total_steps}{reward}{kl}{sync}", file=sys.stderr)
            return
        self._bar.n = status.step
        postfix = {"phase": status.phase}
        if status.reward_mean is not None:
            postfix |= {"reward": f"{status.reward_mean:.3f}", "kl": f"{status.kl or 0:.4f}"}
        if status.last_sync_seconds is not None:
            postfix |= {"sync": f"{status.last_sync_seconds * 1000:.0f}ms", "round": status.sync_round}
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.refresh()

    def close(self, status: TrainerStatus | None) -> None:
        if self._bar is not None:
            if status is not None:
                self.update(status)
            self._bar.close()
            self._bar = None


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(records: Sequence[dict], out: Path) -> None:
    """reward, KL and sync time per step, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    figure, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    series = (
        ("reward (mean ± std)", [r["reward_mean"] for r in records], [r["reward_std"] for r in records]),
        ("KL to reference (k3)", [r["kl"] for r in records], None),
        ("adapter sync (ms)", [r["seconds"]["sync"] * 1000 for r in records], None),
    )
    evaluated = [(r["step"], r["eval_reward"]) for r in records if "eval_reward" in r]
    if evaluated:
        axes[0].plot(*zip(*evaluated, strict=True), marker="s", color="tab:green", label="eval reward (held out)")
        axes[0].legend(loc="best")
    for axis, (label, values, spread) in zip(axes, series, strict=True):
        axis.plot(steps, values, marker="o", markersize=3)
        if spread is not None:
            low = [v - s for v, s in zip(values, spread, strict=True)]
            high = [v + s for v, s in zip(values, spread, strict=True)]
            axis.fill_between(steps, low, high, alpha=0.2)
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    figure.suptitle("grpo-lora run")
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)


def summarize(records: Sequence[dict], window: int = 5) -> str:
    if not records:
        return "no steps recorded"
    first = [r["reward_mean"] for r in records[:window]]
    last = [r["reward_mean"] for r in records[-window:]]
    mismatch = max(r["mismatch"] for r in records)
    return (
        f"mean reward, first {len(first)} steps: {sum(first) / len(first):.3f}; "
        f"last {len(last)} steps: {sum(last) / len(last):.3f}\n"
        f"sync rounds: {records[-1]['sync_round']}, median sync "
        f"{sorted(r['seconds']['sync'] for r in records)[len(records) // 2] * 1000:.0f} ms, "
        f"largest trainer-vs-vLLM mismatch {mismatch:.2e}"
    )


def run(job_file: str, *, run_dir: str | None = None, ray_address: str | None = None) -> int:
    """The `grpolora run` command. Returns the exit status."""
    try:
        jobs = load_jobs(job_file)
    except InvalidJob as exc:
        print(exc, file=sys.stderr)
        return 1
    if len(jobs) != 1:
        print(f"{job_file}: holds {len(jobs)} jobs; `grpolora run` runs one", file=sys.stderr)
        return 1
    job = jobs[0]
    for warning in job_warnings(job):
        if warning.path not in ("spec.checkpoint.pvc", "spec.output"):  # cluster concerns
            print(f"{job_file}: warning: {warning}", file=sys.stderr)
    from grpolora.workers.tasks import TaskError, load_task

    try:
        load_task(job.spec.task)  # a bad dataset or reward plugin fails here, before any actor starts
    except TaskError as exc:
        print(f"{job_file}: {exc}", file=sys.stderr)
        return 1
    folder = Path(run_dir or Path("runs") / job.name)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "checkpoints").exists():
        (folder / "metrics.jsonl").unlink(missing_ok=True)  # a fresh run; with checkpoints the run resumes
    local = LocalRun(job, folder, ray_address=ray_address or os.environ.get("RAY_ADDRESS"))
    print(
        f"grpolora run: {job.name}: {job.spec.trainer.replicas} trainer + {job.spec.inference.replicas} inference "
        f"replica(s), {job.spec.grpo.steps} steps; logs in {folder / 'logs'}",
        file=sys.stderr,
    )
    try:
        local.start()
        local.wait()
    except KeyboardInterrupt:
        print("\ngrpolora run: interrupted; stopping every worker", file=sys.stderr)
        local.stop()
        return 130
    except RunFailed as exc:
        print(f"grpolora run: {exc}", file=sys.stderr)
        local.stop()
        return 1
    local.stop()
    final = folder / "status.json"
    if final.exists():
        status = TrainerStatus.model_validate_json(final.read_text())
        print(f"trainer: {status.phase} after {status.step}/{status.total_steps} steps, sync round {status.sync_round}")
    records = read_metrics(folder)
    if records:
        plot(records, folder / "plot.png")
    print(summarize(records))
    print(
        f"run folder: {folder}: metrics.jsonl, status.json, final-adapter/, samples.jsonl, tensorboard/, "
        "checkpoints/, plot.png, logs/"
    )
    return 0
