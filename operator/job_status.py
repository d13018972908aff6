"""A GRPOLoraJob's stored status, pure: read it (stored_status), whether it finished (is_finished), and the merge
patch that writes a new one (status_patch; None when nothing changed)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from pydantic import ValidationError

from grpolora.api.status import (
    JobStatus,
)

TERMINAL: Final = ("Succeeded", "Failed")


def is_finished(status: JobStatus) -> bool:
    return status.phase in TERMINAL and status.completion_time is not None


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
