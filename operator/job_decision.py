"""What a job's pass observes and what it decides (grpolora.operator.reconcile.decide): the observation, what the
decision still needs read, the decision itself. Data only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from grpolora.api.status import JobStatus, TrainerStatus
from grpolora.operator import kueue, pools
from grpolora.operator import observe as obs
from grpolora.operator.job_events import Event
from grpolora.operator.job_view import K8sObject

WORKLOAD_KINDS: Final = ("Job", "StatefulSet")


# After replacing a trainer Job, look again soon: the old one may take a moment to leave the API.
REPLACE_RECHECK_SECONDS: Final = 1.0


@dataclass(frozen=True)
class ChildRef:
    kind: str
    name: str


@dataclass(frozen=True)
class Observed:
    """What one pass read: the workloads (None = absent), the job's pods, trainer rank 0's report."""

    trainer_job: K8sObject | None = None
    inference: K8sObject | None = None
    pods: tuple[K8sObject, ...] = ()
    trainer: TrainerStatus | None = None
    trainer_error: str | None = None
    blocked: tuple[ChildRef, ...] = ()
    """Children of this job's names that still belong to a deleted job of the same name (read as absent, never
    created over, never read as this job's): the garbage collector removes them shortly."""
    warnings: tuple[obs.NotReady, ...] = ()
    """Why pods are missing or stuck, from Warning events (see observe.pod_warnings)."""
    claims: Mapping[str, tuple[str, ...] | None] = field(default_factory=dict)
    """Access modes of the PersistentVolumeClaims the job mounts (None: the claim does not exist)."""
    queue_workload: K8sObject | None = None
    """The job's Kueue Workload (jobs with the queue label only; None: not there yet)."""
    queue_api_missing: bool = False
    """Creating the Workload answered 404: the API server does not serve Kueue's Workloads (Kueue not installed)."""
    flavors: Mapping[str, K8sObject | None] | None = None
    """The Kueue ResourceFlavors its admission names, by name (None in the map: no such flavor). Read only when a
    decision asks (Needs.flavors): the workloads of an admitted job are about to be created."""
    pool: pools.PoolView | None = None
    """The job's RolloutPool (jobs with spec.inference.poolRef only): its spec and status (the attachment list)."""
    trainer_pods_left: tuple[K8sObject, ...] | None = None
    """Trainer pods of this job's name that outlived their Job (deleted in the background by someone else, or by
    the collector after a delete of a job of the same name): read only when a decision would create a trainer Job
    (Needs.trainer_pods); None: not read."""
    owner_deleting: bool | None = None
    """The job read again from the API is being deleted (Needs.owner); None: not read."""
    managed_secret: tuple[str, str] | None = None
    """(field path, name) of a Secret the job names that is one of the operator's (Needs.secrets)."""
    secrets_checked: bool = False
    """The Secrets the job names were read (Needs.secrets): managed_secret says what was found."""
    token: str | None = None
    """Fingerprint of the token in the job's token Secret (grpolora.api.pool.token_fingerprint), as the last full
    pass read or made it; None: not known (the pods' token is then taken as current)."""
    environment: K8sObject | None = None
    """The environment server's StatefulSet (spec.environment.server only; None = absent)."""

    @property
    def workloads(self) -> tuple[K8sObject | None, ...]:
        """The job's workloads as read: trainer Job, inference StatefulSet, environment StatefulSet (None: absent)."""
        return (self.trainer_job, self.inference, self.environment)


@dataclass(frozen=True)
class Refusal:
    """The API server refused to create a child."""

    kind: str
    name: str
    status: int
    message: str

    @property
    def transient(self) -> bool:
        """Unreachable, throttled or a server-side failure: retried as is (as kube.ApiError.transient)."""
        return self.status == 0 or self.status == 429 or self.status >= 500


@dataclass(frozen=True)
class Needs:
    """What a decision still needs read before it can be carried out: its pass reads all of it at once and decides
    a second and last time (JobPass._pass). Asked for only when workloads are about to be created."""

    owner: bool = False
    """Read the job again: is it being deleted? (a later pass creating children; the body it decides on may be older
    than the deletion, and a child created now would hold a foreground deletion)."""
    flavors: tuple[str, ...] = ()
    """The Kueue ResourceFlavors the admission names that were not read (Observed.flavors)."""
    trainer_pods: bool = False
    """List the trainer pods of the job's name (Observed.trainer_pods_left)."""
    secrets: bool = False
    """Read the Secrets the job names (Observed.managed_secret)."""

    def __bool__(self) -> bool:
        return self.owner or bool(self.flavors) or self.trainer_pods or self.secrets


@dataclass(frozen=True)
class Decision:
    status: JobStatus
    create: tuple[K8sObject, ...] = ()
    delete: tuple[ChildRef, ...] = ()
    delete_job: bool = False
    """ttlSecondsAfterFinished has passed: delete the GRPOLoraJob (its children follow by ownerReferences)."""
    requeue_after: float | None = None
    """Look again after this many seconds instead of the regular interval."""
    events: tuple[Event, ...] = ()
    queue_workload_write: kueue.WorkloadWrite | None = None
    """What to write on the job's Kueue Workload, as a job integration does (grpolora.operator.kueue): give the quota
    back after an eviction once the workloads are gone, mark it Finished when the job ends (Kueue then returns its
    quota)."""
    needs: Needs = Needs()
    """What to read, then decide again, before anything of this decision is carried out."""
    release: tuple[ChildRef, ...] = ()
    """Workloads to delete again, in the Background: their foreground deletion waits for pods that no longer hold
    anything back (stopped, or on a node that does not confirm their end: observe.pod_gone_for_replacement). The
    API server then drops their foregroundDeletion finalizer and removes them, freeing the name."""
    fence: tuple[str, ...] = ()
    """Pods taken as lost: remove their job-uid label (builders.JOB_UID_LABEL), so that no Service of the job selects
    them any more (a Terminating pod stays in a publishNotReadyAddresses Service's endpoints)."""
    idle: bool = False
    """Nothing can change until the spec does (finished without a pending TTL, suspended, never valid): no need to
    keep watching; a spec change runs a new pass."""

    @property
    def read_flavors(self) -> tuple[str, ...]:
        """The ResourceFlavors the workloads wait for (Needs.flavors)."""
        return self.needs.flavors


API_RETRY_SECONDS: Final = 5.0
