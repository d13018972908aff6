"""metav1.Condition bookkeeping, pure: the whole list is rebuilt each pass and written whole (a merge patch
replaces lists), and `lastTransitionTime` moves only when a condition's status flips."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

from grpolora.api.status import Condition, ConditionStatus


@dataclass(frozen=True)
class Want:
    """A condition as one pass wants it; `merge` adds the times and the generation."""

    type: str
    status: ConditionStatus
    reason: str
    message: str = ""


def rfc3339(moment: datetime.datetime) -> str:
    """metav1.Time: UTC, whole seconds, `Z` suffix."""
    return moment.astimezone(datetime.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge(old: Sequence[Condition], wanted: Sequence[Want], *, now: str, generation: int | None) -> list[Condition]:
    """The new condition list, in the order of `wanted`.

    A condition keeps its old lastTransitionTime unless its status changed (a new reason or message alone is not
    a transition). Conditions not in `wanted` are dropped: this operator owns the whole list.
    """
    previous = {condition.type: condition for condition in old}
    result = []
    for want in wanted:
        before = previous.get(want.type)
        flipped = before is None or before.status != want.status
        result.append(
            Condition(
                type=want.type,
                status=want.status,
                reason=want.reason,
                message=want.message,
                last_transition_time=now if flipped else before.last_transition_time,
                observed_generation=generation,
            )
        )
    return result


def find(conditions: Sequence[Condition], type_: str) -> Condition | None:
    return next((condition for condition in conditions if condition.type == type_), None)


def is_true(conditions: Sequence[Condition], type_: str) -> bool:
    found = find(conditions, type_)
    return found is not None and found.status == "True"
