"""`grpolora run job.yaml`: the same job on one machine, on Ray.

Each trainer replica and each inference replica is a Ray actor with its own resources (on a GPU machine, its
own GPUs: trainer and inference never share one). An actor runs the very worker entry point a pod runs,
`grpolora worker <role>`, with the env contract that plan() gives the operator, built for the loopback network.
The driver watches trainer rank 0's /status (as the operator does), draws a progress bar, and at the end writes
the run folder: metrics.jsonl, the final adapter, checkpoints, worker logs and plot.png.

Faults, as a cluster would take them: a lost inference replica is started again (up to
INFERENCE_RESTARTS_PER_REPLICA times) while the trainer carries on with the others and re-adds the replacement once
it serves the current adapter; a trainer failure ends the run (run it again to resume from the checkpoint). Every
way a run ends leaves status.json saying how, and Ctrl-C stops the trainer first, then every replica at once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from grpolora.api import contract
from grpolora.api.load import InvalidJob, job_warnings, load_one_job
from grpolora.api.plan import JobPlan, LoopbackNetwork, Role, plan
from grpolora.api.spec import GRPOLoraJob
from grpolora.api.status import TrainerStatus
from grpolora.workers.inference.adapter_folders import remove_stale_adapter_roots
from grpolora.workers.lifetime import die_with_parent
from grpolora.workers.tracking import SAMPLES_FILE

POLL_SECONDS = 1.0
TRAINER_STOP_SECONDS = 10.0  # the trainer records its status and exits at once on SIGTERM
# uvicorn's grace for requests in flight (3 s), then the engine's own shutdown, which waits for its workers (~4 s
# on a CPU): cut it short, since whatever is left is killed and its adapter folder removed anyway.
INFERENCE_STOP_SECONDS = 5.0
INFERENCE_RESTARTS_PER_REPLICA = 3
"""Times `grpolora run` starts a lost inference replica again before the run fails."""
STATUS_LOG_LINES = 10  # of a failed worker's log, kept in status.json's message


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
                    _signal_group(self.proc.pid, signal.SIGTERM)
                else:
                    with contextlib.suppress(ProcessLookupError):
                        self.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(grace)
            _signal_group(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()

    return WorkerProcess


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


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
        self._envs: list[dict[str, str]] = []
        self._groups: list[int] = []
        self._started_ray = False
        self._started_at = time.time()
        self.last_status: TrainerStatus | None = None
        self.restarts: dict[int, int] = {}  # inference replica index -> times restarted

    @property
    def inference_restarts(self) -> int:
        return sum(self.restarts.values())

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
                self.workers.append(worker)
                self._envs.append(env)
                self._actors.append(self._start_actor(worker, env))
        # Worker process groups on this machine: stop() kills what is left of them even if an actor is gone.
        self._groups = ray.get([a.pgid.remote() for a in self._actors]) if self._started_ray else []

    def _start_actor(self, worker: Worker, env: dict[str, str]):
        return (
            _worker_actor_class()
            .options(
                # A replacement's name differs from the killed actor's, which Ray may still be tearing down.
                name=f"{self.job.name}-{worker.role}-{worker.index}-{os.getpid()}-{self.restarts.get(worker.index, 0)}",
                num_cpus=1,
                num_gpus=worker.gpus,
            )
            .remote(env, str(worker.log), worker.role, self.cpus.get(worker.role))
        )

    def _restart(self, position: int, code: int | str) -> None:
        """Start a lost inference replica again, with the same env (name, port, rank in the job): as a StatefulSet
        brings back its pod. The trainer re-adds it to the sync group once it serves the current adapter."""
        import ray

        worker, old = self.workers[position], self._actors[position]
        with contextlib.suppress(Exception):
            ray.get(old.stop.remote(0.0, True))  # whatever of its group is left
        ray.kill(old)
        self.restarts[worker.index] = self.restarts.get(worker.index, 0) + 1
        with worker.log.open("a") as log:
            log.write(f"\n--- grpolora run: exited with code {code}; restart {self.restarts[worker.index]} ---\n")
        self._actors[position] = self._start_actor(worker, self._envs[position])
        if self._started_ray:
            self._groups.append(ray.get(self._actors[position].pgid.remote()))

    def _exit_codes(self) -> list[int | str | None]:
        import ray

        codes: list[int | str | None] = []
        for actor in self._actors:
            try:
                codes.append(ray.get(actor.poll.remote()))
            except ray.exceptions.RayActorError:
                codes.append("lost (its Ray actor died)")
        return codes

    def wait(self) -> TrainerStatus | None:
        """Until trainer rank 0 exits: progress from its /status; a lost inference replica is restarted within
        its budget; any other failed worker stops the run (RunFailed)."""
        status_url = f"http://127.0.0.1:{self.plan.job.spec.trainer.status_port}/status"
        progress = _Progress(self.job.spec.grpo.steps, enabled=self.show_progress, samples=self.run_dir / SAMPLES_FILE)
        client = httpx.Client(timeout=2.0)
        try:
            while True:
                for position, (worker, code) in enumerate(zip(self.workers, self._exit_codes(), strict=True)):
                    if code is None:
                        continue
                    if worker.role == "trainer" and code == 0:
                        if worker.index == 0:
                            progress.close(self.last_status)
                            return self.last_status
                        continue  # a follower rank done with the final collective; rank 0 is still writing
                    failure = f"{worker.role} {worker.index} exited with code {code}"
                    if (
                        worker.role == "inference"
                        and self.restarts.get(worker.index, 0) < INFERENCE_RESTARTS_PER_REPLICA
                    ):
                        progress.note(
                            f"grpolora run: {failure}; starting it again (restart "
                            f"{self.restarts.get(worker.index, 0) + 1} of {INFERENCE_RESTARTS_PER_REPLICA}); "
                            f"the trainer carries on with the other replicas; log: {worker.log}"
                        )
                        self._restart(position, code)
                        continue
                    if worker.role == "inference":
                        failure += f" after {INFERENCE_RESTARTS_PER_REPLICA} restarts"
                    raise RunFailed(worker, f"{failure}; end of {worker.log}:\n{_tail(worker.log)}")
                try:
                    self.last_status = TrainerStatus.model_validate(client.get(status_url).json())
                    progress.update(self.last_status, self.inference_restarts)
                except (httpx.HTTPError, ValueError):
                    pass  # the trainer is still starting
                time.sleep(POLL_SECONDS)
        finally:
            client.close()
            progress.close(None)

    def stop(self) -> None:
        """The trainer first (it records where it stopped), then every inference replica at once."""
        import ray

        if self._actors:
            for role, grace in (("trainer", TRAINER_STOP_SECONDS), ("inference", INFERENCE_STOP_SECONDS)):
                actors = [a for w, a in zip(self.workers, self._actors, strict=True) if w.role == role]
                pending = [a.stop.remote(grace, role == "trainer") for a in actors]
                for ref in pending:
                    with contextlib.suppress(Exception):  # an actor already dead (e.g. killed for memory)
                        ray.get(ref)
                for actor in actors:
                    ray.kill(actor)
            self._actors = []
        for group in self._groups:
            _signal_group(group, signal.SIGKILL)
        self._groups = []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
        remove_stale_adapter_roots()  # of servers that were killed outright

    def record(self, *, failed: str | None = None, own_reason: str = "keep") -> TrainerStatus | None:
        """Complete status.json, whatever way the run ended, with the number of inference restarts.

        `failed` says how the run failed (None: it did not). The trainer's own record, if it wrote one during this
        run, stays the base; when it already says Failed (its exception, or where SIGTERM stopped it), `own_reason`
        decides: `keep` its message, `prefix` it with the first clause of `failed` (which worker, which exit
        code), or `replace` it with `failed` (the cause lies elsewhere, e.g. a replica out of restarts)."""
        path = self.run_dir / "status.json"
        own = None
        if path.exists() and path.stat().st_mtime >= self._started_at:
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
        status = status.model_copy(update={"inference_restarts": self.inference_restarts})
        path.write_text(json.dumps(status.to_wire(), indent=2))
        return status


def sample_line(row: Mapping[str, Any], width: int) -> str:
    """One line of `grpolora run`'s progress for a row of samples.jsonl, at most `width` columns:
    `step 10 sample: "<prompt>" -> "<completion>" (reward 1.100, adv +0.817)`. Newlines and other control characters
    are escaped; the completion gets at least two thirds of the room for the texts, and each text is shortened with
    `…` when it does not fit."""
    head = f"step {row['step']} sample: "
    tail = f" (reward {row['reward']:.3f}, adv {row['advantage']:+.3f})"
    prompt, completion = _escape(row["prompt"]), _escape(row["completion"])
    room = width - len(head) - len(tail) - len('"" -> ""')
    prompt_room = min(len(prompt), max(room // 3, room - len(completion), 1))
    text = f'"{_shorten(prompt, prompt_room)}" -> "{_shorten(completion, room - prompt_room)}"'
    return _shorten(head + text + tail, width)


def _escape(text: str) -> str:
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def _shorten(text: str, room: int) -> str:
    if len(text) <= room:
        return text
    return text[: room - 1] + "…" if room > 0 else ""


class _SampleTail:
    """New rows of the run's samples.jsonl (those written after it was opened), read as the trainer appends them;
    a line still being written is read on a later call."""

    def __init__(self, path: Path):
        self._path = path
        self._offset = path.stat().st_size if path.exists() else 0

    def new_rows(self) -> list[dict[str, Any]]:
        try:
            with self._path.open("rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        rows = []
        for line in complete.splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
        return rows


class _Progress:
    """A progress bar on a terminal; one line per step otherwise (CI logs, files). Each step with sample
    completions (tracking.samplesEverySteps) adds a line with its first sample (`sample_line`)."""

    def __init__(self, total: int, *, enabled: bool, samples: Path | None = None):
        self._bar = None
        self._enabled = enabled
        self._last_line: tuple | None = None
        self._samples = _SampleTail(samples) if enabled and samples is not None else None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="GRPO", unit="step", dynamic_ncols=True)

    def update(self, status: TrainerStatus, restarts: int = 0) -> None:
        self._update(status, restarts)
        self._show_samples()

    def _show_samples(self) -> None:
        if self._samples is None:
            return
        shown: set[int] = set()
        for row in self._samples.new_rows():
            if row.get("step") not in shown:  # the first sample of each step: its first prompt's first completion
                shown.add(row.get("step"))
                with contextlib.suppress(KeyError, TypeError, ValueError):  # a row not in the documented shape
                    self.note(sample_line(row, shutil.get_terminal_size().columns))

    def _update(self, status: TrainerStatus, restarts: int) -> None:
        replicas = f"{len(status.sync_members)} replica(s) in sync"
        if self._bar is None:
            if self._enabled and (status.phase, status.step, restarts) != self._last_line:
                self._last_line = (status.phase, status.step, restarts)
                reward = "" if status.reward_mean is None else f" reward {status.reward_mean:.3f}"
                kl = "" if status.kl is None else f" kl {status.kl:.4f}"
                sync = "" if status.last_sync_seconds is None else f" sync {status.last_sync_seconds * 1000:.0f} ms"
                lost = f" {replicas}, inference restarts {restarts}" if restarts else ""
                print(
                    f"[{status.phase}] step {status.step}/{status.total_steps}{reward}{kl}{sync}{lost}",
                    file=sys.stderr,
                )
            return
        self._bar.n = status.step
        postfix = {"phase": status.phase}
        if status.reward_mean is not None:
            postfix |= {"reward": f"{status.reward_mean:.3f}", "kl": f"{status.kl or 0:.4f}"}
        if status.last_sync_seconds is not None:
            postfix |= {"sync": f"{status.last_sync_seconds * 1000:.0f}ms", "round": status.sync_round}
        if restarts:
            postfix |= {"in sync": len(status.sync_members), "restarts": restarts}
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.refresh()

    def note(self, message: str) -> None:
        """A line that stays above the bar (or in the log)."""
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr)

    def close(self, status: TrainerStatus | None) -> None:
        self._show_samples()  # the last step's, written just before the trainer exits
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


def _stop_ignoring_interrupts(local: LocalRun) -> None:
    """A second Ctrl-C while stopping would leave workers behind: stopping takes a few seconds at most."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        local.stop()
    finally:
        signal.signal(signal.SIGINT, previous)


def run(job_file: str, *, run_dir: str | None = None, ray_address: str | None = None) -> int:
    """The `grpolora run` command. Returns the exit status."""
    try:
        job = load_one_job(job_file, "`grpolora run` runs one")
    except InvalidJob as exc:
        print(exc, file=sys.stderr)
        return 1
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
        print("\ngrpolora run: interrupted; stopping the trainer, then every inference replica", file=sys.stderr)
        step = local.last_status.step if local.last_status else 0
        _stop_ignoring_interrupts(local)
        local.record(failed=f"interrupted (Ctrl-C) after step {step}; run it again to resume from the checkpoint")
        return 130
    except RunFailed as exc:
        print(f"grpolora run: {exc}", file=sys.stderr)
        _stop_ignoring_interrupts(local)
        brief = "\n".join(str(exc).splitlines()[: STATUS_LOG_LINES + 1])
        local.record(failed=brief, own_reason="prefix" if exc.worker.role == "trainer" else "replace")
        return 1
    local.stop()
    status = local.record()
    if status is not None:
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
