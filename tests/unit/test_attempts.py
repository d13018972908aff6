"""The last failed trainer attempt (grpolora.operator.attempts): which pod tells it, how its log tail is bounded, when
a pass keeps it, and that a kept one is carried over by the passes after it."""

from __future__ import annotations

from typing import Any

import pytest

from grpolora.api.status import FailedAttempt, JobStatus
from grpolora.operator import attempts
from grpolora.operator.kube import EVENT_MESSAGE_MAX

JOB_UID = "trainer-job-uid"


def pod(name: str, exit_code: int | None, *, finished: str = "2026-01-01T00:00:10Z", owner: str = JOB_UID, **extra):
    terminated = {"exitCode": exit_code, "reason": extra.get("reason", "Error"), "finishedAt": finished}
    return {
        "metadata": {
            "name": name,
            "labels": {"grpolora.dev/role": extra.get("role", "trainer")},
            "ownerReferences": [{"controller": True, "uid": owner}],
        },
        "status": {
            "containerStatuses": [
                {"name": extra.get("container", "trainer"), "state": {"terminated": terminated}}
                if exit_code is not None
                else {"name": "trainer", "state": {"running": {}}}
            ]
        },
    }


TRAINER_JOB = {"metadata": {"name": "demo-trainer", "uid": JOB_UID}}


@pytest.mark.parametrize(
    ("pods", "expected"),
    [
        # Rank 1 failed first; rank 0 was stopped by torch (SIGTERM) after it: rank 1 is the cause.
        ([pod("t-0", 143, finished="...:09Z"), pod("t-1", 1, finished="...:10Z")], ["t-1", "t-0"]),
        # Two failures of their own: the earlier first.
        ([pod("t-0", 1, finished="...:12Z"), pod("t-1", 2, finished="...:10Z")], ["t-1", "t-0"]),
        # An OOM kill (137, reason OOMKilled) is the pod's own failure; the kubelet's SIGKILL after the grace period
        # (137, reason Error) is not.
        ([pod("t-0", 1, finished="...:12Z"), pod("t-1", 137, reason="OOMKilled", finished="...:11Z")], ["t-1", "t-0"]),
        ([pod("t-0", 137, finished="...:09Z"), pod("t-1", 1, finished="...:10Z")], ["t-1", "t-0"]),
        # Succeeded or still running pods, inference pods and another container tell nothing.
        (
            [pod("t-0", 0), pod("t-1", None), pod("i-0", 1, role="inference"), pod("t-2", 1, container="sidecar")],
            [],
        ),
        # A pod of an earlier trainer Job (still Terminating) is not this attempt's.
        ([pod("old-0", 1, owner="earlier-uid"), pod("t-0", 1)], ["t-0"]),
    ],
    ids=["peer-stopped", "earliest", "oom-killed", "killed-after-grace", "nothing-failed", "earlier-job"],
)
def test_the_pod_that_tells_the_failure_comes_first(pods, expected):
    assert [p.name for p in attempts.failed_trainer_pods(pods, TRAINER_JOB)] == expected


def test_a_restarted_container_tells_its_last_termination():
    restarted = pod("t-0", None)
    restarted["status"]["containerStatuses"][0]["lastState"] = {"terminated": {"exitCode": 3, "reason": "Error"}}
    assert attempts.failed_trainer_pods([restarted], TRAINER_JOB)[0].exit_code == 3


@pytest.mark.parametrize(
    ("log", "lines", "max_bytes", "expected"),
    [
        ("a\nb\nc\n", 2, 100, "b\nc"),
        ("a\nb\nc", 10, 100, "a\nb\nc"),
        ("", 10, 100, ""),
        # Cut from the front to the byte limit, to a whole first line where there is one.
        ("first line\nsecond\nthird", 10, 14, "second\nthird"),
        # Never inside a UTF-8 character; one long line is cut, not dropped.
        ("ééééé", 10, 5, "éé"),
    ],
)
def test_the_tail_keeps_the_end_within_its_bounds(log, lines, max_bytes, expected):
    tail = attempts.bounded_tail(log, lines=lines, max_bytes=max_bytes)
    assert tail == expected and len(tail.encode()) <= max_bytes


def test_the_default_bounds_are_fifty_lines_and_four_kib():
    log = "".join(f"line {i} " + "x" * 30 + "\n" for i in range(500))
    tail = attempts.bounded_tail(log)
    assert tail.split("\n")[-1].startswith("line 499 ") and len(tail.split("\n")) == 50
    assert len(attempts.bounded_tail("y" * 10_000).encode()) == attempts.LOG_TAIL_BYTES


def kept(**fields: Any) -> FailedAttempt:
    return FailedAttempt(**{"attempt": 1, "pod": "t-0", "exit_code": 1, "reason": "Error", **fields})


def test_the_event_says_the_attempt_the_pod_and_the_last_lines_within_an_events_size():
    message = attempts.event_message(kept(log_tail="\n".join(f"line {i}: " + "z" * 60 for i in range(50))))
    heading, tail = message.split("\n", 1)
    assert heading.startswith("attempt 1: pod t-0 exited with code 1 (Error);")
    assert "status.lastFailedAttempt.logTail" in heading
    assert tail.endswith("line 49: " + "z" * 60) and len(message) <= EVENT_MESSAGE_MAX
    assert attempts.event_message(kept()) == "attempt 1: pod t-0 exited with code 1 (Error); its log could not be read"


class Logs:
    """What the API would answer for the pods' logs; remembers what was asked."""

    def __init__(self, text: str | None):
        self.text, self.asked = text, []

    async def __call__(self, namespace: str, name: str, lines: int, max_bytes: int) -> str | None:
        self.asked.append((namespace, name, lines, max_bytes))
        return self.text


async def test_a_restart_keeps_the_failed_pods_log_tail_and_says_it_in_an_event():
    logs = Logs("loading model\nTraceback (most recent call last):\nRuntimeError: CUDA error: out of memory\n")
    old, new = JobStatus(trainer_restarts=1), JobStatus(trainer_restarts=2)
    status, message = await attempts.keep_failed_attempt(
        old, new, namespace="team-a", pods=[pod("t-0", 143), pod("t-1", 1)], trainer_job=TRAINER_JOB, read_log=logs
    )
    assert logs.asked == [("team-a", "t-1", attempts.LOG_TAIL_LINES, attempts.LOG_READ_BYTES)]
    assert status.last_failed_attempt == FailedAttempt(
        attempt=2,  # the second run of the group (one restart before it)
        pod="t-1",
        exit_code=1,
        reason="Error",
        finished_at="2026-01-01T00:00:10Z",
        log_tail="loading model\nTraceback (most recent call last):\nRuntimeError: CUDA error: out of memory",
    )
    assert message is not None and message.endswith("RuntimeError: CUDA error: out of memory")
    assert status.to_wire()["lastFailedAttempt"]["logTail"].endswith("out of memory")


async def test_the_job_failing_keeps_it_too_and_an_unreadable_log_is_said_so():
    old, new = JobStatus(phase="Running"), JobStatus(phase="Failed")
    status, message = await attempts.keep_failed_attempt(
        old, new, namespace="team-a", pods=[pod("t-0", 78)], trainer_job=TRAINER_JOB, read_log=Logs(None)
    )
    assert status.last_failed_attempt is not None and status.last_failed_attempt.log_tail == ""
    assert message is not None and message.endswith("its log could not be read")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (JobStatus(phase="Running", trainer_restarts=1), JobStatus(phase="Running", trainer_restarts=1)),
        (JobStatus(phase="Failed"), JobStatus(phase="Failed")),  # failed in an earlier pass: kept then
        (JobStatus(phase="Running"), JobStatus(phase="Succeeded")),
    ],
    ids=["running", "failed-before", "succeeded"],
)
async def test_other_passes_read_no_log_and_carry_the_kept_attempt_over(old, new):
    before = kept(log_tail="boom")
    logs = Logs("never read")
    old = old.model_copy(update={"last_failed_attempt": before})
    status, message = await attempts.keep_failed_attempt(
        old, new, namespace="team-a", pods=[pod("t-0", 1)], trainer_job=TRAINER_JOB, read_log=logs
    )
    assert status.last_failed_attempt == before and message is None and logs.asked == []


async def test_without_a_failed_pod_left_the_kept_attempt_stays():
    before = kept(log_tail="boom")
    old = JobStatus(trainer_restarts=0, last_failed_attempt=before)
    status, message = await attempts.keep_failed_attempt(
        old, JobStatus(trainer_restarts=1), namespace="n", pods=[], trainer_job=None, read_log=Logs("x")
    )
    assert status.last_failed_attempt == before and message is None
