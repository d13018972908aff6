"""The last failed trainer attempt, kept where a user finds it.

When the trainer group fails, the operator restarts it by deleting its Job (grpolora.operator.reconcile), and the
Job's pods go with it: `kubectl logs` has nothing to show any more, and the termination message holds only the
worker's last words (4 KiB, written by the worker itself, or nothing when it was killed). So in the pass that sees
an attempt end in failure (the restart is counted, or the job fails), before anything is deleted, the operator reads
the tail of the failed pod's log and keeps it twice:
- in the job's status, `status.lastFailedAttempt` (attempt, pod, exit code, reason, log tail): it stays until the
  next failure replaces it, and survives the job's end;
- in a TrainerAttemptFailed Warning event on the job (`kubectl describe glj`), shorter (an event message is 1 KiB
  at most) and gone after the API server's event TTL (one hour by default).

The rules are pure functions here; `keep_failed_attempt` is the one step that reads the log (pods/log get).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from grpolora.api import constants as c
from grpolora.api.status import FailedAttempt, JobStatus
from grpolora.operator import kube, names, observe
from grpolora.operator import reconcile as rec

logger = logging.getLogger(__name__)
K8sObject = dict[str, Any]
LOG_TAIL_LINES: Final = 50
LOG_TAIL_BYTES: Final = 4096  # as much as a termination message holds
# What one read may bring at most. The API server applies limitBytes to the front of the last tailLines lines (it
# stops reading there: PodLogOptions.limitBytes), so the limit is well above LOG_TAIL_BYTES, which is then cut from
# the end here (bounded_tail); only lines of over 1 KiB each on average would lose the very last ones.
LOG_READ_BYTES: Final = 64 * 1024
EVENT_TAIL_BYTES: Final = 700  # what fits in an event message (kube.EVENT_MESSAGE_MAX) beside the heading
# Exit codes a rank gets because another failed: torch stops its peers (SIGTERM, 128 + 15), the kubelet kills what
# does not stop (SIGKILL, 128 + 9; an OOM kill is also 137 but with reason OOMKilled, the pod's own failure), and a
# collective whose peer vanished raises in the survivors (1, too common to tell apart: the earlier failure wins).
SECONDARY_EXIT_CODES: Final = (128 + 15, 128 + 9)

LogReader = Callable[[str, str, int, int], Awaitable[str | None]]
"""(namespace, pod name, tail lines, byte limit) -> the tail of the trainer container's log (None: not readable)."""


@dataclass(frozen=True)
class FailedPod:
    """A trainer pod whose trainer container ended with a non-zero exit code (or was never able to run)."""

    name: str
    exit_code: int | None
    reason: str | None
    finished_at: str | None


def attempt_failed(old: JobStatus, new: JobStatus) -> bool:
    """Whether this pass ends a trainer attempt in failure: it counts a restart, or the job fails (a spec error, or
    the last allowed restart spent). A disruption counts a restart too: its pod may say why as well."""
    restarted = (new.trainer_restarts or 0) > (old.trainer_restarts or 0)
    return restarted or (new.phase == "Failed" and old.phase != "Failed")


def failed_trainer_pods(pods: Sequence[K8sObject], trainer_job: K8sObject | None) -> list[FailedPod]:
    """The failed pods of this attempt's trainer Job (owned by it: not a Terminating pod of an earlier one), the
    cause first: a failure of its own before one its peers' failure caused (SECONDARY_EXIT_CODES), then the earliest
    to finish, then by name."""
    uid = ((trainer_job or {}).get("metadata") or {}).get("uid")
    found = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if (meta.get("labels") or {}).get(c.LABEL_ROLE) != c.ROLE_TRAINER:
            continue
        if uid is not None and observe.controller_uid(pod) not in (uid, None):
            continue
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            if container.get("name") != c.ROLE_TRAINER:
                continue
            state = container.get("state") or {}
            ended = state.get("terminated") or (container.get("lastState") or {}).get("terminated")
            if ended and ended.get("exitCode"):
                found.append(FailedPod(meta["name"], ended["exitCode"], ended.get("reason"), ended.get("finishedAt")))
    return sorted(found, key=lambda p: (_secondary(p), p.finished_at or "~", p.name))


def _secondary(pod: FailedPod) -> bool:
    return pod.exit_code in SECONDARY_EXIT_CODES and pod.reason != "OOMKilled"


def bounded_tail(log: str, *, lines: int = LOG_TAIL_LINES, max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last `lines` lines of `log`, cut from the front to `max_bytes` of UTF-8 (never inside a character)."""
    tail = "\n".join(log.rstrip("\n").split("\n")[-lines:])
    encoded = tail.encode()
    if len(encoded) <= max_bytes:
        return tail
    cut = encoded[len(encoded) - max_bytes :].decode(errors="ignore")
    return cut.split("\n", 1)[1] if "\n" in cut else cut  # a whole first line where there is one


def record(attempt: int, pod: FailedPod, log: str | None) -> FailedAttempt:
    return FailedAttempt(
        attempt=attempt,
        pod=pod.name,
        exit_code=pod.exit_code,
        reason=pod.reason,
        finished_at=pod.finished_at,
        log_tail=bounded_tail(log or ""),
    )


def event_message(kept: FailedAttempt) -> str:
    """The TrainerAttemptFailed event's message: the attempt, the pod, and the last lines that fit an event."""
    heading = f"attempt {kept.attempt}: pod {kept.pod} exited with code {kept.exit_code}"
    if kept.reason:
        heading += f" ({kept.reason})"
    if not kept.log_tail:
        return f"{heading}; its log could not be read"
    tail = bounded_tail(kept.log_tail, max_bytes=EVENT_TAIL_BYTES)
    return f"{heading}; the last lines of its log (all in status.lastFailedAttempt.logTail):\n{tail}"


async def keep_failed_attempt(
    old: JobStatus,
    new: JobStatus,
    *,
    namespace: str,
    pods: Sequence[K8sObject],
    trainer_job: K8sObject | None,
    read_log: LogReader,
) -> tuple[JobStatus, str | None]:
    """`new` with the failed attempt kept (or the one kept before carried over), and the event message to send
    (None: no attempt failed in this pass, or no pod is left to tell it)."""
    carried = new if new.last_failed_attempt is not None else _with(new, old.last_failed_attempt)
    if not attempt_failed(old, new):
        return carried, None
    failed = failed_trainer_pods(pods, trainer_job)
    if not failed:
        return carried, None
    log = await read_log(namespace, failed[0].name, LOG_TAIL_LINES, LOG_READ_BYTES)
    kept = record((old.trainer_restarts or 0) + 1, failed[0], log)
    return _with(new, kept), event_message(kept)


async def kept_in(
    decision: rec.Decision, old: JobStatus, observed: rec.Observed, namespace: str, client: kube.KubeClient
) -> rec.Decision:
    """`decision` with its status keeping the last failed attempt and, when one failed in this pass, the
    TrainerAttemptFailed event: the operator's call, in the pass that decided, before its children are changed."""
    status, message = await keep_failed_attempt(
        old,
        decision.status,
        namespace=namespace,
        pods=observed.pods,
        trainer_job=observed.trainer_job,
        read_log=log_reader(client),
    )
    events = decision.events
    if message is not None:
        events = (*events, rec.Event("Warning", names.E_TRAINER_ATTEMPT_FAILED, message))
    return dataclasses.replace(decision, status=status, events=events)


def log_reader(client: kube.KubeClient) -> LogReader:
    """The trainer container's log tail through the API (pods/log). Best effort: a log that cannot be read (the pod
    already gone, the container never started, the API refusing) is kept as unreadable, never a failed pass."""

    async def read(namespace: str, pod: str, lines: int, max_bytes: int) -> str | None:
        try:
            return await client.pod_log(
                namespace, pod, container=c.ROLE_TRAINER, tail_lines=lines, limit_bytes=max_bytes
            )
        except kube.ApiError as exc:
            logger.warning("%s/%s: could not read the failed trainer's log: %s", namespace, pod, exc)
            return None

    return read


def _with(status: JobStatus, kept: FailedAttempt | None) -> JobStatus:
    return status.model_copy(update={"last_failed_attempt": kept})
