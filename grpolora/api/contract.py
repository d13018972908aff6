"""The environment contract between the launchers (operator, local Ray launcher) and the worker processes.

This module is the only place that spells these variable names. `grpolora.api.plan` decides their values;
the workers read them back through `WorkerEnv.from_environ`. Documented in docs/contract.md.

Trainer ranks use the standard torch.distributed names. A trainer pod with LOCAL_WORLD_SIZE > 1 (several GPUs)
starts that many processes and gives each RANK = NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK, as torchrun does.

The sync group is trainer rank 0 (sync rank 0, which also hosts the group's store at SYNC_ADDR:SYNC_PORT) plus
one rank per inference replica. At full membership, inference replica i has sync rank 1 + i. When a replica is
lost or added, trainer rank 0 re-forms the group under epoch + 1 and hands each member its new rank over HTTP
(`POST /v1/sync/join`), densely in replica order; GRPOLORA_SYNC_EPOCH is only the first epoch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from grpolora.api.spec import GRPOLoraJobSpec, RolloutPoolSpec

# torch.distributed among trainer ranks (pod level; RANK and LOCAL_RANK are set per process).
MASTER_ADDR: Final = "MASTER_ADDR"
MASTER_PORT: Final = "MASTER_PORT"
WORLD_SIZE: Final = "WORLD_SIZE"
NODE_RANK: Final = "NODE_RANK"
LOCAL_WORLD_SIZE: Final = "LOCAL_WORLD_SIZE"
RANK: Final = "RANK"
LOCAL_RANK: Final = "LOCAL_RANK"

# The job.
JOB_NAME: Final = "GRPOLORA_JOB_NAME"
NAMESPACE: Final = "GRPOLORA_NAMESPACE"
ROLE: Final = "GRPOLORA_ROLE"
SPEC: Final = "GRPOLORA_SPEC"  # the validated job spec as JSON (camelCase, defaults filled in)
REPLICA_INDEX: Final = "GRPOLORA_REPLICA_INDEX"  # this pod's index within its role
MODEL: Final = "GRPOLORA_MODEL"  # where to load the base model from: a hub id or a path in the pod
TOKEN: Final = "GRPOLORA_TOKEN"  # per-job secret required by the control endpoints (local runs)
# In pods: the file holding that token, the job's token Secret mounted read-only (no secret in the env). A worker
# reads the token from this file when it is set, else from GRPOLORA_TOKEN.
TOKEN_FILE: Final = "GRPOLORA_TOKEN_FILE"
# Read by huggingface_hub itself (its constants.HF_TOKEN_PATH), so by every hub client in the pod: the file that holds
# the hub token of spec.model.tokenFrom, which the operator mounts. A file, not HF_TOKEN: no secret in the env.
HUB_TOKEN_PATH: Final = "HF_TOKEN_PATH"
BIND_ADDR: Final = "GRPOLORA_BIND_ADDR"  # address the HTTP servers listen on

# The sync group.
SYNC_ADDR: Final = "GRPOLORA_SYNC_ADDR"
SYNC_PORT: Final = "GRPOLORA_SYNC_PORT"
# At full membership: 1 + inference replicas (one member per replica, its engine's TP rank 0 worker, whatever the
# tensorParallelSize; plan.sync_world_size).
SYNC_WORLD_SIZE: Final = "GRPOLORA_SYNC_WORLD_SIZE"
SYNC_BACKEND: Final = "GRPOLORA_SYNC_BACKEND"  # nccl | gloo
SYNC_EPOCH: Final = "GRPOLORA_SYNC_EPOCH"
SYNC_TIMEOUT_SECONDS: Final = "GRPOLORA_SYNC_TIMEOUT_SECONDS"
# Trainer pods: which start of the job's trainer this is, a count that only grows (the operator: its restart attempt,
# the trainer Job's pod template annotation RESTART_ATTEMPT read through the downward API, empty for the first;
# `grpolora run`: its start time in ms). Replicas refuse a trainer older than the newest they have seen (fencing:
# workers/sync/receiver.py), so a restart's predecessor that still runs cannot publish.
TRAINER_INCARNATION: Final = "GRPOLORA_TRAINER_INCARNATION"

# Trainer rank 0.
INFERENCE_ENDPOINTS: Final = "GRPOLORA_INFERENCE_ENDPOINTS"  # comma-separated base URLs, in replica order
STATUS_PORT: Final = "GRPOLORA_STATUS_PORT"
CHECKPOINT_DIR: Final = "GRPOLORA_CHECKPOINT_DIR"
OUTPUT_DIR: Final = "GRPOLORA_OUTPUT_DIR"  # metrics.jsonl, final adapter, plot
DATA_DIR: Final = "GRPOLORA_DATA_DIR"  # where spec.task.dataset paths start (the dataset volume's mount)
SECRETS_DIR: Final = "GRPOLORA_SECRETS_DIR"  # the Secrets the job names: <dir>/<secret name>/<key>, one file a key
CHAT_TEMPLATE_FILE: Final = "GRPOLORA_CHAT_TEMPLATE_FILE"  # spec.task.chatTemplateFrom's key, mounted as a file
# spec.environment.server (issue 48): the base URLs of the environment server's pods that the operator (or `grpolora
# run`) runs for the job, comma-separated, in pod order (its headless Service's per-pod names: an episode's reset,
# steps and close must reach the one server that holds it, so the trainer pins each episode to one URL rather than
# letting a Service spread its calls); the trainer reaches the environment there (or an agent its sandbox). The
# server's own pods get ENVIRONMENT_TOKEN_FILE: the environment token, which every call to it must carry as a bearer
# token (a server of the project's, python -m grpolora.workers.environments.service, reads it; ENVIRONMENT_TOKEN
# locally). It is derived from the job's token (grpolora.api.pool.environment_token), never the job's token itself:
# the server runs model-driven code, and the job's token opens the replicas; the trainer derives it from its own.
ENVIRONMENT_URL: Final = "GRPOLORA_ENVIRONMENT_URL"
ENVIRONMENT_TOKEN: Final = "GRPOLORA_ENVIRONMENT_TOKEN"
ENVIRONMENT_TOKEN_FILE: Final = "GRPOLORA_ENVIRONMENT_TOKEN_FILE"
# The port an environment server listens on (set in its own environment: spec.environment.server.port in a pod, a
# free port per process in `grpolora run`). A server with its own command reads it, or names it in its command or
# args as `$(GRPOLORA_ENVIRONMENT_PORT)`, which Kubernetes expands in a pod and `grpolora run` expands the same way.
ENVIRONMENT_PORT: Final = "GRPOLORA_ENVIRONMENT_PORT"

# The servers of a RolloutPool (shared by several jobs) get these instead of the job's: GRPOLORA_ROLE (inference),
# GRPOLORA_NAMESPACE, GRPOLORA_REPLICA_INDEX, GRPOLORA_MODEL, GRPOLORA_BIND_ADDR and GRPOLORA_SYNC_BACKEND (the device
# adapters arrive on) have the same meaning as above. Nothing of theirs counts the pool's replicas (the pool scales
# by a patch of its StatefulSet's replicas, which must not change the pod template): the replicas are named beside
# the attachment list (grpolora.api.pool.replicas_file), and each server gets only its own port.
POOL_NAME: Final = "GRPOLORA_POOL_NAME"
POOL_SPEC: Final = "GRPOLORA_POOL_SPEC"  # the validated RolloutPool spec less replicas, as JSON (camelCase)
POOL_JOBS_FILE: Final = "GRPOLORA_POOL_JOBS_FILE"  # the attachment list (grpolora.api.pool), re-read when it changes
HTTP_PORT: Final = "GRPOLORA_HTTP_PORT"  # the port this pool server listens on
POOL_ONLY: Final = (POOL_NAME, POOL_SPEC, POOL_JOBS_FILE, HTTP_PORT)

ALL: Final = (
    MASTER_ADDR,
    MASTER_PORT,
    WORLD_SIZE,
    NODE_RANK,
    LOCAL_WORLD_SIZE,
    RANK,
    LOCAL_RANK,
    JOB_NAME,
    NAMESPACE,
    ROLE,
    SPEC,
    REPLICA_INDEX,
    MODEL,
    TOKEN,
    TOKEN_FILE,
    HUB_TOKEN_PATH,
    BIND_ADDR,
    SYNC_ADDR,
    SYNC_PORT,
    SYNC_WORLD_SIZE,
    SYNC_BACKEND,
    SYNC_EPOCH,
    SYNC_TIMEOUT_SECONDS,
    TRAINER_INCARNATION,
    INFERENCE_ENDPOINTS,
    STATUS_PORT,
    CHECKPOINT_DIR,
    OUTPUT_DIR,
    DATA_DIR,
    SECRETS_DIR,
    CHAT_TEMPLATE_FILE,
    ENVIRONMENT_URL,
    ENVIRONMENT_TOKEN,
    ENVIRONMENT_TOKEN_FILE,
    ENVIRONMENT_PORT,
    *POOL_ONLY,
)


# Exit codes of a worker that will fail the same way however often it is restarted (sysexits.h values). The
# trainer Job's podFailurePolicy fails the Job at once on them (grpolora.operator.builders), and the operator
# fails the GRPOLoraJob with the trainer's termination message instead of spending spec.trainer.maxRestarts.
EXIT_INVALID_SPEC: Final = 78  # EX_CONFIG: the env contract or the spec it carries is invalid
EXIT_INVALID_DATA: Final = 65  # EX_DATAERR: the task's dataset or reward plugin cannot work
TRAINER_INPUT_EXIT_CODES: Final = (EXIT_INVALID_DATA, EXIT_INVALID_SPEC)
# A trainer fenced off: an inference replica refused it as older than the newest trainer incarnation it saw
# (TRAINER_INCARNATION; StaleIncarnation in grpolora.workers.sync.control), so a newer trainer of the job has taken
# over. Not a crash: the trainer Job's podFailurePolicy has a rule for it, and the operator neither spends
# spec.trainer.maxRestarts on it nor fails the job (it replaces the trainer with a new incarnation if it is still the
# current one). 79: the first code past sysexits.h's range (EX__MAX is 78), so it means nothing else.
EXIT_FENCED: Final = 79
# Kubernetes copies this file into the container's terminated state (`message`, 4 KiB at most).
TERMINATION_LOG: Final = "/dev/termination-log"


def write_termination_message(message: str) -> None:
    """Leave `message` where Kubernetes reads a container's termination message (best effort: outside a pod the
    file may not exist or be writable)."""
    try:
        with open(TERMINATION_LOG, "w", encoding="utf-8") as out:
            out.write(message[:4096])
    except OSError:
        pass


class ContractError(ValueError):
    """The environment does not hold what the contract promises (names the variable)."""


@dataclass(frozen=True)
class WorkerEnv:
    """What a worker process learns from its environment, parsed and checked once at start-up."""

    job_name: str
    namespace: str
    role: Literal["trainer", "inference"]
    spec: GRPOLoraJobSpec
    replica_index: int
    model: str
    token: str
    bind_addr: str
    master_addr: str
    master_port: int
    world_size: int
    node_rank: int
    local_world_size: int
    sync_addr: str
    sync_port: int
    sync_world_size: int
    sync_backend: Literal["nccl", "gloo"]
    sync_epoch: int
    sync_timeout_seconds: int
    inference_endpoints: tuple[str, ...]
    status_port: int
    checkpoint_dir: str
    output_dir: str | None
    data_dir: str | None = None
    trainer_incarnation: int = 0  # TRAINER_INCARNATION (trainer pods; 0 when unset or empty)

    @property
    def sync_rank(self) -> int:
        """This inference replica's rank in the sync group at full membership (trainer rank 0 is rank 0)."""
        return 1 + self.replica_index

    @property
    def own_endpoint(self) -> str:
        """This inference replica's base URL (its HTTP port is the port in it)."""
        return self.inference_endpoints[self.replica_index]

    @property
    def port(self) -> int:
        """The port this inference server listens on (its own endpoint's)."""
        return int(self.own_endpoint.rsplit(":", 1)[1])

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        read = _Reader(os.environ if environ is None else environ)
        get, integer = read.get, read.integer
        role = get(ROLE)
        if role not in ("trainer", "inference"):
            raise ContractError(f"environment variable {ROLE}={role!r}: expected trainer or inference")
        backend = read.backend()
        try:
            spec = GRPOLoraJobSpec.model_validate(json.loads(get(SPEC)))
        except ValueError as exc:
            raise ContractError(f"environment variable {SPEC} does not hold a valid job spec: {exc}") from None
        endpoints = read.endpoints()
        index = integer(REPLICA_INDEX)
        if role == "inference":
            read.check_index(index, endpoints)
        return cls(
            job_name=get(JOB_NAME),
            namespace=get(NAMESPACE),
            role=role,  # type: ignore[arg-type]
            spec=spec,
            replica_index=index,
            model=get(MODEL),
            token=read.secret(TOKEN, TOKEN_FILE),
            bind_addr=read.env.get(BIND_ADDR) or "0.0.0.0",
            master_addr=get(MASTER_ADDR),
            master_port=integer(MASTER_PORT),
            world_size=integer(WORLD_SIZE),
            node_rank=integer(NODE_RANK),
            local_world_size=integer(LOCAL_WORLD_SIZE),
            sync_addr=get(SYNC_ADDR),
            sync_port=integer(SYNC_PORT),
            sync_world_size=integer(SYNC_WORLD_SIZE),
            sync_backend=backend,  # type: ignore[arg-type]
            sync_epoch=integer(SYNC_EPOCH),
            sync_timeout_seconds=integer(SYNC_TIMEOUT_SECONDS),
            inference_endpoints=endpoints,
            status_port=integer(STATUS_PORT),
            checkpoint_dir=get(CHECKPOINT_DIR),
            output_dir=read.env.get(OUTPUT_DIR) or None,
            data_dir=read.env.get(DATA_DIR) or None,
            trainer_incarnation=integer(TRAINER_INCARNATION) if read.env.get(TRAINER_INCARNATION) else 0,
        )


def is_pool_server(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a RolloutPool's server (plan_pool sets GRPOLORA_POOL_SPEC, a job's pods never do)."""
    return bool((os.environ if environ is None else environ).get(POOL_SPEC))


@dataclass(frozen=True)
class PoolEnv:
    """What a RolloutPool's server learns from its environment (grpolora.api.plan.plan_pool; docs/contract.md)."""

    pool_name: str
    namespace: str
    spec: RolloutPoolSpec
    replica_index: int
    model: str
    bind_addr: str
    port: int
    sync_backend: Literal["nccl", "gloo"]
    jobs_file: str

    @property
    def role(self) -> Literal["inference"]:
        return "inference"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> PoolEnv:
        read = _Reader(os.environ if environ is None else environ)
        role = read.get(ROLE)
        if role != "inference":
            raise ContractError(f"environment variable {ROLE}={role!r}: a RolloutPool's servers are inference")
        try:
            spec = RolloutPoolSpec.model_validate(json.loads(read.get(POOL_SPEC)))
        except ValueError as exc:
            raise ContractError(
                f"environment variable {POOL_SPEC} does not hold a valid RolloutPool spec: {exc}"
            ) from None
        index = read.integer(REPLICA_INDEX)
        if index < 0:
            raise ContractError(f"environment variable {REPLICA_INDEX}={index} is negative")
        if not read.env.get(HTTP_PORT) and read.env.get(INFERENCE_ENDPOINTS):
            # A pool created by an earlier release: its pod template lists every replica's endpoint instead.
            endpoints = read.endpoints()
            read.check_index(index, endpoints)
            port = int(endpoints[index].rsplit(":", 1)[1])
        else:
            port = read.integer(HTTP_PORT)
        if not 0 < port < 65536:
            raise ContractError(f"environment variable {HTTP_PORT}={port} is not a TCP port")
        return cls(
            pool_name=read.get(POOL_NAME),
            namespace=read.get(NAMESPACE),
            spec=spec,
            replica_index=index,
            model=read.get(MODEL),
            bind_addr=read.env.get(BIND_ADDR) or "0.0.0.0",
            port=port,
            sync_backend=read.backend(),  # type: ignore[arg-type]
            jobs_file=read.get(POOL_JOBS_FILE),
        )


@dataclass(frozen=True)
class _Reader:
    """Reads contract variables, each problem naming the variable."""

    env: Mapping[str, str]

    def get(self, name: str) -> str:
        value = self.env.get(name)
        if value is None or value == "":
            raise ContractError(f"environment variable {name} is not set (see docs/contract.md)")
        return value

    def secret(self, name: str, file_name: str) -> str:
        """A secret from the file `file_name` names (how pods get it), else from the variable `name` itself."""
        path = self.env.get(file_name)
        if not path:
            return self.get(name)
        try:
            value = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ContractError(f"environment variable {file_name}={path}: cannot read the file ({exc})") from None
        if not value:
            raise ContractError(f"environment variable {file_name}={path}: the file is empty")
        return value

    def integer(self, name: str) -> int:
        raw = self.get(name)
        try:
            return int(raw)
        except ValueError:
            raise ContractError(f"environment variable {name}={raw!r} is not an integer") from None

    def backend(self) -> str:
        backend = self.get(SYNC_BACKEND)
        if backend not in ("nccl", "gloo"):
            raise ContractError(f"environment variable {SYNC_BACKEND}={backend!r}: expected nccl or gloo")
        return backend

    def endpoints(self) -> tuple[str, ...]:
        return tuple(e for e in self.get(INFERENCE_ENDPOINTS).split(",") if e)

    @staticmethod
    def check_index(index: int, endpoints: tuple[str, ...]) -> None:
        if not 0 <= index < len(endpoints):
            raise ContractError(f"{REPLICA_INDEX}={index} has no entry in {INFERENCE_ENDPOINTS} ({len(endpoints)})")
