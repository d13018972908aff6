"""Status contracts: what trainer rank 0 reports at `/status`, and what the operator writes to the CR status.

Both are torch-free and shared: the trainer builds `TrainerStatus`, the operator parses it and folds it into
`JobStatus`, and the CRD's status schema is generated from `JobStatus` (so nothing the operator writes is pruned).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

TrainerPhase = Literal["Starting", "Running", "Succeeded", "Failed"]
JobPhase = Literal["Pending", "Running", "Succeeded", "Failed", "Suspended"]
ConditionStatus = Literal["True", "False", "Unknown"]


class _Wire(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, use_attribute_docstrings=True, extra="ignore"
    )

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json", exclude_none=True)


class TrainerStatus(_Wire):
    """JSON served by trainer rank 0 at GET /status (documented in docs/status.md)."""

    phase: TrainerPhase
    """Starting (loading, forming groups), Running, Succeeded (all steps done) or Failed."""
    step: int = 0
    """Optimizer steps completed."""
    total_steps: int
    """spec.grpo.steps."""
    sync_round: int = 0
    """Adapter version the inference replicas serve; grows by one per sync, never goes back."""
    epoch: int = 0
    """Sync-group epoch: grows each time the group re-forms (a replica lost or added)."""
    sync_members: list[int] = Field(default_factory=list)
    """Indices of the inference replicas in the current sync group."""
    last_sync_seconds: float | None = None
    """Wall time of the last sync round (pack, broadcast, verify)."""
    last_sync_bytes: int | None = None
    """Bytes broadcast in the last sync round."""
    last_sync_time: str | None = None
    """RFC 3339 time the last sync round finished."""
    reward_mean: float | None = None
    """Mean reward of the last step's completions."""
    reward_std: float | None = None
    """Standard deviation of the last step's rewards."""
    kl: float | None = None
    """Mean k3 KL estimate to the reference policy over the last step's completion tokens."""
    mismatch: float | None = None
    """Mean exp(|logprob_vllm - logprob_trainer|) - 1 over the last on-policy step's tokens (0 means exact
    agreement); off-policy steps measure the policy's drift instead and leave it as it was."""
    gen_kl: float | None = None
    """k3 estimate of KL(vLLM sampler || trainer policy) over the last step's tokens."""
    entropy: float | None = None
    """The policy's mean token entropy (nats) over the last step's completion tokens, before its update."""
    prompts_skipped: int = 0
    """Prompts skipped since the trainer started because they do not fit the model length with
    grpo.maxNewTokens."""
    # ---- bounded staleness (grpo.maxStaleness) ----
    staleness: int | None = None
    """Versions the oldest group of the last step lagged the trainer's latest synced adapter (at most
    grpo.maxStaleness)."""
    dropped_stale: int = 0
    """Groups (a prompt and its completions) dropped since the trainer started because they were generated more
    than grpo.maxStaleness versions before the trainer's."""
    importance_weight_mean: float | None = None
    """Mean behaviour importance weight pi_trainer / pi_vLLM over the last step's off-policy tokens (0 when the
    step was on-policy)."""
    importance_weight_max: float | None = None
    """Largest behaviour importance weight of the last step, before truncation at grpo.importanceWeightCap."""
    truncated_fraction: float | None = None
    """Share of the last step's off-policy tokens whose importance weight was truncated."""
    eval_reward: float | None = None
    """Mean reward of the last evaluation on the held-out prompts (spec.eval)."""
    eval_step: int | None = None
    """Step after which that evaluation ran."""
    adapter_path: str | None = None
    """Where the final adapter was written (in the trainer pod: on the output volume, or lost with the pod)."""
    last_push: str | None = None
    """Where the newest pushed adapter went (spec.output.push: an S3 prefix, or the Hub commit's URL)."""
    last_push_step: int | None = None
    """The step of that adapter."""
    push_error: str | None = None
    """Why the last push failed (it names the spec field); cleared by the next push that succeeds."""
    message: str | None = None
    """Human-readable detail, e.g. why the run failed."""
    inference_restarts: int | None = None
    """`grpolora run` only, in status.json: inference replicas it started again after they exited."""


class Condition(_Wire):
    """A metav1.Condition."""

    type: str
    """Condition type, e.g. Created, RendezvousReady, Progressing, Succeeded, Failed, Suspended, InvalidSpec."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: str
    """CamelCase reason for the last transition."""
    message: str = ""
    """Human-readable detail."""
    last_transition_time: str
    """When the status last changed (RFC 3339)."""
    observed_generation: int | None = None
    """metadata.generation the condition was computed from."""


class RoleReplicas(_Wire):
    desired: int = 0
    """Pods this role should have."""
    ready: int = 0
    """Pods of this role that are ready."""


class RestartCounts(_Wire):
    failure: int = 0
    """Restarts after the trainer failed (counted against spec.trainer.maxRestarts)."""
    disruption: int = 0
    """Restarts after a pod was disrupted (drain, preemption, spot reclaim: its DisruptionTarget condition); not
    counted against spec.trainer.maxRestarts."""


class FailedAttempt(_Wire):
    """A trainer attempt that failed, as its pod told it before the restart (or the job's end) deleted the pod and
    its log with it (grpolora.operator.attempts)."""

    attempt: int
    """Which run of the trainer group it was: 1 for the first, 2 after one restart, and so on."""
    pod: str
    """The trainer pod whose failure is kept: the first to fail with an exit code of its own (not one its peers'
    failure caused, such as SIGTERM or SIGKILL)."""
    exit_code: int | None = None
    """That pod's trainer container exit code."""
    reason: str | None = None
    """The container's termination reason (Error, OOMKilled, ...)."""
    finished_at: str | None = None
    """When the container exited."""
    log_tail: str = ""
    """The last lines of its log (at most 50 lines and 4 KiB); empty when the log could not be read."""


class ReplicaCounts(_Wire):
    trainer: RoleReplicas = Field(default_factory=RoleReplicas)
    """Trainer pods."""
    inference: RoleReplicas = Field(default_factory=RoleReplicas)
    """Inference pods."""
    environment: RoleReplicas | None = None
    """The environment server's pods (spec.environment.server only): ready once they answer GET /health."""


class RendezvousStatus(_Wire):
    master_addr: str
    """MASTER_ADDR of the trainer ranks (trainer rank 0's DNS name)."""
    master_port: int
    """MASTER_PORT of the trainer ranks."""
    trainer_world_size: int
    """WORLD_SIZE of the trainer ranks."""
    sync_addr: str
    """Address of the sync group's store (trainer rank 0)."""
    sync_port: int
    """Port of the sync group's store."""
    sync_world_size: int
    """Sync group size at full membership: trainer rank 0 plus one rank per inference replica."""
    sync_backend: Literal["nccl", "gloo"]
    """Collective used for adapter sync."""
    epoch: int = 0
    """Current sync-group epoch (from the trainer)."""
    inference_endpoints: list[str] = Field(default_factory=list)
    """HTTP endpoints of the inference replicas."""


class JobStatus(_Wire):
    """status of a GRPOLoraJob, written by the operator."""

    phase: JobPhase | None = None
    """Pending, Running, Succeeded, Failed or Suspended."""
    message: str | None = None
    """Why the job is in its phase."""
    reason: str | None = None
    """Why the job waits, or what it does, in one CamelCase word: the reason of the condition the message comes from
    (e.g. Unschedulable, ImagePullBackOff, Queued, WaitingForTrainer, Training, StartupDeadlineExceeded); for
    `kubectl get glj`."""
    progress: str | None = None
    """`step/totalSteps`, for `kubectl get glj`."""
    ready: str | None = None
    """`ready/desired` pods of the job, trainer ranks and inference replicas together (on a pool, the pool's servers
    that serve it), for `kubectl get glj`; replicas has them per role."""
    observed_generation: int | None = None
    """metadata.generation last reconciled."""
    # Bounded so that the CRD's CEL rule that reads it (the Created condition) has a bounded cost at admission.
    conditions: list[Condition] = Field(default_factory=list, max_length=32)
    """Conditions in metav1.Condition shape; the whole list is written each time."""
    step: int | None = None
    """Optimizer steps completed (from trainer rank 0)."""
    steps_lost: int | None = None
    """Steps trained and then lost to trainer restarts: those after the last checkpoint, or all of them without a
    checkpoint PVC (the step above is the one the restarted trainer actually reached)."""
    total_steps: int | None = None
    """spec.grpo.steps."""
    sync_round: int | None = None
    """Adapter version served by the inference replicas; never decreases."""
    last_sync_time: str | None = None
    """When the last sync round finished."""
    last_sync_seconds: float | None = None
    """Duration of the last sync round."""
    last_sync_bytes: int | None = None
    """Bytes sent in the last sync round."""
    reward_mean: float | None = None
    """Mean reward of the last step."""
    kl: float | None = None
    """KL to the reference policy at the last step."""
    eval_reward: float | None = None
    """Mean reward of the last evaluation on the held-out prompts (spec.eval)."""
    adapter_path: str | None = None
    """Where the trainer wrote the final adapter (a path on the output volume)."""
    last_push: str | None = None
    """Where the newest pushed adapter went (spec.output.push: an S3 prefix, or the Hub commit's URL)."""
    last_push_step: int | None = None
    """The step of that adapter."""
    push_error: str | None = None
    """Why the trainer's last push failed (it names the spec field); pushes never stop training."""
    staleness: int | None = None
    """Versions the oldest group of the last step lagged the trainer's adapter (at most grpo.maxStaleness)."""
    dropped_stale: int | None = None
    """Groups dropped (since the trainer last started) as more than grpo.maxStaleness versions behind."""
    prompts_skipped: int | None = None
    """Prompts the trainer skipped because they do not fit the model length (since it last started)."""
    mismatch: float | None = None
    """Trainer-vs-vLLM logprob mismatch at the last on-policy step."""
    replicas: ReplicaCounts | None = None
    """Ready and desired pods per role."""
    rendezvous: RendezvousStatus | None = None
    """Where the trainer ranks and the sync group meet."""
    trainer_restarts: int | None = None
    """Times the trainer group was restarted, for any cause (see restartsByCause)."""
    restarts_by_cause: RestartCounts | None = None
    """Trainer restarts by cause: failures (limited by spec.trainer.maxRestarts) and disruptions (not limited)."""
    trainer_incarnation: int | None = None
    """The incarnation of the newest trainer Job created for the job: 0 for the first, one more for each after it
    (a restart, a resume, a re-admission by Kueue, a re-attachment to its pool); none until one is created. Its pods
    get it as GRPOLORA_TRAINER_INCARNATION: the inference replicas refuse a trainer older than the newest they saw."""
    start_time: str | None = None
    """When the job's children were first created."""
    completion_time: str | None = None
    """When the job succeeded or failed."""
    active_since: str | None = None
    """When the job last became active (its pods wanted: created, resumed, admitted by Kueue, attached to its pool);
    none while it is not. spec.activeDeadlineSeconds counts from here."""
    pool: str | None = None
    """The RolloutPool whose servers run the rollouts (spec.inference.poolRef); see its status for the adapter
    version each replica serves and the job's place in line."""
    last_failed_attempt: FailedAttempt | None = None
    """The last trainer attempt that failed: its pod, exit code and the tail of its log, read before the restart
    deleted the pod (`kubectl logs` cannot show it then). Also sent as a TrainerAttemptFailed event."""
    token_digest: str | None = None
    """Fingerprint of the token the job's pods were created with (grpolora.api.pool.token_fingerprint). A token
    Secret that no longer matches it (deleted, so re-made with a new token) re-keys the job as a whole: every pod is
    replaced, and its pool attachment renewed, before training goes on."""


# ---- RolloutPool ----------------------------------------------------------------------------------------------


class ReplicaAdapter(_Wire):
    replica: int
    """Index of the pool replica."""
    live_version: int
    """Adapter version of the job that replica serves new rollouts with."""


class AttachedJob(_Wire):
    job: str
    """<namespace>/<name> of the GRPOLoraJob."""
    uid: str = ""
    """Its metadata.uid (a re-created job of the same name is another job)."""
    token_digest: str = ""
    """Fingerprint of the token the pool's attachment holds for it (the job's status.tokenDigest once renewed)."""
    adapter_versions: list[ReplicaAdapter] = Field(default_factory=list, max_length=1024)
    """The adapter version each replica serves, as the replicas report it (GET /v1/adapter); a replica that did
    not answer is left out."""


class PoolStatus(_Wire):
    """status of a RolloutPool, written by the operator (its only writer: it decides which jobs attach)."""

    message: str | None = None
    """What the pool is doing or waiting for."""
    observed_generation: int | None = None
    """metadata.generation last reconciled."""
    conditions: list[Condition] = Field(default_factory=list, max_length=32)
    """Conditions in metav1.Condition shape; the whole list is written each time."""
    replicas: RoleReplicas | None = None
    """Ready and desired server pods."""
    selector: str | None = None
    """The server pods' label selector as a string (`k=v,...`): the scale subresource's labelSelectorPath, which a
    HorizontalPodAutoscaler reads to find the pods whose metrics it averages."""
    attached_jobs: list[AttachedJob] = Field(default_factory=list)
    """The jobs the servers serve (the pool's attachment list), in the order they attached."""
    waiting_jobs: list[str] = Field(default_factory=list)
    """Jobs (<namespace>/<name>) that fit but wait for a free place, first in line first."""
    jobs: str | None = None
    """`attached/maxJobs`, for `kubectl get rpool`."""
    waiting: int | None = None
    """How many jobs wait (the length of waitingJobs)."""
    slots_in_use: int | None = None
    """LoRA slots reserved by the attached jobs (adaptersPerJob each)."""
    slots: int | None = None
    """LoRA slots of each engine (maxJobs x adaptersPerJob)."""
    tokens_per_second: float | None = None
    """Completion tokens per second over all replicas and jobs, as the replicas report it."""
