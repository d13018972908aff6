"""`grpolora run job.yaml`: the same job on one machine, on Ray; `grpolora run pool.yaml job-a.yaml job-b.yaml`:
one RolloutPool's servers and several jobs' trainers on one Ray cluster.

Each trainer replica and each inference replica is a Ray actor with its own resources (on a GPU machine, its
own GPUs: trainer and inference never share one). An actor runs the very worker entry point a pod runs,
`grpolora worker <role>`, with the env contract that plan() (and plan_pool() for a pool's servers) gives the
operator, built for the loopback network. The driver watches each job's trainer rank 0 /status (as the operator
does), draws a progress bar per job, and at the end writes each job's run folder: metrics.jsonl, the final adapter,
checkpoints, worker logs and plot.png. A job with spec.environment.server gets that server's processes too
(environment_servers.py: its command on free ports, ready before the trainer starts, started again when one exits,
stopped with the job), and its trainer their URLs.

On a pool the launcher plays the operator's part: every job must fit the pool before anything starts; up to the
pool's maxJobs are attached at once (their entries in the attachment list the servers read, written before the
job's trainer starts), the others wait in line and attach as jobs finish; a finished or failed job is detached.

Faults, as a cluster would take them: a lost inference replica, or one that fails its liveness probe (a hung
engine: workers/launcher/liveness.py plays the kubelet's probe), is started again (up to
INFERENCE_RESTARTS_PER_REPLICA times) while the trainers carry on with the others and re-add the replacement once
it serves their current adapter; a trainer failure ends its job (run it again to resume from the checkpoint), and
the other jobs of a pool carry on. Every way a job ends leaves its status.json saying how, and Ctrl-C stops the
trainers first, then every replica at once.

This file is the supervision (Ray actors, restarts, a pool's admission, stopping); the files given are read in
run_files.py, the progress lines drawn in progress.py, and a run's results read back and plotted in results.py.
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
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from grpolora.api import contract
from grpolora.api.load import InvalidJob, job_warnings
from grpolora.api.plan import JobPlan, LoopbackNetwork, PoolPlan, Role, plan, plan_pool
from grpolora.api.pool import (
    Attachment,
    Attachments,
    Candidate,
    admit,
    attachment,
    job_key,
    replicas_file,
    write_attachments,
)
from grpolora.api.spec import GRPOLoraJob, RolloutPool
from grpolora.api.status import TrainerStatus
from grpolora.workers.launcher.environment_servers import EnvironmentServerFailed, EnvironmentServers, unset_here
from grpolora.workers.launcher.liveness import LIVENESS_FAILURES, Liveness, health_url
from grpolora.workers.launcher.progress import Progress
from grpolora.workers.launcher.results import plot, read_metrics, summarize
from grpolora.workers.launcher.run_files import read_run_files, run_problems
from grpolora.workers.lifetime import die_with_parent, signal_group
from grpolora.workers.tracking import SAMPLES_FILE

POLL_SECONDS = 1.0
TRAINER_STOP_SECONDS = 10.0  # the trainer records its status and exits at once on SIGTERM
# uvicorn's grace for requests in flight (3 s), then the engine's own shutdown, which waits for its workers (~4 s
# on a CPU): cut it short, since whatever is left is killed and its adapter folder removed anyway.
INFERENCE_STOP_SECONDS = 5.0
INFERENCE_RESTARTS_PER_REPLICA = 3
"""Times `grpolora run` starts a lost inference replica again before the run fails."""
STATUS_LOG_LINES = 10  # of a failed worker's log, kept in status.json's message
POOL_JOBS_FILE = "pool-jobs.json"
"""The pool's attachment list in the run folder (what the RolloutPool's Secret holds in a cluster)."""


class RunFailed(RuntimeError):
    """A worker failed; the message names it and carries the end of its log."""

    def __init__(self, worker: Worker, message: str):
        super().__init__(message)
        self.worker = worker


@dataclass(frozen=True)
class Worker:
    role: Role
    index: int
    gpus: int
    log: Path
    job: str = ""
    """The job whose worker this is; for a RolloutPool's servers, the pool's workload (`<pool>-pool`)."""


@dataclass
class _Live:
    """A worker started by this run: its Ray actor, and the env a restart starts it with again."""

    worker: Worker
    env: dict[str, str]
    actor: Any
    group: int | None = None  # its process group on this machine (None: the Ray cluster is not ours)
    liveness: Liveness | None = None  # an inference server's liveness probe, made at its first check


_handed_out: set[int] = set()
"""Ports free_ports gave in this process: a run picks them all before anything binds one (its plan's, then its
environment servers'), and the kernel's bind to port 0 may give a port again while nothing has bound it."""


def free_ports(count: int, *, consecutive: bool = False) -> list[int]:
    """Ports nobody listens on now and not handed out before in this process (the run binds them moments later)."""
    found: list[int] = []
    for _ in range(100 * count):  # tries
        if len(found) == count:
            break
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        candidates = list(range(first, first + count)) if consecutive else [first]
        if all(p not in _handed_out and _is_free(p) for p in candidates):
            _handed_out.update(candidates)
            found += candidates
    if len(found) < count:
        raise RuntimeError(f"no {count} free ports found")
    return found


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return port < 65536


def local_job(job: GRPOLoraJob) -> GRPOLoraJob:
    """The job with free ports on this machine: spec ports are cluster ports and may be taken here. A job on a pool
    has no servers of its own (it must leave inference's fields unset), so only its trainer's ports change."""
    master, status, sync = free_ports(3)
    update: dict[str, Any] = {
        "trainer": job.spec.trainer.model_copy(update={"master_port": master, "status_port": status}),
        "sync": job.spec.sync.model_copy(update={"port": sync}),
    }
    if job.spec.inference.pool_ref is None:
        inference_base = free_ports(job.spec.inference.replicas, consecutive=True)[0]
        update["inference"] = job.spec.inference.model_copy(update={"port": inference_base})
    return job.model_copy(update={"spec": job.spec.model_copy(update=update)})


def local_pool(pool: RolloutPool) -> RolloutPool:
    """The pool with free ports on this machine: replica i listens on port + i (LoopbackNetwork)."""
    base = free_ports(pool.spec.replicas, consecutive=True)[0]
    return pool.model_copy(update={"spec": pool.spec.model_copy(update={"port": base})})


def local_plan(job: GRPOLoraJob, run_dir: Path, pool: RolloutPool | None = None) -> JobPlan:
    return plan(
        local_job(job),
        LoopbackNetwork(),
        pool=pool,
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
                    start_new_session=True,  # one group: whatever is left of it is killed at the end
                    preexec_fn=die_with_parent,  # an actor killed by Ray (e.g. for memory) takes its worker along
                )

        def pgid(self) -> int:
            return self.proc.pid

        def poll(self) -> int | None:
            return self.proc.poll()

        def stop(self, grace: float, whole_group: bool) -> int | None:
            """SIGTERM, `grace` seconds, then SIGKILL to what is left of the group. An inference server is signalled
            alone: it stops its own engine (signalled too, the engine would die at once and leave the server waiting
            for requests that can never finish)."""
            if self.proc.poll() is None:
                if whole_group:
                    signal_group(self.proc.pid, signal.SIGTERM)
                else:
                    with contextlib.suppress(ProcessLookupError):
                        self.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(grace)
            signal_group(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()

    return WorkerProcess


JobState = Literal["waiting", "running", "succeeded", "failed"]


class JobRun:
    """One job of a run: its run folder, its token, its plan (made when it starts, so that its ports are picked
    then), its progress and how it ended."""

    def __init__(self, job: GRPOLoraJob, run_dir: Path, *, label: str = "", position: int = 0):
        self.job = job
        self.run_dir = run_dir
        self.label = label  # prefixes its progress lines when a run has several jobs
        self.position = position
        self.token = secrets.token_urlsafe(24)
        self.uid = str(uuid.uuid4())
        self.plan: JobPlan | None = None
        self.state: JobState = "waiting"
        self.last_status: TrainerStatus | None = None
        self.started_at = time.time()
        self.progress: Progress | None = None
        self.environment: EnvironmentServers | None = None  # spec.environment.server's processes, once started

    @property
    def name(self) -> str:
        return self.job.name

    @property
    def done(self) -> bool:
        return self.state in ("succeeded", "failed")

    def start(self, job_plan: JobPlan, *, show_progress: bool) -> None:
        self.plan, self.state, self.started_at = job_plan, "running", time.time()
        self.progress = Progress(
            self.job.spec.grpo.steps,
            enabled=show_progress,
            samples=self.run_dir / SAMPLES_FILE,
            label=self.label,
            position=self.position,
        )

    def poll(self, client: httpx.Client, restarts: int) -> None:
        """Progress from trainer rank 0's /status (nothing while it is still starting)."""
        assert self.plan is not None and self.progress is not None
        try:
            response = client.get(f"http://127.0.0.1:{self.plan.job.spec.trainer.status_port}/status")
            self.last_status = TrainerStatus.model_validate(response.json())
        except (httpx.HTTPError, ValueError):
            return
        self.progress.update(self.last_status, restarts)

    def note(self, message: str) -> None:
        if self.progress is not None:
            self.progress.note(message)
        else:
            print(message, file=sys.stderr)

    def close_progress(self) -> None:
        if self.progress is not None:
            self.progress.close(self.last_status)
            self.progress = None

    def record(self, *, restarts: int = 0, failed: str | None = None, own_reason: str = "keep") -> TrainerStatus | None:
        """Complete status.json, whatever way the job ended, with the number of inference restarts.

        `failed` says how the job failed (None: it did not). The trainer's own record, if it wrote one during this
        run, stays the base; when it already says Failed (its exception, or where SIGTERM stopped it), `own_reason`
        decides: `keep` its message, `prefix` it with the first clause of `failed` (which worker, which exit
        code), or `replace` it with `failed` (the cause lies elsewhere, e.g. a replica out of restarts)."""
        path = self.run_dir / "status.json"
        own = None
        if path.exists() and path.stat().st_mtime >= self.started_at:
            with contextlib.suppress(ValueError):
                own = TrainerStatus.model_validate_json(path.read_text())
        status = own or self.last_status
        if failed is not None:
            message = failed
            if own is not None and own.phase == "Failed" and own.message and own_reason != "replace":
                message = own.message if own_reason == "keep" else f"{failed.split(';')[0]}: {own.message}"
            base = status or TrainerStatus(phase="Starting", total_steps=self.job.spec.grpo.steps)
            status = base.model_copy(update={"phase": "Failed", "message": message})
        if status is None:
            return None
        status = status.model_copy(update={"inference_restarts": restarts})
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(status.to_wire(), indent=2))
        self.last_status = status
        return status


class LocalRun:
    """One run on one Ray cluster: the inference servers (a job's own, or a RolloutPool's) and the trainers of
    `jobs`. Without a pool it runs exactly one job, in `run_dir`; with one, each job runs in `run_dir/<job name>/`
    and the pool's servers log to `run_dir/logs/`."""

    def __init__(
        self,
        jobs: Sequence[GRPOLoraJob],
        run_dir: Path,
        *,
        pool: RolloutPool | None = None,
        ray_address: str | None,
        show_progress: bool = True,
        cpus: dict[str, list[int]] | None = None,
        role_env: dict[str, dict[str, str]] | None = None,
    ):
        """`cpus` pins each role's workers to cores and `role_env` adds environment variables per role: on one CPU
        machine, that keeps trainer and inference off each other's cores, as separate node pools would."""
        if pool is None and len(jobs) != 1:
            raise ValueError(f"a run without a RolloutPool runs one job, not {len(jobs)}")
        self.cpus = cpus or {}
        self.role_env = role_env or {}
        self.run_dir = run_dir
        self.ray_address = ray_address
        self.show_progress = show_progress
        self.pool = local_pool(pool) if pool is not None else None
        self.pool_plan: PoolPlan | None = plan_pool(self.pool, LoopbackNetwork()) if self.pool else None
        self.jobs = [
            JobRun(job, run_dir / job.name, label=job.name, position=i) if pool else JobRun(job, run_dir)
            for i, job in enumerate(jobs)
        ]
        self._live: list[_Live] = []
        self._started_ray = False
        self._waiting_noted: dict[str, int] = {}  # job -> its place in line when last shown
        self._attachments: list[Attachment] = []  # the attachment list as last written (the running jobs)
        self.restarts: dict[int, int] = {}  # inference replica index -> times restarted

    @property
    def inference_restarts(self) -> int:
        return sum(self.restarts.values())

    @property
    def jobs_file(self) -> Path:
        return self.run_dir / POOL_JOBS_FILE

    @property
    def max_attached(self) -> int:
        """Jobs whose trainers run at once."""
        return min(self.pool.spec.max_jobs, len(self.jobs)) if self.pool else 1

    def _server_replicas(self) -> int:
        return self.pool.spec.replicas if self.pool else self.jobs[0].job.spec.inference.replicas

    def _workers_at_once(self) -> int:
        """Worker processes running at once: the servers and the trainer replicas of the jobs attached together."""
        return self._server_replicas() + sum(j.job.spec.trainer.replicas for j in self.jobs[: self.max_attached])

    def _threads_per_worker(self, role: Role) -> int:
        cores = os.cpu_count() or 1
        workers = self._workers_at_once()
        # Sequential GRPO alternates generation and training, so one job's workers rarely compute at once: give each
        # the machine rather than a slice of it, unless the user said otherwise. Several jobs on a pool do overlap
        # (one trains while the servers generate for another): their trainers share the cores between them.
        threads = cores if workers <= 4 else math.ceil(cores / 2)
        return max(1, threads // self.max_attached if role == "trainer" else threads)

    def start(self) -> None:
        self._init_ray()
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        if self.pool_plan is None:
            (job,) = self.jobs
            job.start(local_plan(job.job, job.run_dir), show_progress=self.show_progress)
            assert job.plan is not None
            self._launch_environment(job)  # its servers start while the inference replicas load
            servers, owner = job.plan.role("inference"), job.name
            envs = [job.plan.env_for("inference", i, token=job.token) for i in range(servers.replicas)]
        else:
            # The first jobs' entries are in the attachment list before any server reads it, and the pool's
            # replicas beside it (the servers pass them on to the trainers; a run does not scale: generation 1).
            for job in self.jobs[: self.max_attached]:
                self._plan_on_pool(job)
            self._write_attachments()
            write_attachments(replicas_file(self.jobs_file), self.pool_plan.replicas(generation=1))
            servers, owner = self.pool_plan.inference, self.pool_plan.inference.workload_name
            jobs_file = str(self.jobs_file.resolve())
            envs = [self.pool_plan.env_for(i, jobs_file=jobs_file) for i in range(servers.replicas)]
        threads = str(self._threads_per_worker("inference"))
        for index in range(servers.replicas):
            worker = Worker("inference", index, servers.placement.gpus, logs / f"inference-{index}.log", owner)
            self._launch(worker, self._worker_env(worker, envs[index], threads))
        for job in self.jobs:
            if job.state == "running":
                self._start_trainers(job)

    def _init_ray(self) -> None:
        import ray

        if self.ray_address:
            ray.init(address=self.ray_address, log_to_driver=False)
        else:
            # Logical CPUs: one per worker process even on a smaller machine (they mostly take turns).
            cpus = max(os.cpu_count() or 1, self._workers_at_once())
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
            self._started_ray = True

    def _plan_on_pool(self, job: JobRun) -> None:
        assert self.pool is not None
        job.start(local_plan(job.job, job.run_dir, self.pool), show_progress=self.show_progress)

    def _write_attachments(self) -> None:
        """The attachment list of the jobs running now."""
        assert self.pool is not None
        entries = [
            attachment(self.pool.namespace, j.name, j.uid, j.token, j.plan.spec)
            for j in self.jobs
            if j.state == "running" and j.plan is not None
        ]
        write_attachments(self.jobs_file, Attachments(pool=self.pool.name, jobs=entries))
        self._attachments = entries

    def _worker_env(self, worker: Worker, env: dict[str, str], threads: str) -> dict[str, str]:
        env = env | self.role_env.get(worker.role, {})
        # Workers run `python -m ...` from the user's directory: never let a folder there shadow a module (the
        # repository's own operator/ would shadow the stdlib's `operator`).
        env["PYTHONSAFEPATH"] = "1"
        env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", threads))
        return env

    def _launch_environment(self, job: JobRun) -> None:
        """Start the job's spec.environment.server processes (without waiting for them), once."""
        spec = job.job.spec.environment
        if spec is None or spec.server is None or job.environment is not None:
            return
        unset = unset_here(spec)
        if unset:
            job.note(f"grpolora run: warning: spec.environment.server.env: {', '.join(unset)} come from the "
                     "cluster (valueFrom), which is not here; the servers see them if you export them")  # fmt: skip
        ports = free_ports(spec.server.replicas)
        job.environment = EnvironmentServers(spec, job.run_dir / "logs", job.token, ports=ports)
        job.environment.launch()

    def _environment_env(self, job: JobRun) -> dict[str, str]:
        """What the job's trainer is told of its environment server, once every process of it is ready: its URLs
        (docs/contract.md; the trainer derives the servers' token from the job's, which it has already).
        EnvironmentServerFailed when one exits or is never ready."""
        self._launch_environment(job)
        if job.environment is None:
            return {}
        job.environment.wait_ready()
        return {contract.ENVIRONMENT_URL: ",".join(job.environment.urls)}

    def _start_trainers(self, job: JobRun) -> None:
        assert job.plan is not None
        try:
            environment = self._environment_env(job)
        except EnvironmentServerFailed as err:  # the job's: it fails (its servers stopped), a pool's others go on
            self._end(job, str(err))
            return
        trainers = job.plan.role("trainer")
        logs = job.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        threads = str(self._threads_per_worker("trainer"))
        for index in range(trainers.replicas):
            worker = Worker("trainer", index, trainers.placement.gpus, logs / f"trainer-{index}.log", job.name)
            env = job.plan.env_for("trainer", index, token=job.token) | environment
            # Fencing (contract.TRAINER_INCARNATION): a later `grpolora run` of a job is a later trainer.
            env[contract.TRAINER_INCARNATION] = str(time.time_ns() // 1_000_000)
            if index > 0:
                # Pods have an address each; here every trainer replica shares 127.0.0.1, so the /health
                # endpoint of replicas > 0 (rank 0 alone serves /status) needs a port of its own.
                env[contract.STATUS_PORT] = str(free_ports(1)[0])
            self._launch(worker, self._worker_env(worker, env, threads))

    def _launch(self, worker: Worker, env: dict[str, str]) -> _Live:
        import ray

        actor = (
            _worker_actor_class()
            .options(
                # A replacement's name differs from the killed actor's, which Ray may still be tearing down.
                name=f"{worker.job}-{worker.role}-{worker.index}-{os.getpid()}-{self.restarts.get(worker.index, 0)}",
                num_cpus=1,
                num_gpus=worker.gpus,
            )
            .remote(env, str(worker.log), worker.role, self.cpus.get(worker.role))
        )
        live = _Live(worker, env, actor)
        # Worker process groups on this machine: stop() kills what is left of them even if an actor is gone.
        if self._started_ray:
            live.group = ray.get(actor.pgid.remote())
        self._live.append(live)
        return live

    def _restart(self, live: _Live, why: str) -> None:
        """Start a lost inference replica again, with the same env (name, port, rank): as a StatefulSet brings back
        its pod. The trainers re-add it to their sync groups once it serves their current adapter."""
        import ray

        worker = live.worker
        with contextlib.suppress(Exception):
            ray.get(live.actor.stop.remote(0.0, True))  # whatever of its group is left
        ray.kill(live.actor)
        self._live.remove(live)
        self.restarts[worker.index] = self.restarts.get(worker.index, 0) + 1
        with worker.log.open("a") as log:
            log.write(f"\n--- grpolora run: {why}; restart {self.restarts[worker.index]} ---\n")
        self._launch(worker, live.env)

    def _exit_codes(self) -> list[int | str | None]:
        """Exit code of each live worker (in the order of self._live); None while it runs."""
        import ray

        codes: list[int | str | None] = []
        for live in self._live:
            try:
                codes.append(ray.get(live.actor.poll.remote()))
            except ray.exceptions.RayActorError:
                codes.append("lost (its Ray actor died)")
        return codes

    def _job(self, name: str) -> JobRun:
        return next(j for j in self.jobs if j.name == name)

    def wait(self) -> None:
        """Until every job has ended: progress from each trainer rank 0's /status; a lost inference replica is
        restarted within its budget unless it exited with a spec error (else RunFailed: the whole run stops); a
        failed trainer ends its job; on a pool, waiting jobs attach as slots free."""
        client = httpx.Client(timeout=2.0)
        probes = ThreadPoolExecutor(thread_name_prefix="liveness")  # a probe waits up to LIVENESS_TIMEOUT_SECONDS
        try:
            self._admit()
            while not all(job.done for job in self.jobs):
                for live, code in zip(list(self._live), self._exit_codes(), strict=True):
                    if code is not None:
                        self._exited(live, code)
                for live, fault in self._unresponsive(probes):
                    failure = f"inference {live.worker.index} failed {LIVENESS_FAILURES} liveness probes in a row"
                    self._replace(live, f"{failure} ({fault})", "killed: it failed its liveness probe")
                self._admit()
                for job in self.jobs:
                    if job.state == "running":
                        self._revive_environment(job)
                    if job.state == "running":
                        job.poll(client, self.inference_restarts)
                if not all(job.done for job in self.jobs):
                    time.sleep(POLL_SECONDS)
        finally:
            client.close()
            probes.shutdown(wait=False, cancel_futures=True)
            for job in self.jobs:
                job.close_progress()

    def _revive_environment(self, job: JobRun) -> None:
        """A server of the job's environment that exited is started again (as its pod would be), within its budget;
        past it, the job fails."""
        if job.environment is None:
            return
        try:
            for line in job.environment.revive():
                job.note(f"grpolora run: {job.label + ': ' if job.label else ''}{line}")
        except EnvironmentServerFailed as err:
            self._end(job, str(err))

    def _unresponsive(self, probes: ThreadPoolExecutor) -> list[tuple[_Live, str]]:
        """The inference servers whose liveness probe failed LIVENESS_FAILURES times in a row, with the last fault
        (probes run on `probes`, one at a time per server; this returns at once)."""
        found = []
        for live in self._live:
            if live.worker.role != "inference":
                continue
            if live.liveness is None:
                live.liveness = Liveness(health_url(live.env))
            fault = live.liveness.check(probes)
            if fault is not None:
                found.append((live, fault))
        return found

    def _exited(self, live: _Live, code: int | str) -> None:
        worker = live.worker
        if worker.role == "trainer":
            job = self._job(worker.job)
            if job.state != "running":
                return  # a rank of a job already ended
            if code == 0:
                if worker.index == 0:
                    self._end(job, None)
                return  # a follower rank done with the final collective; rank 0 is still writing
            self._end(job, f"trainer {worker.index} exited with code {code}; end of {worker.log}:\n{_tail(worker.log)}")
            return
        failure = f"inference {worker.index} exited with code {code}"
        if code == contract.EXIT_INVALID_SPEC:  # a missing model or a refused token: every restart would meet it
            tail = _tail(worker.log)
            said = [line[line.index("spec.") :] for line in tail.splitlines() if ": spec." in line]
            failure += f": a spec error, not restarted{': ' + said[-1] if said else ''}; end of {worker.log}:\n{tail}"
            raise RunFailed(worker, failure)
        self._replace(live, failure, f"exited with code {code}")

    def _replace(self, live: _Live, failure: str, why: str) -> None:
        """Start an inference server again (its process group killed first), within its budget of restarts; else
        the run fails (RunFailed)."""
        worker = live.worker
        used = self.restarts.get(worker.index, 0)
        if used < INFERENCE_RESTARTS_PER_REPLICA:
            self._note(
                f"grpolora run: {failure}; starting it again (restart {used + 1} of {INFERENCE_RESTARTS_PER_REPLICA}); "
                f"the trainer carries on with the other replicas; log: {worker.log}"
            )
            self._restart(live, why)
            return
        failure += f" after {INFERENCE_RESTARTS_PER_REPLICA} restarts"
        raise RunFailed(worker, f"{failure}; end of {worker.log}:\n{_tail(worker.log)}")

    def _note(self, message: str) -> None:
        """A line about the whole run, above the progress bars."""
        running = [j for j in self.jobs if j.progress is not None]
        if running:
            running[0].note(message)
        else:
            print(message, file=sys.stderr)

    def _end(self, job: JobRun, failure: str | None) -> None:
        """A job's trainer is done (failure None) or failed: stop what is left of its ranks, detach it from the
        pool (its adapters are unloaded from every replica), complete its status.json."""
        if failure is not None:
            job.note(f"grpolora run: {job.label + ': ' if job.label else ''}{failure}")
        self._stop_workers(
            [live for live in self._live if live.worker.job == job.name and live.worker.role == "trainer"]
        )
        if job.environment is not None:
            job.environment.stop()
        job.state = "failed" if failure is not None else "succeeded"
        if self.pool is not None:
            self._write_attachments()
        if failure is None:
            job.close_progress()
            status = job.record(restarts=self.inference_restarts)
            if status is not None and status.phase != "Succeeded":
                job.state = "failed"
        else:
            job.close_progress()
            brief = "\n".join(failure.splitlines()[: STATUS_LOG_LINES + 1])
            job.record(restarts=self.inference_restarts, failed=brief, own_reason="prefix")
        records = read_metrics(job.run_dir)
        if records:
            plot(records, job.run_dir / "plot.png")

    def _admit(self) -> None:
        """On a pool: attach waiting jobs by the operator's rule (grpolora.api.pool.admit; here the order of the
        command line is the order of creation), and say where the others wait."""
        if self.pool is None:
            return
        keys = {job_key(self.pool.namespace, j.name): j for j in self.jobs}
        candidates = [
            Candidate(key=key, uid=j.uid, created=f"{j.position:06d}", active=not j.done, fits=True)
            for key, j in keys.items()
        ]
        admission = admit(self.pool.spec.max_jobs, candidates, self._attachments)
        attached = len(self._attachments)
        for job in (keys[key] for key in admission.attached if keys[key].state == "waiting"):
            self._plan_on_pool(job)
            self._write_attachments()  # before its trainer starts: the servers must know its token first
            attached += 1
            job.note(
                f"grpolora run: {job.name}: attached to RolloutPool {self.pool.name} ({attached} of "
                f"{self.pool.spec.max_jobs} jobs); starting its trainer"
            )
            self._start_trainers(job)
        for place, job in enumerate((keys[key] for key in admission.waiting), start=1):
            if self._waiting_noted.get(job.name) != place:
                self._waiting_noted[job.name] = place
                self._note(
                    f"grpolora run: {job.name}: waiting for a slot of RolloutPool {self.pool.name} ({attached} of "
                    f"{self.pool.spec.max_jobs} jobs attached); place {place} in line"
                )

    def _stop_workers(self, lives: Sequence[_Live]) -> None:
        """Stop these workers, all at once; trainers as a whole group, servers alone first (see WorkerProcess)."""
        import ray

        pending = [
            live.actor.stop.remote(
                TRAINER_STOP_SECONDS if live.worker.role == "trainer" else INFERENCE_STOP_SECONDS,
                live.worker.role == "trainer",
            )
            for live in lives
        ]
        for ref in pending:
            with contextlib.suppress(Exception):  # an actor already dead (e.g. killed for memory)
                ray.get(ref)
        for live in lives:
            ray.kill(live.actor)
            if live.group is not None:
                signal_group(live.group, signal.SIGKILL)
            self._live.remove(live)

    def stop(self) -> None:
        """Every trainer first (each records where it stopped), then what the trainers used: their environment
        servers, then every inference replica at once."""
        import ray

        self._stop_workers([live for live in self._live if live.worker.role == "trainer"])
        for job in self.jobs:
            if job.environment is not None:
                job.environment.stop()
        self._stop_workers([live for live in self._live if live.worker.role == "inference"])
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def record_unfinished(self, failed: str, *, own_reason: str) -> None:
        """Every job still running when the run stopped: Failed, saying why (`own_reason` as in JobRun.record)."""
        for job in self.jobs:
            if job.state == "running":
                job.state = "failed"
                job.record(restarts=self.inference_restarts, failed=failed, own_reason=own_reason)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop_ignoring_interrupts(local: LocalRun) -> None:
    """A second Ctrl-C while stopping would leave workers behind: stopping takes a few seconds at most."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        local.stop()
    finally:
        signal.signal(signal.SIGINT, previous)


def run(files: str | Sequence[str], *, run_dir: str | None = None, ray_address: str | None = None) -> int:
    """The `grpolora run` command: one job, or a RolloutPool and its jobs. Returns the exit status: 0 when every job
    succeeded."""
    paths = [files] if isinstance(files, str) else list(files)
    try:
        given = read_run_files(paths)
    except InvalidJob as exc:
        print(exc, file=sys.stderr)
        return 1
    problems = run_problems(given)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    for path, job in given.jobs:
        for warning in job_warnings(job):
            if warning.path not in ("spec.checkpoint.pvc", "spec.output"):  # cluster concerns
                print(f"{path}: warning: {warning}", file=sys.stderr)
    from grpolora.workers.tasks import TaskError, load_task

    for path, job in given.jobs:
        try:
            load_task(job.spec.task)  # a bad dataset or reward plugin fails here, before any actor starts
        except TaskError as exc:
            print(f"{path}: {exc}", file=sys.stderr)
            return 1
    jobs = [job for _, job in given.jobs]
    pool = given.pools[0][1] if given.pools else None
    folder = Path(run_dir or Path("runs") / (pool.name if pool else jobs[0].name))
    local = LocalRun(jobs, folder, pool=pool, ray_address=ray_address or os.environ.get("RAY_ADDRESS"))
    for job in local.jobs:
        job.run_dir.mkdir(parents=True, exist_ok=True)
        if not (job.run_dir / "checkpoints").exists():
            (job.run_dir / "metrics.jsonl").unlink(missing_ok=True)  # a fresh run; with checkpoints the job resumes
    if pool is None:
        (job,) = jobs
        server = job.spec.environment_server
        servers = f" + {server.replicas} environment server(s)" if server else ""
        print(
            f"grpolora run: {job.name}: {job.spec.trainer.replicas} trainer + {job.spec.inference.replicas} "
            f"inference replica(s){servers}, {job.spec.grpo.steps} steps; logs in {folder / 'logs'}",
            file=sys.stderr,
        )
    else:
        print(
            f"grpolora run: RolloutPool {pool.name}: {pool.spec.replicas} inference replica(s) serving up to "
            f"{pool.spec.max_jobs} jobs at once; jobs "
            + ", ".join(f"{j.name} ({j.spec.grpo.steps} steps)" for j in jobs)
            + f"; each job's folder is {folder}/<job name>/, the pool's logs are in {folder / 'logs'}",
            file=sys.stderr,
        )
    try:
        local.start()
        local.wait()
    except KeyboardInterrupt:
        print("\ngrpolora run: interrupted; stopping the trainers, then every inference replica", file=sys.stderr)
        _stop_ignoring_interrupts(local)
        for job in local.jobs:
            if job.state == "running":
                step = job.last_status.step if job.last_status else 0
                job.state = "failed"
                job.record(
                    restarts=local.inference_restarts,
                    failed=f"interrupted (Ctrl-C) after step {step}; run it again to resume from the checkpoint",
                )
        return 130
    except RunFailed as exc:
        print(f"grpolora run: {exc}", file=sys.stderr)
        _stop_ignoring_interrupts(local)
        local.record_unfinished("\n".join(str(exc).splitlines()[: STATUS_LOG_LINES + 1]), own_reason="replace")
        _print_summary(local)
        return 1
    local.stop()
    _print_summary(local)
    return 0 if all(job.state == "succeeded" for job in local.jobs) else 1


def _print_summary(local: LocalRun) -> None:
    """Each job's result: its phase, its rewards and sync figures, its run folder."""
    for job in local.jobs:
        prefix = f"{job.name}: " if local.pool else ""
        status = job.last_status
        if job.state == "waiting":
            print(f"{prefix}not started (it was waiting for a slot of the pool)")
            continue
        if status is not None:
            print(
                f"{prefix or 'trainer: '}{status.phase} after {status.step}/{status.total_steps} steps, sync round "
                f"{status.sync_round}"
            )
        for line in summarize(read_metrics(job.run_dir)).splitlines():
            print(prefix + line)
        print(
            f"{prefix}run folder: {job.run_dir}: metrics.jsonl, status.json, final-adapter/, samples.jsonl, "
            f"tensorboard/, checkpoints/, plot.png, logs/"
        )
