"""A GRPOLoraJob's stored status, pure: read it (stored_status), whether it finished (is_finished), and the merge
patch that writes a new one (status_patch; None when nothing changed)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from pydantic import ValidationError

from grpolora.api.status import (
    JobStatus,
)
from grpolora.operator import conditions as cond
from grpolora.operator import names

TERMINAL: Final = ("Succeeded", "Failed")


# The completionTime rule: how a job's end is decided, in one place.
# - Finished for good (`is_finished`): a terminal phase with status.completionTime. Set when the job ran and ended
#   (Succeeded; Failed by its trainer, its deadlines, its pool's deletion). Nothing runs again: only its inference
#   pods are released and the TTL counts; a spec change is refused (the job has started). A create refused after the
#   job started (status.trainerIncarnation set) ends nothing: the job keeps its run and tries again
#   (reconcile.decide_refused).
# - Failed to start: a terminal phase without completionTime (job_conditions.failed_to_start: a child refused before
#   anything ran, a claim its pods cannot share, a pool it does not fit, a Secret of the operator's). Until its
#   children exist every field may change, and a change of the spec (a generation past the failure's) runs it again.
#   A failure found again on every pass (VolumeAccessMode, PoolMismatch) follows its cause; one known only from a
#   refused create (CreateRefused, ManagedSecret) holds at the generation it failed at (`failed_at_this_generation`):
#   retried each pass, under Kueue it deleted its Finished Workload, was admitted again and refused again, a loop.
HELD_START_FAILURES: Final = (names.R_CREATE_REFUSED, names.R_MANAGED_SECRET)


def is_finished(status: JobStatus) -> bool:
    """Finished for good (see the completionTime rule above)."""
    return status.phase in TERMINAL and status.completion_time is not None


def failed_at_this_generation(status: JobStatus, generation: int | None) -> bool:
    """A job that failed to start for a reason known only from a refused create, and whose spec has not changed
    since: it stays Failed, and nothing is created or re-queued for it (see the completionTime rule above)."""
    if status.phase != "Failed" or is_finished(status):
        return False
    failed = cond.find(status.conditions, names.FAILED)
    return (
        failed is not None
        and failed.status == "True"
        and failed.reason in HELD_START_FAILURES
        and failed.observed_generation is not None
        and failed.observed_generation == generation
    )


# ---- the status write --------------------------------------------------------------------------------------


def status_patch(old: Mapping[str, Any], new: JobStatus) -> dict[str, Any] | None:
    """The merge patch that turns the stored status into `new` (None if nothing changed).

    Fields that disappear are sent as null (a merge patch keeps what it does not mention); Kopf's own
    `status.kopf` is left alone.
    """
    ours = {key: value for key, value in old.items() if key != "kopf"}
    wanted = new.to_wire()
    if ours == wanted:
        return None
    return _merge_patch(ours, wanted)


def _merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            if before != value:
                patch[key] = _merge_patch(before, value)
        elif before != value or key not in old:
            patch[key] = value
    for key in old:
        if key not in new:
            patch[key] = None
    return patch


def stored_status(raw: Mapping[str, Any] | None) -> JobStatus:
    """The status as stored; an unreadable one counts as empty (the next write replaces it)."""
    try:
        return JobStatus.model_validate({k: v for k, v in (raw or {}).items() if k != "kopf"})
    except ValidationError:
        return JobStatus()
