"""plan(job) -> JobPlan: the pure, single source of roles, replicas, ranks, names, ports, placement and env.

The operator turns a JobPlan into Kubernetes objects (grpolora.operator.builders); the local launcher turns the
same plan, built for the loopback network, into Ray actors. Neither decides any of these facts itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from grpolora.api import constants as c
from grpolora.api import contract as env
from grpolora.api.pool import JOBS_FILE_KEY, PoolReplicas, bind, environment_token, fit_errors
from grpolora.api.spec import (
    EnvironmentServerSpec,
    EnvironmentSpec,
    FieldErrors,
    GRPOLoraJob,
    GRPOLoraJobSpec,
    ModelSpec,
    RoleSpec,
    RolloutPool,
)

Role = Literal["trainer", "inference", "environment"]
MODEL_MOUNT = c.MODEL_MOUNT
DATASET_MOUNT = "/data"
SECRETS_MOUNT = "/var/run/grpolora/secrets"
CHAT_TEMPLATE_MOUNT = "/var/run/grpolora/chat-template"  # spec.task.chatTemplateFrom's key, as CHAT_TEMPLATE_NAME
CHAT_TEMPLATE_NAME = "template.jinja"
# Each Secret key a pod reads is one file under its mount, named after this (a Secret volume's `items[].path`).
SECRET_FILE = "token"
TOKEN_MOUNT = c.TOKEN_MOUNT
HUB_TOKEN_MOUNT = c.HUB_TOKEN_MOUNT
HUB_TOKEN_FILE = f"{HUB_TOKEN_MOUNT}/{SECRET_FILE}"


def trainer_secrets(spec: GRPOLoraJobSpec) -> tuple[str, ...]:
    """Names of the Secrets the trainer reads (mounted read-only under SECRETS_MOUNT/<name>/), in spec order: every
    one of GRPOLoraJobSpec.secret_references but the model's token (HF_TOKEN_PATH, in every pod) and the pods' own
    (tests/unit/test_render.py keeps the two lists in agreement)."""
    names = [r.headers_from.secret_name for r in spec.task.rewards if r.headers_from]
    if spec.environment is not None and spec.environment.headers_from is not None:
        names.append(spec.environment.headers_from.secret_name)
    tracking = spec.tracking
    names += [t.secret_name for t in (tracking.mlflow, tracking.wandb) if t is not None and t.secret_name]
    push = spec.output.push if spec.output else None
    if push is not None:
        names += [t.secret_name for t in (push.s3, push.hub) if t is not None and t.secret_name]
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class ClusterNetwork:
    """Pods reach each other by the DNS names of their role's headless Service."""

    def host(self, workload: str, namespace: str, index: int) -> str:
        return f"{workload}-{index}.{workload}.{namespace}.svc"

    def inference_port(self, base: int, index: int) -> int:
        """The port replica `index` of a role listens on (the inference servers', the environment server's)."""
        return base

    bind_addr: str = "0.0.0.0"


@dataclass(frozen=True)
class LoopbackNetwork:
    """Everything on one machine (`grpolora run`): one address, so inference replica i listens on port + i."""

    def host(self, workload: str, namespace: str, index: int) -> str:
        return "127.0.0.1"

    def inference_port(self, base: int, index: int) -> int:
        return base + index

    bind_addr: str = "127.0.0.1"


Network = ClusterNetwork | LoopbackNetwork


@dataclass(frozen=True)
class EnvVar:
    """One contract variable: a literal value, this pod's index in its role, or a Secret key. In pods a Secret key
    is a read-only file, which the variable `secret_file` names (no secret in a pod's env); a local run passes the
    value itself in `name`."""

    name: str
    value: str | None = None
    replica_index: bool = False
    secret: tuple[str, str] | None = None  # (Secret name, key)
    secret_file: str | None = None


@dataclass(frozen=True)
class Placement:
    image: str
    image_pull_policy: str | None
    image_pull_secrets: tuple[str, ...]
    gpus: int
    gpu_resource: str  # the extended resource the GPUs are requested as (nvidia.com/gpu, a MIG profile, amd.com/gpu)
    resources: Mapping[str, Any]
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...]
    affinity: Mapping[str, Any]


@dataclass(frozen=True)
class RolePlan:
    role: Role
    replicas: int
    procs_per_replica: int  # processes per pod (one per GPU for the trainer)
    workload_name: str
    service_name: str
    hosts: tuple[str, ...]  # address of each replica, by index
    ports: Mapping[str, int]  # named container ports
    env: tuple[EnvVar, ...]  # the contract, then the user's extra env (as written)
    user_env: tuple[Mapping[str, Any], ...]
    placement: Placement


def sync_world_size(replicas: int) -> int:
    """The sync group at full membership: trainer rank 0 and one member per inference replica, whatever the
    replica's tensorParallelSize. The member is the first worker of the replica's vLLM engine (TP rank 0); the
    replica's other TP workers map the segment it staged each round in (one pod, one host: docs/design.md,
    "Adapter sync")."""
    return 1 + replicas


@dataclass(frozen=True)
class SyncPlan:
    addr: str
    port: int
    world_size: int  # at full membership
    backend: Literal["nccl", "gloo"]
    epoch: int
    timeout_seconds: int
    bucket_bytes: int


@dataclass(frozen=True)
class JobPlan:
    name: str
    namespace: str
    trainer: RolePlan
    inference: RolePlan | None  # None: the rollouts run on the RolloutPool `pool`, which owns the servers
    master_addr: str
    master_port: int
    trainer_world_size: int
    sync: SyncPlan
    inference_endpoints: tuple[str, ...]
    token_secret: str
    model: str
    checkpoint_dir: str
    job: GRPOLoraJob = field(repr=False)
    spec: GRPOLoraJobSpec = field(repr=False)  # what the workers run with: the job's, bound to its pool if any
    pool: str | None = None
    environment: RolePlan | None = None
    """spec.environment.server's pods (a StatefulSet of the job's own, also on a RolloutPool); None without one."""
    environment_endpoints: tuple[str, ...] = ()
    """The base URL of each environment server pod, in pod order (the trainer's GRPOLORA_ENVIRONMENT_URL); empty on the
    loopback network, where `grpolora run` gives the trainer the URLs of the processes it started."""

    @property
    def roles(self) -> tuple[RolePlan, ...]:
        """The roles whose workloads this job owns, in creation order (no inference role on a pool; the environment
        server's only with spec.environment.server)."""
        return tuple(role for role in (self.trainer, self.inference, self.environment) if role is not None)

    def role(self, role: Role) -> RolePlan:
        found = {c.ROLE_TRAINER: self.trainer, c.ROLE_INFERENCE: self.inference, c.ROLE_ENVIRONMENT: self.environment}
        if found[role] is None and role == c.ROLE_ENVIRONMENT:
            raise ValueError(f"job {self.name} has no environment server (spec.environment.server)")
        if found[role] is None:
            raise ValueError(f"job {self.name} has no {role} role of its own: it runs on RolloutPool {self.pool}")
        return found[role]

    def env_for(self, role: Role, index: int, *, token: str) -> dict[str, str]:
        """Concrete environment of one pod/actor: what the launcher passes to a worker process."""
        values: dict[str, str] = {}
        for var in self.role(role).env:
            if var.replica_index:
                values[var.name] = str(index)
            elif var.secret is not None:
                values[var.name] = token_secret_data(token)[var.secret[1]]
            else:
                assert var.value is not None
                values[var.name] = var.value
        return values


def token_secret_data(token: str) -> dict[str, str]:
    """The keys of a job's token Secret (`<job>-grpolora-token`): the job's token, and the environment server's
    token derived from it (the only key the server's pods mount). A local run passes the same values."""
    return {c.TOKEN_SECRET_KEY: token, c.ENVIRONMENT_TOKEN_SECRET_KEY: environment_token(token)}


def child_names(job_name: str) -> dict[str, str]:
    """Names of the objects made for a job (workloads and their Services share the role name)."""
    return {
        c.ROLE_TRAINER: f"{job_name}-{c.ROLE_TRAINER}",
        c.ROLE_INFERENCE: f"{job_name}-{c.ROLE_INFERENCE}",
        # spec.environment.server's StatefulSet, headless Service and PodDisruptionBudget.
        c.ROLE_ENVIRONMENT: f"{job_name}-{c.ENVIRONMENT_WORKLOAD_SUFFIX}",
        "token": f"{job_name}{c.TOKEN_SECRET_SUFFIX}",
        "networkPolicy": job_name,
        # Its NetworkPolicy: with a dot, which a NetworkPolicy's name (a DNS subdomain) may hold and a job's (an RFC
        # 1035 label) may not, so that it is never the NetworkPolicy of a job named `<job>-env`.
        "environmentNetworkPolicy": f"{job_name}.{c.ENVIRONMENT_WORKLOAD_SUFFIX}",
    }


def pool_child_names(pool_name: str) -> dict[str, str]:
    """Names of the objects made for a RolloutPool: its servers' StatefulSet and Service, the Secret holding its
    attachment list, its NetworkPolicy. `-pool` keeps them apart from a job of the same name."""
    return {
        c.ROLE_INFERENCE: f"{pool_name}-pool",
        "jobs": f"{pool_name}{c.POOL_JOBS_SECRET_SUFFIX}",
        "networkPolicy": f"{pool_name}-pool",
    }


class PoolMismatch(FieldErrors):
    """The job cannot run on the pool it names (grpolora.api.pool.fit_errors), or the pool is not the one named."""


@dataclass(frozen=True)
class PoolPlan:
    """The plan of one RolloutPool: its servers (role inference) and where jobs reach them."""

    name: str
    namespace: str
    inference: RolePlan
    endpoints: tuple[str, ...]
    ports: tuple[int, ...]
    """The port each replica listens on (the same one in a cluster; port + i on the loopback network)."""
    jobs_secret: str
    model: str
    pool: RolloutPool = field(repr=False)

    def env_for(self, index: int, *, jobs_file: str) -> dict[str, str]:
        """Concrete environment of one pool server; `jobs_file` is where its attachment list is (the Secret's mount
        in a cluster, a file of the run folder locally)."""
        values = {var.name: str(index) if var.replica_index else var.value or "" for var in self.inference.env}
        values[env.POOL_JOBS_FILE] = jobs_file
        values[env.HTTP_PORT] = str(self.ports[index])
        return values

    def replicas(self, generation: int) -> PoolReplicas:
        """The pool's replicas now, as its servers read them beside the attachment list and pass them on to the
        jobs' trainers (which find a replica a scale-up added, and leave one a scale-down removed), stamped with
        the pool's generation (the newest list wins where servers differ)."""
        return PoolReplicas(generation=generation, endpoints=self.endpoints)


def _endpoints(network: Network, workload: str, namespace: str, port: int, count: int) -> tuple[str, ...]:
    return tuple(
        f"http://{network.host(workload, namespace, i)}:{network.inference_port(port, i)}" for i in range(count)
    )


def _hub_token(model: ModelSpec, cluster: bool) -> tuple[EnvVar, ...]:
    """Where huggingface_hub finds spec.model.tokenFrom's token in a pod (the operator mounts it there). A local run
    uses the hub login of whoever runs it."""
    return (EnvVar(env.HUB_TOKEN_PATH, HUB_TOKEN_FILE),) if cluster and model.token_from is not None else ()


def _model_location(spec_model) -> str:
    return f"{MODEL_MOUNT}/{spec_model.name.lstrip('/')}" if spec_model.source else spec_model.name


POOL_JOBS_MOUNT = c.POOL_JOBS_MOUNT


def plan_pool(pool: RolloutPool, network: Network | None = None) -> PoolPlan:
    """The plan of a RolloutPool's servers."""
    network = network or ClusterNetwork()
    spec, name, namespace = pool.spec, pool.name, pool.namespace
    names = pool_child_names(name)
    workload = names[c.ROLE_INFERENCE]
    endpoints = _endpoints(network, workload, namespace, spec.port, spec.replicas)
    ports = tuple(network.inference_port(spec.port, i) for i in range(spec.replicas))
    model = _model_location(spec.model)
    # Nothing here depends on spec.replicas: a scale patches the StatefulSet's replicas and must replace no pod.
    served = {key: value for key, value in spec.to_wire().items() if key not in c.POOL_MUTABLE_SPEC_FIELDS}
    variables = (
        EnvVar(env.ROLE, c.ROLE_INFERENCE),
        EnvVar(env.POOL_NAME, name),
        EnvVar(env.NAMESPACE, namespace),
        EnvVar(env.POOL_SPEC, json.dumps(served, separators=(",", ":"), sort_keys=True)),
        EnvVar(env.MODEL, model),
        EnvVar(env.REPLICA_INDEX, replica_index=True),
        EnvVar(env.BIND_ADDR, network.bind_addr),
        # Replica 0's port: the same for every replica in a cluster (env_for gives each its own locally).
        EnvVar(env.HTTP_PORT, str(network.inference_port(spec.port, 0))),
        EnvVar(env.SYNC_BACKEND, "nccl" if spec.gpus_per_replica else "gloo"),
        EnvVar(env.POOL_JOBS_FILE, f"{POOL_JOBS_MOUNT}/{JOBS_FILE_KEY}"),
        *_hub_token(spec.model, isinstance(network, ClusterNetwork)),
    )
    role = RolePlan(
        role=c.ROLE_INFERENCE,
        replicas=spec.replicas,
        procs_per_replica=1,
        workload_name=workload,
        service_name=workload,
        hosts=tuple(network.host(workload, namespace, i) for i in range(spec.replicas)),
        ports={"http": spec.port},
        env=variables,
        user_env=tuple(spec.env),
        placement=_placement(spec),
    )
    return PoolPlan(
        name=name,
        namespace=namespace,
        inference=role,
        endpoints=endpoints,
        ports=ports,
        jobs_secret=names["jobs"],
        model=model,
        pool=pool,
    )


def plan(
    job: GRPOLoraJob,
    network: Network | None = None,
    *,
    pool: RolloutPool | None = None,
    checkpoint_dir: str | None = None,
    output_dir: str | None = None,
) -> JobPlan:
    """The plan of one job. A job with inference.poolRef needs that `pool` (PoolMismatch if it does not fit it);
    its trainer then runs with the job's spec bound to the pool (grpolora.api.pool.bind). `checkpoint_dir` and
    `output_dir` are for local runs (`grpolora run` keeps them in its run folder); in a cluster checkpoints go to
    spec.checkpoint.path and outputs to spec.output.path, or next to the checkpoints."""
    network = network or ClusterNetwork()
    cluster = isinstance(network, ClusterNetwork)
    output_dir = output_dir or (job.spec.output.folder if job.spec.output else None)
    checkpoint_dir = checkpoint_dir or job.spec.checkpoint.path
    spec, name, namespace = job.spec, job.name, job.namespace
    names = child_names(name)
    pool_plan = None
    if spec.inference.pool_ref is not None:
        pool_plan = _pool_of(job, pool, network)
        spec = bind(spec, pool_plan.pool.spec)

    trainer_hosts = tuple(network.host(names[c.ROLE_TRAINER], namespace, i) for i in range(spec.trainer.replicas))
    if pool_plan is None:
        workload, count = names[c.ROLE_INFERENCE], spec.inference.replicas
        inference_hosts = tuple(network.host(workload, namespace, i) for i in range(count))
        endpoints = _endpoints(network, workload, namespace, spec.inference.port, count)
    else:
        endpoints = pool_plan.endpoints
    procs = max(spec.trainer.gpus_per_replica, 1)
    sync = SyncPlan(
        addr=trainer_hosts[0],
        port=spec.sync.port,
        world_size=sync_world_size(spec.inference.replicas),
        backend=spec.sync_backend,
        epoch=0,
        timeout_seconds=spec.sync.timeout_seconds,
        bucket_bytes=spec.sync.bucket_mib * 1024 * 1024,
    )
    model = _model_location(spec.model)
    common = (
        EnvVar(env.JOB_NAME, name),
        EnvVar(env.NAMESPACE, namespace),
        EnvVar(env.SPEC, json.dumps(spec.to_wire(), separators=(",", ":"), sort_keys=True)),
        EnvVar(env.MODEL, model),
        EnvVar(env.REPLICA_INDEX, replica_index=True),
        EnvVar(env.TOKEN, secret=(names["token"], c.TOKEN_SECRET_KEY), secret_file=env.TOKEN_FILE),
        *_hub_token(spec.model, cluster),
        EnvVar(env.BIND_ADDR, network.bind_addr),
        EnvVar(env.MASTER_ADDR, trainer_hosts[0]),
        EnvVar(env.MASTER_PORT, str(spec.trainer.master_port)),
        EnvVar(env.WORLD_SIZE, str(spec.trainer.replicas * procs)),
        EnvVar(env.NODE_RANK, replica_index=True),
        EnvVar(env.LOCAL_WORLD_SIZE, str(procs)),
        EnvVar(env.SYNC_ADDR, sync.addr),
        EnvVar(env.SYNC_PORT, str(sync.port)),
        EnvVar(env.SYNC_WORLD_SIZE, str(sync.world_size)),
        EnvVar(env.SYNC_BACKEND, sync.backend),
        EnvVar(env.SYNC_EPOCH, str(sync.epoch)),
        EnvVar(env.SYNC_TIMEOUT_SECONDS, str(sync.timeout_seconds)),
        EnvVar(env.INFERENCE_ENDPOINTS, ",".join(endpoints)),
        EnvVar(env.STATUS_PORT, str(spec.trainer.status_port)),
        EnvVar(env.CHECKPOINT_DIR, checkpoint_dir),
        *((EnvVar(env.OUTPUT_DIR, output_dir),) if output_dir else ()),
    )
    # In a cluster the dataset volume and the Secrets are mounted, in trainer pods only (the servers read neither);
    # a local run reads the user's own paths. The chat template's key is mounted in both: the trainer renders
    # prompts and episodes with it, a job's own servers its chat sessions (workers/inference/sessions.py).
    server = spec.environment_server
    environment_endpoints: tuple[str, ...] = ()
    if server is not None and cluster:
        # Locally `grpolora run` starts the servers on free ports and gives the trainer their URLs itself
        # (workers/launcher/environment_servers.py): port + i could be an inference replica's.
        environment_endpoints = _endpoints(
            network, names[c.ROLE_ENVIRONMENT], namespace, server.port, server.replicas
        )
    trainer_only = (
        *((EnvVar(env.DATA_DIR, DATASET_MOUNT),) if cluster and spec.task.dataset and spec.task.dataset.pvc else ()),
        *((EnvVar(env.SECRETS_DIR, SECRETS_MOUNT),) if cluster and trainer_secrets(spec) else ()),
        # One URL per server pod: the trainer pins each episode to one (its reset, steps and close reach the server
        # that holds it), which a load-balancing Service would not.
        *((EnvVar(env.ENVIRONMENT_URL, ",".join(environment_endpoints)),) if environment_endpoints else ()),
    )
    if cluster and spec.task.chat_template_from:
        common += (EnvVar(env.CHAT_TEMPLATE_FILE, f"{CHAT_TEMPLATE_MOUNT}/{CHAT_TEMPLATE_NAME}"),)

    def role_plan(role: Role, role_spec: RoleSpec, role_hosts: tuple[str, ...], ports: dict[str, int]) -> RolePlan:
        return RolePlan(
            role=role,
            replicas=role_spec.replicas,
            procs_per_replica=procs if role == c.ROLE_TRAINER else 1,
            workload_name=names[role],
            service_name=names[role],
            hosts=role_hosts,
            ports=ports,
            env=(EnvVar(env.ROLE, role), *common, *(trainer_only if role == c.ROLE_TRAINER else ())),
            user_env=tuple(role_spec.env),
            placement=_placement(role_spec),
        )

    trainer_ports = {"master": spec.trainer.master_port, "sync": spec.sync.port, "http": spec.trainer.status_port}
    return JobPlan(
        name=name,
        namespace=namespace,
        trainer=role_plan(c.ROLE_TRAINER, spec.trainer, trainer_hosts, trainer_ports),
        inference=None
        if pool_plan
        else role_plan(c.ROLE_INFERENCE, spec.inference, inference_hosts, {"http": spec.inference.port}),
        master_addr=trainer_hosts[0],
        master_port=spec.trainer.master_port,
        trainer_world_size=spec.trainer.replicas * procs,
        sync=sync,
        inference_endpoints=endpoints,
        token_secret=names["token"],
        model=model,
        checkpoint_dir=checkpoint_dir,
        job=job,
        spec=spec,
        pool=pool_plan.name if pool_plan else None,
        environment=None
        if server is None
        else _environment_role(network, names[c.ROLE_ENVIRONMENT], namespace, server, names["token"]),
        environment_endpoints=environment_endpoints,
    )


SERVICE_MODULE = "grpolora.workers.environments.service"
"""The project's environment service (`python -m ...`), which serves a built-in or plugin environment."""


def _environment_role(
    network: Network, workload: str, namespace: str, server: EnvironmentServerSpec, token_secret: str
) -> RolePlan:
    """spec.environment.server's role: its pods get the environment token (grpolora.api.pool.environment_token,
    derived from the job's: a file of the token Secret's environment key in a cluster, the value locally), which every
    call to them carries as a bearer token, and their port, and nothing else of the contract: they see no spec, no
    model, no rendezvous, not the job's token (a sandbox knows as little of the job as it can)."""
    return RolePlan(
        role=c.ROLE_ENVIRONMENT,
        replicas=server.replicas,
        procs_per_replica=1,
        workload_name=workload,
        service_name=workload,
        hosts=tuple(network.host(workload, namespace, i) for i in range(server.replicas)),
        ports={"http": server.port},
        env=(
            EnvVar(
                env.ENVIRONMENT_TOKEN,
                secret=(token_secret, c.ENVIRONMENT_TOKEN_SECRET_KEY),
                secret_file=env.ENVIRONMENT_TOKEN_FILE,
            ),
            # A server's own command reads it, or names it as $(GRPOLORA_ENVIRONMENT_PORT) (Kubernetes expands it).
            EnvVar(env.ENVIRONMENT_PORT, str(server.port)),
        ),
        user_env=tuple(server.env),
        placement=Placement(
            image=server.image or _worker_defaults.image_cpu,
            image_pull_policy=server.image_pull_policy,
            image_pull_secrets=_worker_defaults.image_pull_secrets,
            gpus=0,
            gpu_resource=c.DEFAULT_GPU_RESOURCE,
            resources=server.resources,
            node_selector=server.node_selector,
            tolerations=tuple(server.tolerations),
            affinity={},
        ),
    )


def environment_server_command(
    environment: EnvironmentSpec,
    *,
    port: int | str,
    token_file: str | None,
    host: str | None = None,
    python: str = "python",
) -> tuple[list[str], list[str]]:
    """(command, args) of an environment server: the server's own `command` and `args`, or with none the project's
    service of the job's `builtin` or `plugin` on `host` (None: the service's default, every address) and `port`,
    reading the environment token from `token_file` (None: from GRPOLORA_ENVIRONMENT_TOKEN, as a local run passes it),
    then the server's `args`. The operator's pods and `grpolora run` (workers/launcher/environment_servers.py) start
    the same one (`python`: the interpreter, `python` on the worker image's PATH)."""
    server = environment.server
    assert server is not None, "spec.environment.server is not set"
    if server.command is not None:
        return list(server.command), list(server.args)
    served = environment.builtin or environment.plugin
    assert served is not None, "a server with no command serves a builtin or plugin (spec validation)"
    args = ["--environment", served, *(("--host", host) if host is not None else ()), "--port", str(port)]
    if token_file is not None:
        args += ["--token-file", token_file]
    return [python, "-m", SERVICE_MODULE], [*args, *server.args]


def _pool_of(job: GRPOLoraJob, pool: RolloutPool | None, network: Network) -> PoolPlan:
    ref = job.spec.inference.pool_ref
    assert ref is not None
    if pool is None or pool.name != ref.name or pool.namespace != job.namespace:
        given = f"{pool.namespace}/{pool.name}" if pool else "none"
        raise PoolMismatch(
            [("inference.poolRef.name", f"names RolloutPool {job.namespace}/{ref.name}, but the pool given is {given}")]
        )
    errors = fit_errors(pool.name, pool.spec, job.spec)
    if errors:
        raise PoolMismatch(errors)
    return plan_pool(pool, network)


@dataclass(frozen=True)
class WorkerDefaults:
    """What a role gets where its spec says nothing: set cluster-wide by the operator's flags (the chart's `workers`
    values); otherwise the project's published images, and no pull secrets."""

    image_gpu: str = c.DEFAULT_WORKER_IMAGE_GPU
    """The image of a role with gpusPerReplica > 0 and no spec image."""
    image_cpu: str = c.DEFAULT_WORKER_IMAGE_CPU
    """The image of a role without GPUs and no spec image."""
    image_pull_secrets: tuple[str, ...] = ()
    """Secrets every worker pod pulls its images with (a job's podTemplate may add its own, merged by name)."""


_worker_defaults = WorkerDefaults()


def set_worker_defaults(defaults: WorkerDefaults) -> None:
    """Set the cluster-wide defaults, once, as the operator starts (grpolora.operator.main): every plan the process
    makes from then on uses them. One setting per process keeps plan()'s callers unaware of it."""
    global _worker_defaults
    _worker_defaults = defaults


def worker_defaults() -> WorkerDefaults:
    return _worker_defaults


def _placement(role_spec: RoleSpec) -> Placement:
    gpus = role_spec.gpus_per_replica
    defaults = _worker_defaults
    return Placement(
        image=role_spec.image or (defaults.image_gpu if gpus else defaults.image_cpu),
        image_pull_policy=role_spec.image_pull_policy,
        image_pull_secrets=defaults.image_pull_secrets,
        gpus=gpus,
        gpu_resource=role_spec.gpu_resource,
        resources=role_spec.resources,
        node_selector=role_spec.node_selector,
        tolerations=tuple(role_spec.tolerations),
        affinity=role_spec.affinity,
    )
