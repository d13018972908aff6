"""Condition transitions: the whole list each time, lastTransitionTime moving only when a status flips."""

from __future__ import annotations

import datetime

import pytest

from grpolora.api.status import Condition
from grpolora.operator.conditions import Want, merge, rfc3339

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def condition(type_: str, status: str, reason: str = "R", message: str = "", time: str = T0) -> Condition:
    return Condition(type=type_, status=status, reason=reason, message=message, last_transition_time=time)


@pytest.mark.parametrize(
    ("before", "want", "expected_time"),
    [
        (None, Want("Ready", "True", "R"), T1),  # new condition
        (condition("Ready", "True"), Want("Ready", "True", "R"), T0),  # unchanged
        (condition("Ready", "True", "Old", "old"), Want("Ready", "True", "New", "new"), T0),  # reason/message only
        (condition("Ready", "False"), Want("Ready", "True", "R"), T1),  # flip
        (condition("Ready", "Unknown"), Want("Ready", "False", "R"), T1),  # flip from Unknown
    ],
    ids=["new", "unchanged", "reason-only", "flip", "from-unknown"],
)
def test_last_transition_time_moves_only_on_a_status_flip(before, want, expected_time):
    (result,) = merge([before] if before else [], [want], now=T1, generation=3)
    assert result.last_transition_time == expected_time
    assert (result.status, result.reason, result.message) == (want.status, want.reason, want.message)
    assert result.observed_generation == 3


def test_the_whole_list_is_rebuilt_in_the_wanted_order():
    old = [condition("B", "True"), condition("Stale", "True"), condition("A", "False")]
    result = merge(old, [Want("A", "False", "R"), Want("B", "True", "R"), Want("C", "True", "R")], now=T1, generation=1)
    assert [c.type for c in result] == ["A", "B", "C"]  # "Stale" is not written any more
    assert [c.last_transition_time for c in result] == [T0, T0, T1]


def test_metav1_time_is_utc_whole_seconds():
    moment = datetime.datetime(2026, 3, 4, 5, 6, 7, 890000, tzinfo=datetime.timezone(datetime.timedelta(hours=2)))
    assert rfc3339(moment) == "2026-03-04T03:06:07Z"


def test_condition_types_use_the_anchors_vocabulary_where_the_meaning_is_the_same():
    """batch/v1 Job and Kubeflow Trainer: Complete, Failed, Suspended; Kubeflow Trainer: Created."""
    from grpolora.operator import names

    assert (names.CREATED, names.SUCCEEDED, names.FAILED, names.SUSPENDED) == (
        "Created",
        "Complete",
        "Failed",
        "Suspended",
    )
