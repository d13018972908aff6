"""Pure readers of what the cluster and the trainer report: child workload state, why pods are not ready, and
the fold of trainer rank 0's /status into the job's progress figures."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final

from grpolora.api.status import JobStatus, TrainerStatus
from grpolora.operator import names

K8sObject = Mapping[str, Any]


# ---- workloads ---------------------------------------------------------------------------------------------


def _status(obj: K8sObject | None) -> Mapping[str, Any]:
    return (obj or {}).get("status") or {}


def job_condition(job: K8sObject | None, type_: str) -> Mapping[str, Any] | None:
    """A batch/v1 Job condition of this type with status True (Complete, Failed), if any."""
    for condition in _status(job).get("conditions") or []:
        if condition.get("type") == type_ and condition.get("status") == "True":
            return condition
    return None


def job_succeeded(job: K8sObject | None) -> bool:
    return job_condition(job, "Complete") is not None


def job_active(job: K8sObject | None) -> int:
    return int(_status(job).get("active") or 0)


def job_ready(job: K8sObject | None) -> int:
    return int(_status(job).get("ready") or 0)


def statefulset_ready(statefulset: K8sObject | None) -> int:
    return int(_status(statefulset).get("readyReplicas") or 0)


def pod_active(pod: K8sObject) -> bool:
    """A pod that may still run: not finished, and not terminating. As the Job controller counts status.active
    (pkg/controller/job: terminating pods are counted apart), which Kueue's Job integration reads for IsActive: a pod
    stuck Terminating on a lost node (its kubelet never confirms) is not active."""
    phase = _status(pod).get("phase")
    return not deleting(pod) and phase not in ("Succeeded", "Failed")


def deleting(obj: K8sObject | None) -> bool:
    return bool(((obj or {}).get("metadata") or {}).get("deletionTimestamp"))


POD_LOST_AFTER_SECONDS: Final = 60
"""How long past its deletion deadline a Terminating pod must still be there to be taken as lost (see pod_lost_at)."""


def pod_terminal(pod: K8sObject) -> bool:
    """Its containers have all stopped (phase Succeeded or Failed): it runs nothing any more, and the EndpointSlice
    controller has dropped it from every Service (staging/src/k8s.io/endpointslice: ShouldPodBeInEndpoints leaves
    terminal pods out, even under publishNotReadyAddresses)."""
    return _status(pod).get("phase") in ("Succeeded", "Failed")


def pod_deletion_asked(pod: K8sObject) -> datetime.datetime | None:
    """When the pod was deleted: its deletionTimestamp less its grace period (the API server sets the timestamp to the
    delete's time plus deletionGracePeriodSeconds, pkg/registry/core/pod/strategy.go CheckGracefulDelete)."""
    meta = pod.get("metadata") or {}
    deadline = _time(meta.get("deletionTimestamp"))
    if deadline is None:
        return None
    return deadline - datetime.timedelta(seconds=int(meta.get("deletionGracePeriodSeconds") or 0))


def pod_lost_at(pod: K8sObject) -> datetime.datetime | None:
    """When a Terminating pod is taken as lost: POD_LOST_AFTER_SECONDS past its deletionTimestamp, the deadline by
    which its kubelet has stopped the containers (SIGKILL at the end of the grace period) and removed the pod. One
    still there then has a kubelet that does not confirm: its node is lost or partitioned, and the pod would stay
    Terminating until the node object is deleted, the node gets the out-of-service taint (PodGC's gcTerminating, which
    since KEP-3329 marks it Failed first) or an admin force-deletes it. None: not being deleted."""
    meta = pod.get("metadata") or {}
    deadline = _time(meta.get("deletionTimestamp"))
    return None if deadline is None else deadline + datetime.timedelta(seconds=POD_LOST_AFTER_SECONDS)


def pod_gone_for_replacement(pod: K8sObject, now: datetime.datetime) -> bool:
    """Whether a pod of a workload being replaced no longer holds its replacement back: it has stopped (pod_terminal),
    or it is lost (pod_lost_at has passed). The Job controller's own replacement rule with a podFailurePolicy
    (podReplacementPolicy Failed) waits for the first only, and so waits forever for a pod on a lost node."""
    if pod_terminal(pod):
        return True
    lost_at = pod_lost_at(pod)
    return lost_at is not None and now >= lost_at


def _time(value: Any) -> datetime.datetime | None:
    if not value:
        return None
    try:
        return datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


def recorded_runtime(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a started job recorded of its runtime (names.RUNTIME_ANNOTATION, grpolora.api.runtime.record_of); None
    when it recorded none, or something unreadable."""
    raw = (meta.get("annotations") or {}).get(names.RUNTIME_ANNOTATION)
    if not raw:
        return None
    try:
        found = json.loads(raw)
    except ValueError:
        return None
    return found if isinstance(found, dict) and isinstance(found.get("spec"), dict) else None


def controller_uid(obj: K8sObject | None) -> str | None:
    """The uid of the object's controlling owner (ownerReferences with controller: true), if any."""
    for ref in ((obj or {}).get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def trainer_incarnation(job: K8sObject | None) -> int | None:
    """The incarnation this trainer Job was created with (names.INCARNATION_ANNOTATION): 0 when unmarked, None for
    no Job."""
    return None if job is None else _count_annotation(job, names.INCARNATION_ANNOTATION)


def restart_attempt(job: K8sObject | None) -> int:
    """Which restart created this trainer Job (see names.RESTART_ATTEMPT_ANNOTATION); 0 when absent."""
    return _count_annotation(job, names.RESTART_ATTEMPT_ANNOTATION)


def _count_annotation(obj: K8sObject | None, key: str) -> int:
    """An annotation that holds a count: 0 when absent or not a number."""
    annotations = ((obj or {}).get("metadata") or {}).get("annotations") or {}
    try:
        return int(annotations.get(key, 0))
    except (TypeError, ValueError):
        return 0


# ---- why pods are not ready --------------------------------------------------------------------------------

# Waiting reasons that will not fix themselves; ordered before the transient ones below.
_STUCK_REASONS = (
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
    "CrashLoopBackOff",
)
# Worst first: a pod stuck pulling its image says more than one still being created.
_SEVERITY = (*_STUCK_REASONS, "Unschedulable", "ContainerCreating", "PodInitializing", "NotReady", "Pending")
_MAX_PODS_NAMED = 3
_MAX_LINE = 200  # of a container's last log line in a condition's message


@dataclass(frozen=True)
class NotReady:
    reason: str
    message: str


def _pod_problem(pod: K8sObject) -> tuple[str, str] | None:
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed") or deleting(pod):
        return None  # finished pods are the Job's business; terminating ones are being replaced
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return condition.get("reason") or "Unschedulable", condition.get("message") or "not scheduled"
    containers = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    for container in containers:
        waiting = (container.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason") in _STUCK_REASONS:
            message = waiting.get("message") or f"container {container.get('name')}"
            return waiting["reason"], message + _last_exit(container)
    for container in containers:
        waiting = (container.get("state") or {}).get("waiting")
        if waiting:
            return waiting.get("reason") or "Pending", waiting.get("message") or f"container {container.get('name')}"
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    if status.get("phase") == "Running" and not ready:
        return "NotReady", "running, readiness probe not passing yet"
    if status.get("phase") in (None, "Pending"):
        return "Pending", "pending"
    return None


def _last_exit(container: K8sObject) -> str:
    """How a restarting container last ended: the kubelet's back-off message names only the container, while the
    cause is in lastState.terminated, whose message is the log's tail (FallbackToLogsOnError, builders.py); its
    last line is the error our processes print before they exit."""
    ended = (container.get("lastState") or {}).get("terminated")
    if not ended:
        return ""
    lines = [line.strip() for line in str(ended.get("message") or "").splitlines() if line.strip()]
    said = f": {lines[-1][:_MAX_LINE]}" if lines else f" ({ended['reason']})" if ended.get("reason") else ""
    return f" (last exit {ended.get('exitCode', '?')}{said})"


def why_not_ready(pods: Sequence[K8sObject]) -> NotReady | None:
    """The most severe reason the job's pods are not ready, naming the pods (None if no pod says why)."""
    found: dict[str, list[str]] = {}
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
        problem = _pod_problem(pod)
        if problem is not None:
            reason, message = problem
            found.setdefault(reason, []).append(f"{pod['metadata']['name']}: {message}")
    if not found:
        return None
    reason = min(found, key=lambda r: _SEVERITY.index(r) if r in _SEVERITY else len(_SEVERITY))
    lines = found[reason]
    message = "; ".join(lines[:_MAX_PODS_NAMED])
    if len(lines) > _MAX_PODS_NAMED:
        message += f" (and {len(lines) - _MAX_PODS_NAMED} more)"
    return NotReady(reason, f"{reason}: {message}")


# ---- trainer progress --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """The training figures of the status, after folding in one trainer report."""

    step: int | None = None
    steps_lost: int | None = None
    sync_round: int | None = None
    last_sync_time: str | None = None
    last_sync_seconds: float | None = None
    last_sync_bytes: int | None = None
    reward_mean: float | None = None
    kl: float | None = None
    mismatch: float | None = None
    eval_reward: float | None = None
    adapter_path: str | None = None
    last_push: str | None = None
    last_push_step: int | None = None
    push_error: str | None = None
    staleness: int | None = None
    dropped_stale: int | None = None
    prompts_skipped: int | None = None
    epoch: int = 0
    """The sync group's epoch (it goes to status.rendezvous, not to a field of its own)."""

    @classmethod
    def of(cls, status: JobStatus, epoch: int) -> Progress:
        """The figures a job's status already holds (every field but epoch is a JobStatus field of the same name)."""
        return cls(**{name: getattr(status, name) for name in _STATUS_FIELDS}, epoch=epoch)

    def status_fields(self) -> dict[str, Any]:
        """The figures as JobStatus keyword arguments."""
        return {name: getattr(self, name) for name in _STATUS_FIELDS}


_STATUS_FIELDS = tuple(f.name for f in fields(Progress) if f.name != "epoch")


def fold_trainer(old: JobStatus, report: TrainerStatus | None) -> Progress:
    """Fold a trainer report into the previous figures.

    step is the step the trainer actually reached: after a restart from an older checkpoint (or from scratch, with
    checkpoints in an emptyDir) it is lower, and the difference is added to steps_lost. syncRound, the adapter
    version the replicas serve, never goes back; the sync figures of a report of an older round are kept from before.
    """
    epoch = old.rendezvous.epoch if old.rendezvous is not None else 0
    before = Progress.of(old, epoch)
    if report is None:
        return before
    current_round = report.sync_round >= (old.sync_round or 0)
    lost = old.steps_lost
    if report.step < (old.step or 0):
        lost = (lost or 0) + (old.step or 0) - report.step
    return Progress(
        step=report.step,
        steps_lost=lost,
        sync_round=max(old.sync_round or 0, report.sync_round),
        last_sync_time=_newer(current_round, report.last_sync_time, old.last_sync_time),
        last_sync_seconds=_newer(current_round, report.last_sync_seconds, old.last_sync_seconds),
        last_sync_bytes=_newer(current_round, report.last_sync_bytes, old.last_sync_bytes),
        reward_mean=report.reward_mean if report.reward_mean is not None else old.reward_mean,
        kl=report.kl if report.kl is not None else old.kl,
        mismatch=report.mismatch if report.mismatch is not None else old.mismatch,
        eval_reward=report.eval_reward if report.eval_reward is not None else old.eval_reward,
        adapter_path=report.adapter_path or old.adapter_path,
        last_push=report.last_push or old.last_push,
        last_push_step=report.last_push_step if report.last_push_step is not None else old.last_push_step,
        push_error=report.push_error,
        staleness=report.staleness if report.staleness is not None else old.staleness,
        dropped_stale=report.dropped_stale,
        prompts_skipped=report.prompts_skipped,
        epoch=report.epoch,
    )


def _newer(use_report: bool, reported: Any, previous: Any) -> Any:
    return reported if use_report and reported is not None else previous


# ---- warning events about the job's workloads and pods ---------------------------------------------------------


def pod_warnings(
    events: Sequence[K8sObject], workloads: Sequence[K8sObject], pods: Sequence[K8sObject], desired: Mapping[str, int]
) -> tuple[NotReady, ...]:
    """Why pods are missing or stuck, from Warning events (names.POD_WARNING_REASONS), most telling first. `desired`:
    the pods each workload wants, by its name.

    FailedCreate counts only for a workload that has fewer pods than it wants, mount failures only for a pod still
    waiting to start, and an event about an older object of the same name (another uid) not at all.
    """
    live: dict[tuple[str, str], str] = {}
    for workload in workloads:
        meta = workload.get("metadata") or {}
        have = sum(1 for pod in pods if _owned_by(pod, meta.get("uid")))
        if have < desired.get(meta.get("name", ""), 0):
            live[(workload.get("kind", ""), meta.get("name", ""))] = meta.get("uid", "")
    for pod in pods:
        waiting = [
            (s.get("state") or {}).get("waiting") for s in ((pod.get("status") or {}).get("containerStatuses") or [])
        ]
        if (pod.get("status") or {}).get("phase") in (None, "Pending") and (not waiting or any(waiting)):
            meta = pod.get("metadata") or {}
            live[("Pod", meta.get("name", ""))] = meta.get("uid", "")
    found: dict[str, NotReady] = {}
    for event in sorted(events, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or "")):
        involved = event.get("involvedObject") or {}
        key = (involved.get("kind", ""), involved.get("name", ""))
        reason = event.get("reason", "")
        if key not in live or reason not in names.POD_WARNING_REASONS:
            continue
        if involved.get("uid") and live[key] and involved["uid"] != live[key]:
            continue
        found[reason] = NotReady(reason, f"{reason}: {key[0]} {key[1]}: {event.get('message', '')}")
    return tuple(found[r] for r in names.POD_WARNING_REASONS if r in found)


def _owned_by(pod: K8sObject, uid: str | None) -> bool:
    refs = (pod.get("metadata") or {}).get("ownerReferences") or []
    return uid is None or not refs or any(ref.get("uid") == uid for ref in refs)


# ---- shared volumes ------------------------------------------------------------------------------------------

MANY_NODES_READ: Final = ("ReadOnlyMany", "ReadWriteMany")


@dataclass(frozen=True)
class VolumeUse:
    """A claim the job's pods share: `pods` of them mount it, read-only or to write."""

    claim: str
    role: str
    pods: int
    writes: bool


@dataclass(frozen=True)
class VolumeCheck:
    refusal: str | None = None
    """Why the job cannot run with these claims (the pods would never start)."""
    warning: str | None = None
    """Why it may hang: a single-node access mode shared by several pods (Multi-Attach unless on one node)."""


def volume_check(uses: Sequence[VolumeUse], modes: Mapping[str, tuple[str, ...] | None]) -> VolumeCheck:
    """Do the claims' access modes let every pod that mounts them do so? (Absent claims: the scheduler says.)"""
    refusals, warnings = [], []
    for use in uses:
        have = modes.get(use.claim)
        if not have:
            continue
        listed = ", ".join(have)
        if use.writes and set(have) <= {"ReadOnlyMany"}:
            needed = "ReadWriteOnce or ReadWriteMany" if use.pods == 1 else "ReadWriteMany"
            refusals.append(
                f"claim {use.claim} ({listed}) is read-only but the {use.role} writes to it; it needs {needed}"
            )
            continue
        if use.pods <= 1 or any(m in have for m in (("ReadWriteMany",) if use.writes else MANY_NODES_READ)):
            continue
        needed = "ReadWriteMany" if use.writes else "ReadOnlyMany or ReadWriteMany"
        if "ReadWriteOnce" not in have:  # ReadWriteOncePod: one pod, whatever the node
            refusals.append(
                f"claim {use.claim} ({listed}) admits one pod but {use.pods} {use.role} pods mount it; it needs "
                f"{needed}"
            )
        else:
            warnings.append(
                f"claim {use.claim} is ReadWriteOnce but {use.pods} {use.role} pods mount it: pods on a second node "
                f"hang in Multi-Attach unless all run on one node; use a claim with {needed}"
            )
    return VolumeCheck("; ".join(refusals) or None, "; ".join(warnings) or None)
