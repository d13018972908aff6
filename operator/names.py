"""Names the operator writes where users and tools read them: condition types and reasons, event reasons,
annotations. One module, so that docs/operator.md, the tests and `kubectl wait --for=condition=...` agree.
"""

from __future__ import annotations

from typing import Final

from grpolora.api import constants as c

# ---- annotations ------------------------------------------------------------------------------------------
# The spec the children were built from (JSON). Kept on the job so that an operator restart still knows it and
# can refuse changes that cannot apply to a running job.
APPLIED_SPEC_ANNOTATION: Final = f"{c.GROUP}/applied-spec"
# The runtime a job on one (spec.runtimeRef) was resolved on (JSON: kind, name, generation, resourceVersion and its
# spec), written with the applied spec: re-reconciles merge the job with this one, so an edit of the runtime never
# changes a running job (docs/design.md).
RUNTIME_ANNOTATION: Final = f"{c.GROUP}/runtime"
# On the trainer Job: which restart attempt created it (absent = 0). A Job whose attempt is older than
# status.trainerRestarts is stale and is replaced; the idea comes from JobSet's restart-attempt label.
RESTART_ATTEMPT_ANNOTATION: Final = f"{c.GROUP}/restart-attempt"
# On the trainer Job and its pod template: its incarnation (status.trainerIncarnation; absent = 0, the first). Every
# new trainer Job gets the next one, whatever replaced the last (a restart, suspend and resume, a Kueue eviction, a
# pool detach), so that a cut-off rank of any earlier trainer is fenced; its pods read it through the downward API
# as GRPOLORA_TRAINER_INCARNATION.
INCARNATION_ANNOTATION: Final = f"{c.GROUP}/trainer-incarnation"
# Kopf's own bookkeeping (last handled spec, handler progress) lives under this prefix.
KOPF_PREFIX: Final = c.GROUP

# ---- condition types (status.conditions[].type), in the order they are written ----------------------------
CREATED: Final = c.CONDITION_CREATED
PODS_READY: Final = "PodsReady"
RENDEZVOUS_READY: Final = "RendezvousReady"
PROGRESSING: Final = "Progressing"
# Complete, Failed, Suspended: the batch/v1 Job's and Kubeflow Trainer's types (Created is Kubeflow Trainer's too).
SUCCEEDED: Final = "Complete"
FAILED: Final = "Failed"
SUSPENDED: Final = "Suspended"
INVALID_SPEC: Final = "InvalidSpec"
SPEC_CHANGE_REFUSED: Final = "SpecChangeRefused"
VOLUMES_SHAREABLE: Final = "VolumesShareable"
# Kueue's admission of the job's Workload (Kueue's own type name); True without a queue.
ADMITTED: Final = "Admitted"
# A job on a RolloutPool (spec.inference.poolRef): whether the pool serves it. Written only on such jobs.
POOL_ATTACHED: Final = "PoolAttached"
# A role's pods would run BestEffort (no cpu or memory requests; grpolora.api.load.best_effort_roles): written only
# then, True, as `grpolora validate` warns.
PODS_BEST_EFFORT: Final = "PodsBestEffort"
# A job on a runtime (spec.runtimeRef): whether it was resolved on it. Written only on such jobs.
RUNTIME_RESOLVED: Final = "RuntimeResolved"
CONDITION_TYPES: Final = (
    CREATED,
    PODS_READY,
    RENDEZVOUS_READY,
    PROGRESSING,
    SUCCEEDED,
    FAILED,
    SUSPENDED,
    INVALID_SPEC,
    SPEC_CHANGE_REFUSED,
    VOLUMES_SHAREABLE,
    ADMITTED,
    POOL_ATTACHED,
    PODS_BEST_EFFORT,
    RUNTIME_RESOLVED,
)
# A RolloutPool's own conditions: Ready (every server replica ready) and InvalidSpec.
READY: Final = "Ready"

# ---- reasons (conditions and events) -----------------------------------------------------------------------
R_CHILDREN_CREATED: Final = "ChildrenCreated"
R_NOT_CREATED: Final = "NotCreated"
R_ALL_READY: Final = "AllReady"
R_WAITING_FOR_PODS: Final = "WaitingForPods"
R_NO_WORKLOADS: Final = "NoWorkloads"
R_GROUP_FORMED: Final = "SyncGroupFormed"
R_FORMING: Final = "Forming"
R_WAITING_FOR_TRAINER: Final = "WaitingForTrainer"
R_TRAINING: Final = "Training"
R_TRAINER_RESTARTING: Final = "TrainerRestarting"
# The token Secret was re-made (deleted by hand) with a new token: every pod is replaced together (see
# GRPOLoraJob status.tokenDigest).
R_REKEYING: Final = "Rekeying"
R_PENDING: Final = "Pending"
R_FINISHED: Final = "Finished"
R_COMPLETED: Final = "TrainingComplete"
R_IN_PROGRESS: Final = "InProgress"
R_TRAINER_FAILED: Final = "TrainerFailed"
R_BACKOFF_LIMIT: Final = "BackoffLimitExceeded"
# Kueue (the Admitted condition): no queue label; waiting in the queue; admitted; evicted (preemption, ...).
R_NO_QUEUE: Final = "NoQueue"
R_QUEUED: Final = "Queued"
R_ADMITTED: Final = "Admitted"
R_EVICTED: Final = "Evicted"
# Kueue (or a person) deactivated the Workload (spec.active false): it is not admitted again until reactivated.
R_DEACTIVATED: Final = "Deactivated"
# The job has the queue label but Kueue's Workload API is not served (Kueue not installed yet): it waits.
R_KUEUE_NOT_INSTALLED: Final = "KueueNotInstalled"
# The trainer Job is suspended by someone else (spec.suspend true; the operator never suspends it), e.g. Kueue's Job
# webhook under manageJobsWithoutQueueName when GRPOLoraJob is not in its integrations.externalFrameworks (PodsReady).
R_TRAINER_JOB_SUSPENDED: Final = "TrainerJobSuspended"
# Kueue's admission (a ResourceFlavor's nodeLabels, an admission check's update) contradicts the pod template, e.g. a
# nodeSelector key set to another value: Failed, and the Workload Finished with this reason (Kueue's own word).
R_FAILED_TO_START: Final = "FailedToStart"
# Pods not all ready spec.scheduling.startupDeadlineSeconds after they were created (PodsReady; Failed with Fail).
R_STARTUP_DEADLINE: Final = "StartupDeadlineExceeded"
R_NO_RESOURCE_REQUESTS: Final = "NoResourceRequests"
R_DEADLINE_EXCEEDED: Final = "DeadlineExceeded"  # spec.activeDeadlineSeconds; the Job controller's reason
# The trainer exited with a "bad spec or data" code (grpolora.api.contract.TRAINER_INPUT_EXIT_CODES): restarting
# cannot help. The name is the batch/v1 Job's own reason for a podFailurePolicy FailJob.
R_POD_FAILURE_POLICY: Final = "PodFailurePolicy"
R_NO_FAILURE: Final = "NoFailure"
R_SUSPENDED: Final = "Suspended"
R_NOT_SUSPENDED: Final = "NotSuspended"
R_INVALID: Final = "InvalidSpec"
R_VALID: Final = "Valid"
R_REFUSED: Final = "SpecChangeRefused"
R_UNCHANGED: Final = "SpecUnchanged"
# The API server refused to create a child (422 invalid, 403 forbidden by RBAC or admission, 400): the job fails
# with the API's message until its spec changes; transient API failures (5xx, 429, unreachable) are retried.
R_CREATE_REFUSED: Final = "CreateRefused"
R_API_RETRYING: Final = "APIRetrying"
# A Secret the job names carries the operator's managed-by label (another job's token, a pool's attachment list):
# the job fails before its pods are created (the namespace's jobs trust each other, but not with these).
R_MANAGED_SECRET: Final = "ManagedSecret"
# Shared PersistentVolumeClaims (model: every pod; checkpoints: every trainer rank) and their access modes.
R_ACCESS_MODES_FIT: Final = "AccessModesFit"
R_SINGLE_NODE_ACCESS: Final = "SingleNodeAccessMode"
R_VOLUME_ACCESS_MODE: Final = "VolumeAccessMode"
# Why pods are missing or stuck, from the Warning events of the workloads and pods (FailedCreate: quota, Pod
# Security admission, a webhook; FailedAttachVolume: Multi-Attach; FailedMount).
POD_WARNING_REASONS: Final = ("FailedCreate", "FailedAttachVolume", "FailedMount")
# A child of that name still belongs to a deleted job of the same name (garbage collection takes a moment).
R_WAITING_FOR_PREVIOUS_JOB: Final = "WaitingForPreviousJob"

# RolloutPools (the PoolAttached condition of a job on one; Failed with the last three).
R_POOL_ATTACHED: Final = "Attached"
R_POOL_FULL: Final = "PoolFull"
R_WAITING_FOR_POOL: Final = "WaitingForPool"
R_POOL_NOT_FOUND: Final = "PoolNotFound"
R_POOL_INVALID: Final = "PoolInvalid"
R_POOL_MISMATCH: Final = "PoolMismatch"
R_POOL_DELETED: Final = "PoolDeleted"

# Runtimes (the RuntimeResolved condition of a job on one): resolved, or waiting Pending for it to exist or be valid.
R_RUNTIME_RESOLVED: Final = "Resolved"
R_RUNTIME_NOT_FOUND: Final = "RuntimeNotFound"
R_RUNTIME_INVALID: Final = "RuntimeInvalid"

# Event-only reasons.
E_CREATED: Final = c.CONDITION_CREATED
E_RUNNING: Final = "Running"
E_SUCCEEDED: Final = "Succeeded"
E_FAILED: Final = "Failed"
E_SUSPENDED: Final = "Suspended"
E_RESUMED: Final = "Resumed"
E_TRAINER_RESTARTING: Final = "TrainerRestarting"
E_TRAINER_ATTEMPT_FAILED: Final = "TrainerAttemptFailed"  # the failed pod's log tail (grpolora.operator.attempts)
E_TRAINER_POD_LOST: Final = "TrainerPodLost"  # a pod its node never confirms gone: a restart goes on
E_REKEYED: Final = "TokenRekeyed"
E_GROUP_REFORMED: Final = "SyncGroupReformed"
E_PODS_NOT_READY: Final = "PodsNotReady"
E_INVALID_SPEC: Final = "InvalidSpec"
E_SPEC_CHANGE_REFUSED: Final = "SpecChangeRefused"
E_VOLUMES_NOT_SHAREABLE: Final = "VolumesNotShareable"
E_ATTACHED: Final = "AttachedToPool"
# Posted on a RolloutPool (kubectl describe rpool), once per transition (pool_reconcile.pool_events).
E_POOL_JOB_ATTACHED: Final = "JobAttached"
E_POOL_JOB_DETACHED: Final = "JobDetached"
E_POOL_FULL: Final = "PoolFull"
E_POOL_REPLICA_LOST: Final = "ReplicaLost"
E_POOL_SCALED: Final = "Scaled"

# Why the trainer Job failed (status.restartsByCause counts the first two; the last fails the job at once).
CAUSE_FAILURE: Final = "failure"
CAUSE_DISRUPTION: Final = "disruption"
CAUSE_INVALID_INPUT: Final = "invalidInput"
# A trainer that stopped because the replicas fenced it off (contract.EXIT_FENCED): not a crash; a restart for it is
# counted as a disruption (restartsByCause has no field of its own for it).
CAUSE_FENCED: Final = "fenced"

# Spec fields that may change on a running job; every other change is refused.
MUTABLE_SPEC_FIELDS: Final = c.MUTABLE_SPEC_FIELDS
