"""`grpolora worker trainer`: one trainer pod (or local actor). It starts LOCAL_WORLD_SIZE rank processes (one per
GPU, as torchrun does) and each joins torch.distributed with the rendezvous from the env contract."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from grpolora.api import contract
from grpolora.api.contract import WorkerEnv
from grpolora.api.status import TrainerStatus
from grpolora.workers.environments.episode import ChatTemplateError
from grpolora.workers.models import ModelUnavailable
from grpolora.workers.remote_service import AuthRefused
from grpolora.workers.secrets import SecretError
from grpolora.workers.sync.control import StaleIncarnation
from grpolora.workers.tasks.base import TaskError
from grpolora.workers.tracking import TrackingError
from grpolora.workers.trainer.policy import ModelMismatch

log = logging.getLogger(__name__)

STARTUP_WAIT_SECONDS = 1800.0


def run_trainer_pod(env: WorkerEnv) -> int:
    """The pod's exit code: its one rank's, or with several GPUs the ranks' (pod_exit_code)."""
    if env.local_world_size == 1:
        return run_rank(env, local_rank=0)
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    ranks = mp.start_processes(
        _spawned_rank, args=(env,), nprocs=env.local_world_size, start_method="spawn", join=False
    )

    def forward(signum: int, _frame) -> None:
        # The kubelet (or `grpolora run`) signals this process only. Without this its ranks would get SIGINT when
        # it died (torch's pdeathsig), which torch's wrapper swallows: rank 0 would never write status.json.
        for process in ranks.processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    try:
        while not ranks.join():
            pass
    except ProcessException:
        pass  # one rank failed: torch has stopped the others; their codes decide below
    return pod_exit_code([process.exitcode for process in ranks.processes])


# Exit codes that say "do not retry" (the trainer Job's podFailurePolicy fails the job at once on them).
FINAL_EXIT_CODES = (contract.EXIT_INVALID_SPEC, contract.EXIT_INVALID_DATA)


def pod_exit_code(codes: list[int | None]) -> int:
    """One exit code for a pod of several ranks, from each rank's (negative: killed by that signal; None: not
    reaped). A code that forbids a retry wins wherever it came from (a rank stopped after another failed exits 1 or
    by SIGTERM, which would turn it into a retry); then rank 0's, which knows why the run stopped; then any."""
    shell = [128 - code if code is not None and code < 0 else code for code in codes]  # as a shell reports them
    for code in shell:
        if code in FINAL_EXIT_CODES:
            return code
    if shell[0]:
        return shell[0]
    return next((code for code in shell if code), 0)


def _spawned_rank(local_rank: int, env: WorkerEnv) -> None:
    code = run_rank(env, local_rank)
    if code:
        raise SystemExit(code)


def run_rank(env: WorkerEnv, local_rank: int) -> int:
    from grpolora.workers.models import fingerprint, resolve_model
    from grpolora.workers.tasks import load_task
    from grpolora.workers.trainer.controller import Controller
    from grpolora.workers.trainer.policy import Policy
    from grpolora.workers.trainer.ranks import TrainerContext, instruction_group, run_follower
    from grpolora.workers.trainer.status_server import StatusBoard, start_status_server

    rank = env.node_rank * env.local_world_size + local_rank
    os.environ[contract.RANK], os.environ[contract.LOCAL_RANK] = str(rank), str(local_rank)
    spec = env.spec
    use_gpu = spec.trainer.gpus_per_replica > 0
    device = torch.device("cuda", local_rank) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(device)
    board = StatusBoard(TrainerStatus(phase="Starting", total_steps=spec.grpo.steps)) if rank == 0 else None
    if board is not None:
        _record_and_exit_on_sigterm(board, Path(env.output_dir or env.checkpoint_dir))
    # Every trainer pod answers /health (readiness); rank 0 also serves /status and /metrics.
    server = start_status_server(board, env.bind_addr, env.status_port) if local_rank == 0 else None
    try:
        # A bad dataset or reward fails before any work.
        task = load_task(spec.task, data_root=Path(env.data_dir) if env.data_dir else None) if rank == 0 else None
        if env.world_size > 1:
            dist.init_process_group(
                backend="nccl" if use_gpu else "gloo",
                init_method=f"tcp://{env.master_addr}:{env.master_port}",
                rank=rank,
                world_size=env.world_size,
                device_id=device if use_gpu else None,
            )
        instructions = instruction_group(env.world_size)
        model_dir = resolve_model(env.model, spec.model.revision)
        policy = Policy(model_dir, spec, device=device, shard=env.world_size > 1)
        output_dir = Path(env.output_dir or env.checkpoint_dir)
        checkpoint_dir = Path(env.checkpoint_dir)
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        output_dir.mkdir(parents=True, exist_ok=True)
        ctx = TrainerContext(
            spec=spec,
            policy=policy,
            rank=rank,
            world_size=env.world_size,
            checkpoint_dir=checkpoint_dir,
            output_dir=output_dir,
            instructions=instructions,
        )
        ctx.resume()
        if rank != 0:
            run_follower(ctx)
            return 0
        assert board is not None and task is not None
        sender, rollouts = _connect(env, fingerprint(model_dir), ctx, device)
        try:
            # Inference engines may still be downloading and loading the model: wait for all of them.
            sender.form_group(wait_for_all_seconds=STARTUP_WAIT_SECONDS)
            controller = Controller(
                ctx, task=task, sender=sender, rollouts=rollouts, board=board, run_name=env.job_name
            )
            try:
                controller.run()
            finally:
                controller.close()
        finally:
            sender.close()
            rollouts.close()
            task.close()
        _write_final_status(board, output_dir)
        return 0
    except Exception as exc:
        log.exception("trainer rank %d failed", rank)
        return _record_failure(board, Path(env.output_dir or env.checkpoint_dir), exc)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if server is not None:
            server.shutdown()


def _record_failure(board, folder: Path, exc: BaseException) -> int:
    """What the trainer leaves behind when `exc` ended it (its /status, status.json in the job's output folder, the
    termination message the operator reads), and its exit code. A fenced trainer (EXIT_FENCED) leaves the output folder
    alone: a newer trainer of the job owns it now, and on a shared (ReadWriteMany) volume "Failed" written there would
    overwrite that live trainer's status.json."""
    code = exit_code(exc)
    if board is not None:
        board.update(phase="Failed", message=f"{type(exc).__name__}: {exc}")
        if code != contract.EXIT_FENCED:
            _write_final_status(board, folder)
    if code != 1:
        contract.write_termination_message(str(exc))
    return code


def exit_code(exc: BaseException) -> int:
    """The trainer's exit code for what ended it. A bad dataset or reward plugin (EXIT_INVALID_DATA), or a setting
    that can only fail where the run starts -- tracking, a Secret it names or credentials a service refuses, a LoRA
    target module the model lacks, a model that does not exist or that the token cannot read, a chat template that
    cannot continue an episode (EXIT_INVALID_SPEC) -- would fail a restart the same way: the operator fails the job
    at once with the message instead of restarting it. A trainer the replicas fenced off (StaleIncarnation: a newer
    trainer of the job took over) exits EXIT_FENCED, which the operator does not take for a crash. Anything else may
    be transient (1: restarted)."""
    if isinstance(exc, StaleIncarnation):
        return contract.EXIT_FENCED
    if isinstance(exc, TaskError):
        return contract.EXIT_INVALID_DATA
    if isinstance(exc, TrackingError | SecretError | AuthRefused | ModelMismatch | ModelUnavailable):
        return contract.EXIT_INVALID_SPEC
    if isinstance(exc, ChatTemplateError):  # the template the job names (or the model's own, which it can replace)
        return contract.EXIT_INVALID_SPEC
    return 1


def _record_and_exit_on_sigterm(board, folder: Path) -> None:
    """SIGTERM (Ctrl-C in `grpolora run`, a pod deleted) leaves status.json saying where the run stopped, then exits
    at once: the steps since the last checkpoint are redone when the run resumes, so there is nothing to save, and
    unwinding could wait on a collective or a rollout request for minutes."""

    def stop(signum: int) -> None:
        status = board.get()
        if status.phase == "Succeeded":  # every step is done and the final adapter written: only the record is left
            _write_final_status(board, folder)
            os._exit(0)
        board.update(
            phase="Failed",
            message=f"stopped by SIGTERM after step {status.step}/{status.total_steps}; run it again to resume from "
            "the latest checkpoint",
        )
        _write_final_status(board, folder)
        log.warning("stopped by SIGTERM after step %d", status.step)
        logging.shutdown()
        os._exit(128 + signum)

    # The main thread may sit in C for minutes (a collective, init_process_group, a model load), where a Python
    # signal handler does not run, and the kernel may hand SIGTERM to any thread (torch's own included). Python's
    # C-level handler, wherever it runs, writes the signal's number to the wakeup fd: a thread of ours reads it
    # and stops. The Python-level handler is then left with nothing to do.
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: None)
    signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            if signal.SIGTERM in os.read(wake_read, 64):
                stop(signal.SIGTERM)

    threading.Thread(target=watch, name="sigterm", daemon=True).start()


def _write_final_status(board, folder: Path) -> None:
    """The last /status, kept next to metrics.jsonl: the trainer's endpoint goes away when it exits."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "status.json").write_text(json.dumps(board.get().to_wire(), indent=2))
    except OSError as exc:
        log.warning("could not write status.json: %s", exc)


def _connect(env: WorkerEnv, model_fingerprint: str, ctx, device: torch.device):
    from grpolora.workers.sync import wire
    from grpolora.workers.sync.control import HttpMember
    from grpolora.workers.sync.sender import AdapterSender
    from grpolora.workers.sync.transport import connect_store
    from grpolora.workers.trainer.rollout import RolloutClient

    store = connect_store(env.bind_addr, env.sync_port, is_master=True, timeout_seconds=env.sync_timeout_seconds)
    members = [HttpMember(i, url, env.token) for i, url in enumerate(env.inference_endpoints)]
    sender = AdapterSender(
        members,
        store=store,
        store_addr=env.sync_addr,
        store_port=env.sync_port,
        backend=env.sync_backend,
        timeout_seconds=env.sync_timeout_seconds,
        join_timeout_seconds=env.spec.sync.join_timeout_seconds,
        progress_timeout_seconds=env.spec.sync.progress_timeout_seconds,
        incarnation=env.trainer_incarnation,
        bucket_bytes=env.spec.sync.bucket_mib << 20,
        fingerprint=model_fingerprint,
        token=env.token,
        first_epoch=max(env.sync_epoch, ctx.progress.epoch + 1 if ctx.progress.step else env.sync_epoch),
        first_version=ctx.progress.version,
        device=device if env.sync_backend == "nccl" else None,
        # Rounds carry the adapter in the model's dtype: half the bytes of the float32 master weights for a bf16 or
        # fp16 model, and the same LoRA that vLLM would build from float32 (it rounds to the model's dtype).
        wire_dtype=wire.dtype_named(env.spec.model.dtype),
        # A RolloutPool's servers name its replicas as it scales (a job's own servers answer that they have none).
        member_factory=lambda index, url: HttpMember(index, url, env.token),
    )
    rollouts = RolloutClient(
        env.inference_endpoints,
        env.token,
        timeout_seconds=max(env.sync_timeout_seconds, 600),
        endpoint_of=sender.endpoint,
        incarnation=sender.incarnation,  # fences its rollouts as its joins and rounds (AdapterBook.lease)
    )
    return sender, rollouts
