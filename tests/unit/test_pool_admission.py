"""The RolloutPool's admission decision and the pool facts a job reads, pure (grpolora.operator.pools)."""

from __future__ import annotations

import copy
import datetime
import json

import pytest

from grpolora.api.pool import Admission, Attachment, Candidate, admit
from grpolora.api.status import AttachedJob, PoolStatus, RoleReplicas
from grpolora.operator import names
from grpolora.operator.pools import (
    candidate,
    ordinal,
    place,
    pool_status,
    replica_versions,
)
from tests.helpers import job_doc
from tests.unit.test_pool import pool

DIGEST = "0" * 64


def cand(name: str, created: str, **kw) -> Candidate:
    return Candidate(key=f"rl/{name}", uid=kw.pop("uid", f"uid-{name}"), created=created, **{
        "active": True, "fits": True, **kw})  # fmt: skip


def was(name: str, uid: str | None = None) -> Attachment:
    return Attachment(job=f"rl/{name}", uid=uid or f"uid-{name}", auth=DIGEST, sync_key=DIGEST, kept_versions=1)


def test_waiting_jobs_attach_in_order_of_creation_then_name_up_to_max_jobs():
    jobs = [cand("c", "2026-01-01T00:00:02Z"), cand("b", "2026-01-01T00:00:01Z"), cand("a", "2026-01-01T00:00:01Z")]
    assert admit(2, jobs, []) == Admission(attached=("rl/a", "rl/b"), waiting=("rl/c",))


def test_attached_jobs_keep_their_place_ahead_of_older_waiting_ones_and_are_never_pushed_out():
    jobs = [cand("old", "2026-01-01T00:00:00Z"), cand("new", "2026-01-01T00:00:09Z")]
    assert admit(1, jobs, [was("new")]) == Admission(attached=("rl/new",), waiting=("rl/old",))
    # maxJobs lowered below what is attached: nobody is detached, nobody new attaches.
    assert admit(0, jobs, [was("new")]) == Admission(attached=("rl/new",), waiting=("rl/old",))


@pytest.mark.parametrize("gone", [{"active": False}, {"fits": False}])
def test_a_job_that_no_longer_wants_the_pool_detaches_and_frees_its_place(gone):
    jobs = [cand("a", "2026-01-01T00:00:00Z", **gone), cand("b", "2026-01-01T00:00:01Z")]
    assert admit(1, jobs, [was("a")]) == Admission(attached=("rl/b",), waiting=())
    assert admit(1, [jobs[1]], [was("a")]) == Admission(attached=("rl/b",), waiting=())  # deleted: not listed


def test_a_job_recreated_under_the_same_name_is_a_new_job_and_queues_again():
    jobs = [cand("b", "2026-01-01T00:00:01Z"), cand("a", "2026-01-01T00:00:05Z", uid="new-uid")]
    assert admit(1, jobs, [was("a", "old-uid")]) == Admission(attached=("rl/b",), waiting=("rl/a",))


def test_a_job_without_its_token_yet_keeps_its_place_and_those_behind_it_wait():
    jobs = [cand("a", "2026-01-01T00:00:00Z", ready=False), cand("b", "2026-01-01T00:00:01Z")]
    assert admit(2, jobs, []) == Admission(attached=(), waiting=("rl/a", "rl/b"))
    jobs = [cand("a", "2026-01-01T00:00:00Z"), cand("b", "2026-01-01T00:00:01Z", ready=False)]
    assert admit(2, jobs, []) == Admission(attached=("rl/a",), waiting=("rl/b",))


def test_ordinals():
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th"
    ]  # fmt: skip


def test_a_job_reads_its_place_in_line_from_the_pool_status():
    shared = pool(maxJobs=4)
    status = PoolStatus(
        attached_jobs=[AttachedJob(job=f"rl/j{i}", uid=f"u{i}") for i in range(4)],
        waiting_jobs=["rl/w1", "rl/w2"],
        replicas=RoleReplicas(desired=2, ready=1),
    )
    assert place(shared, status, "rl/w2", "x").message == "2nd in line for RolloutPool shared (4/4 jobs attached)"
    assert place(shared, status, "rl/w2", "x").reason == names.R_POOL_FULL
    attached = place(shared, status, "rl/j1", "u1")
    assert attached.attached and (attached.ready, attached.desired) == (1, 2)
    assert not place(shared, status, "rl/j1", "another-uid").attached  # the same name, another job
    unknown = place(shared, status, "rl/new", "n")
    assert unknown.reason == names.R_WAITING_FOR_POOL and not unknown.attached


def body(**spec) -> dict:
    doc = job_doc(model={"name": "Qwen/Qwen3-0.6B", "dtype": "bfloat16"}, inference={"poolRef": {"name": "shared"}})
    doc["metadata"] |= {"namespace": "rl", "uid": "u", "creationTimestamp": "2026-01-01T00:00:00Z"}
    doc["spec"] |= spec
    return doc


def test_a_job_body_becomes_a_candidate_of_its_own_pool_only():
    shared = pool()
    assert candidate(body(), shared) == Candidate(
        key="rl/demo", uid="u", created="2026-01-01T00:00:00Z", active=True, fits=True,
        job=candidate(body(), shared).job,
    )  # fmt: skip
    other = body()
    other["spec"]["inference"]["poolRef"]["name"] = "other"
    assert candidate(other, shared) is None
    elsewhere = body()
    elsewhere["metadata"]["namespace"] = "team-b"
    assert candidate(elsewhere, shared) is None
    assert not candidate(body(suspend=True), shared).active
    assert not candidate({**body(), "status": {"phase": "Succeeded"}}, shared).active
    assert not candidate({**body(), "status": {"phase": "Failed"}}, shared).active
    deleting = copy.deepcopy(body())
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    assert not candidate(deleting, shared).active
    assert not candidate(body(lora={"rank": 64}), shared).fits  # maxLoraRank 16


def test_a_queued_job_is_a_candidate_only_once_kueue_admitted_it():
    """Otherwise a queued job takes a pool place while Kueue holds it back, and under BestEffortFIFO a later job can
    be admitted first, hold its GPU quota and wait for the place the first holds: neither ever runs."""
    shared = pool()
    queued = body()
    queued["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "gpu-queue"}
    assert not candidate(queued, shared).active, "not admitted yet (no status)"
    waiting = {"type": names.ADMITTED, "status": "False", "reason": names.R_QUEUED}
    assert not candidate({**queued, "status": {"conditions": [waiting]}}, shared).active
    admitted = {"type": names.ADMITTED, "status": "True", "reason": names.R_ADMITTED}
    assert candidate({**queued, "status": {"conditions": [admitted]}}, shared).active
    assert candidate(body(), shared).active, "a job without a queue needs no admission"


def test_a_job_queued_by_its_runtime_is_a_candidate_only_once_kueue_admitted_it():
    """The queue may come from the job's runtime (spec.scheduling.queueName there), which the pool reads from what the
    job recorded as it started (the grpolora.dev/runtime annotation): the same rule as for a labelled job."""
    shared = pool()
    on_runtime = body(runtimeRef={"kind": "ClusterGRPOLoraRuntime", "name": "gpu"})
    record = {"kind": "ClusterGRPOLoraRuntime", "name": "gpu", "spec": {"scheduling": {"queueName": "gpu-queue"}}}
    on_runtime["metadata"]["annotations"] = {names.RUNTIME_ANNOTATION: json.dumps(record)}
    assert not candidate(on_runtime, shared).active, "queued by its runtime, not admitted yet"
    admitted = {"type": names.ADMITTED, "status": "True", "reason": names.R_ADMITTED}
    assert candidate({**on_runtime, "status": {"conditions": [admitted]}}, shared).active
    # Its own spec.scheduling.queueName queues it as well.
    assert not candidate(body(scheduling={"queueName": "gpu-queue"}), shared).active


def test_replica_versions_tolerate_replicas_that_do_not_answer_or_answer_nonsense():
    reports = [
        {"jobs": {"rl/a": {"live_version": 3}, "rl/b": {"live_version": 1}}},
        None,
        {"jobs": {"rl/a": {"live_version": "x"}}},
        {"jobs": {"rl/a": {"live_version": 2}}, "tokens_per_second": 10.0},
    ]
    assert [(r.replica, r.live_version) for r in replica_versions(reports, "rl/a")] == [(0, 3), (3, 2)]
    status = pool_status(
        pool(replicas=4, maxJobs=2, adaptersPerJob=3),
        PoolStatus(),
        Admission(attached=("rl/a",), waiting=("rl/b",)),
        {"rl/a": "uid-a"},
        {"status": {"readyReplicas": 3}},
        reports,
        generation=1,
        now=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),
    )
    assert (status.jobs, status.waiting, status.slots_in_use, status.slots) == ("1/2", 1, 3, 6)
    assert status.tokens_per_second == 10.0 and status.replicas == RoleReplicas(desired=4, ready=3)
    assert status.attached_jobs[0].uid == "uid-a" and status.waiting_jobs == ["rl/b"]
