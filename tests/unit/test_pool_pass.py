"""The pure decision of one RolloutPool pass (grpolora.operator.pool_reconcile.decide_pool): which jobs it serves,
which children it creates or rewrites, its status. The controller's reads are played by the tables below."""

from __future__ import annotations

import base64
import datetime

import pytest

from grpolora.api import constants as c
from grpolora.api.load import parse_job
from grpolora.api.plan import plan_pool
from grpolora.api.pool import Attachments, PoolReplicas, attachment, token_fingerprint
from grpolora.api.status import AttachedJob, PoolStatus, RoleReplicas
from grpolora.operator import builders, names
from grpolora.operator.pool_reconcile import (
    PoolObserved,
    child_refs,
    decide_pool,
    pool_pass_view,
    token_reads,
)
from grpolora.testing.jobs import job_doc
from tests.unit.test_pool import pool, pool_doc

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
OPERATOR_NS = "grpolora-system"
POOL_UID = "pool-uid"


def view(*, deleting: bool = False, generation: int = 3, **spec):
    doc = pool_doc(**spec)
    doc["metadata"] |= {"uid": POOL_UID, "generation": generation}
    if deleting:
        doc["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return pool_pass_view(doc)


def job(name: str, second: int, **status) -> dict:
    doc = job_doc(model={"name": "Qwen/Qwen3-0.6B", "dtype": "bfloat16"}, inference={"poolRef": {"name": "shared"}})
    doc["metadata"] = {
        "name": name,
        "namespace": "rl",
        "uid": f"uid-{name}",
        "creationTimestamp": f"2026-01-01T00:00:0{second}Z",
    }
    doc["status"] = status
    return doc


def token_secret(name: str, token: str | None = None, owner: str | None = None) -> dict:
    return {
        "metadata": {"name": f"{name}-token", "ownerReferences": [{"controller": True, "uid": owner or f"uid-{name}"}]},
        "stringData": {c.TOKEN_SECRET_KEY: token or f"token-of-{name}"},
    }


def children(*attached: str, owner: str = POOL_UID, **spec) -> dict:
    """The pool's children as a pass that attached `attached` (each with its token_secret's token) left them."""
    entries = [
        attachment("rl", name, f"uid-{name}", f"token-of-{name}", parse_job(job(name, 0)).spec) for name in attached
    ]
    pool_plan = plan_pool(pool(**spec))
    objects = builders.build_pool_children(
        pool_plan,
        owner_uid=owner,
        attachments=Attachments(pool="shared", jobs=entries),
        generation=3,
        operator_namespace=OPERATOR_NS,
    )
    return {(obj["kind"], obj["metadata"]["name"]): obj for obj in objects}


def decide(pool_view, observed: PoolObserved, old: PoolStatus | None = None):
    return decide_pool(pool_view, old or PoolStatus(), observed, NOW, operator_namespace=OPERATOR_NS)


def full(jobs, kids=None, tokens=None, reports=()):
    absent = {ref: None for ref in child_refs(view(maxJobs=1), OPERATOR_NS)}
    return PoolObserved(jobs=tuple(jobs), children=kids if kids is not None else absent, tokens=tokens or {},
                        reports=tuple(reports))  # fmt: skip


def test_a_pool_being_deleted_does_nothing_and_stops_watching():
    decision = decide(view(deleting=True), PoolObserved())
    assert (decision.status, decision.writes, decision.idle) == (None, (), True)


def test_an_invalid_pool_gets_no_children_and_says_why():
    decision = decide(view(replicas=0), PoolObserved())
    assert decision.idle and not decision.writes
    assert decision.status is not None and decision.status.message.startswith("invalid spec: ")


def test_a_new_pool_creates_its_children_secret_first_and_attaches_the_first_jobs_in_line():
    jobs = [job("b", 2), job("a", 1)]
    assert token_reads(view(maxJobs=1), jobs, []) == ("rl/a",)
    decision = decide(view(maxJobs=1), full(jobs, tokens={"rl/a": token_secret("a")}))
    kinds = [write.obj["kind"] for write in decision.writes]
    assert kinds[0] == "Secret" and kinds.index("NetworkPolicy") < kinds.index("StatefulSet")
    assert all(write.patch is None for write in decision.writes), "all created"
    listed = builders.attachments_of(decision.writes[0].obj)
    assert listed is not None and [entry.job for entry in listed.jobs] == ["rl/a"]
    assert decision.status is not None
    assert [(e.job, e.uid, e.token_digest) for e in decision.status.attached_jobs] == [
        ("rl/a", "uid-a", token_fingerprint("token-of-a"))
    ]
    assert decision.status.waiting_jobs == ["rl/b"]


@pytest.mark.parametrize(
    ("secret", "why"),
    [
        (None, "not made yet"),
        (token_secret("a", owner="uid-of-an-older-a"), "still the Secret of a deleted job of the same name"),
    ],
)
def test_a_job_without_its_token_keeps_its_place_and_those_behind_it_wait(secret, why):
    decision = decide(view(maxJobs=2), full([job("a", 1), job("b", 2)], tokens={"rl/a": secret, "rl/b": None}))
    assert decision.status is not None
    assert decision.status.attached_jobs == [], why
    assert decision.status.waiting_jobs == ["rl/a", "rl/b"]


def test_kept_attachments_are_not_read_again_and_unchanged_children_are_not_written():
    kids = children("a", maxJobs=1)
    jobs = [job("a", 1, tokenDigest=token_fingerprint("token-of-a")), job("b", 2)]
    assert token_reads(view(maxJobs=1), jobs, builders.attachments_of(kids[("Secret", "shared-pool-jobs")]).jobs) == ()
    decision = decide(view(maxJobs=1), full(jobs, kids))
    assert decision.writes == ()
    assert decision.status is not None and [e.job for e in decision.status.attached_jobs] == ["rl/a"]


def test_a_job_that_leaves_frees_its_place_and_the_secret_and_network_policy_are_rewritten():
    kids = children("a", maxJobs=1)
    decision = decide(view(maxJobs=1), full([job("a", 1, phase="Succeeded"), job("b", 2)], kids,
                                            tokens={"rl/b": token_secret("b")}))  # fmt: skip
    rewritten = {write.obj["kind"]: write.patch for write in decision.writes}
    assert set(rewritten) == {"Secret", "NetworkPolicy"}
    assert rewritten["Secret"] == {"data": decision.writes[0].obj["data"]}
    listed = builders.attachments_of(decision.writes[0].obj)
    assert listed is not None and [entry.job for entry in listed.jobs] == ["rl/b"]


def test_a_re_keyed_job_is_read_again_and_its_entry_renewed():
    kids = children("a", maxJobs=1)
    jobs = [job("a", 1, tokenDigest=token_fingerprint("a-new-token"))]
    previous = builders.attachments_of(kids[("Secret", "shared-pool-jobs")]).jobs
    assert token_reads(view(maxJobs=1), jobs, previous) == ("rl/a",)
    decision = decide(view(maxJobs=1), full(jobs, kids, tokens={"rl/a": token_secret("a", "a-new-token")}))
    assert decision.status is not None
    assert decision.status.attached_jobs[0].token_digest == token_fingerprint("a-new-token")
    # Its Secret not there (being re-made): the old entry stays until it is.
    decision = decide(view(maxJobs=1), full(jobs, kids, tokens={"rl/a": None}))
    assert decision.writes == () and decision.status is not None
    assert decision.status.attached_jobs[0].token_digest == token_fingerprint("token-of-a")


def test_a_scaled_pool_patches_its_statefulsets_replicas_and_lists_the_new_replicas_for_the_trainers():
    kids = children("a", maxJobs=1, replicas=2)
    jobs = [job("a", 1, tokenDigest=token_fingerprint("token-of-a"))]
    decision = decide(view(maxJobs=1, replicas=3, generation=4), full(jobs, kids))
    patches = {write.obj["kind"]: write.patch for write in decision.writes}
    assert patches["StatefulSet"] == {"spec": {"replicas": 3}}, "a patch of the replicas alone: no pod replaced"
    listed = builders.attachments_of(decision.writes[0].obj)
    assert listed is not None and patches["Secret"] == {"data": decision.writes[0].obj["data"]}
    replicas = PoolReplicas.model_validate_json(base64.b64decode(patches["Secret"]["data"]["replicas.json"]))
    assert (replicas.generation, len(replicas.endpoints), [e.job for e in listed.jobs]) == (4, 3, ["rl/a"])
    assert set(patches) == {"Secret", "StatefulSet"}
    assert decision.status is not None and decision.status.replicas == RoleReplicas(desired=3, ready=0)
    # Scaled down: the same, the other way.
    decision = decide(view(maxJobs=1, replicas=1, generation=4), full(jobs, kids))
    assert {w.obj["kind"]: w.patch for w in decision.writes}["StatefulSet"] == {"spec": {"replicas": 1}}


def test_a_child_of_a_deleted_pool_of_the_same_name_is_waited_for():
    kids = children(owner="uid-of-the-old-pool", maxJobs=1)
    decision = decide(view(maxJobs=1), full([job("a", 1)], kids, tokens={"rl/a": token_secret("a")}))
    assert (decision.status, decision.writes, decision.requeue_after) == (None, (), 1.0)


def test_a_light_pass_keeps_the_attachments_and_counts_only_the_pools_own_ready_replicas():
    old = PoolStatus(
        observed_generation=3,
        attached_jobs=[AttachedJob(job="rl/a", uid="uid-a", token_digest="f" * 16)],
        waiting_jobs=["rl/b"],
        replicas=RoleReplicas(desired=2, ready=0),
    )
    statefulset = children(maxJobs=1)[("StatefulSet", "shared-pool")] | {"status": {"readyReplicas": 2}}
    decision = decide(view(maxJobs=1), PoolObserved(children={("StatefulSet", "shared-pool"): statefulset}), old)
    assert decision.writes == () and decision.status is not None
    assert (decision.status.replicas, decision.status.waiting_jobs) == (RoleReplicas(desired=2, ready=2), ["rl/b"])
    assert decision.status.attached_jobs[0].token_digest == "f" * 16
    assert decision.status.conditions[0].type == names.READY
    foreign = statefulset | {"metadata": {**statefulset["metadata"], "ownerReferences": [{"controller": True}]}}
    decision = decide(view(maxJobs=1), PoolObserved(children={("StatefulSet", "shared-pool"): foreign}), old)
    assert decision.status is not None and decision.status.replicas == RoleReplicas(desired=2, ready=0)


def test_a_pool_whose_replicas_are_not_ready_says_why():
    """`kubectl get rolloutpool` showed 0/2 replicas ready and nothing more while its servers crash-looped (a model
    they cannot load exits 78): the pass reads the pool's pods while replicas are missing, and the Ready condition
    and the message say what the job's do (observe.why_not_ready: the worst reason, naming the pods)."""
    old = PoolStatus(observed_generation=3, replicas=RoleReplicas(desired=2, ready=0))
    statefulset = children(maxJobs=1)[("StatefulSet", "shared-pool")] | {"status": {"readyReplicas": 1}}
    crashing = {
        "metadata": {"name": "shared-pool-1"},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "server",
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"}},
                    "lastState": {"terminated": {"exitCode": 78, "message": "error: spec.model.name: not found\n"}},
                }
            ],
        },
    }
    observed = PoolObserved(children={("StatefulSet", "shared-pool"): statefulset}, pods=(crashing,))
    decision = decide(view(maxJobs=1), observed, old)
    assert decision.status is not None
    ready = next(x for x in decision.status.conditions if x.type == names.READY)
    assert ready.status == "False" and ready.reason == "CrashLoopBackOff"
    assert "shared-pool-1: back-off 40s restarting (last exit 78: error: spec.model.name: not found)" in ready.message
    assert decision.status.message.startswith("1/2 replicas ready (CrashLoopBackOff: shared-pool-1")
    ready_now = statefulset | {"status": {"readyReplicas": 2}}
    decision = decide(view(maxJobs=1), PoolObserved(children={("StatefulSet", "shared-pool"): ready_now}), old)
    assert decision.status is not None and decision.status.message.startswith("2/2 replicas ready;")


# ---- the pool's Events ---------------------------------------------------------------------------------------------


def _pool_status(*attached: tuple[str, str], waiting: tuple[str, ...] = (), ready: int = 2, desired: int = 2):
    return PoolStatus(
        attached_jobs=[AttachedJob(job=job, uid=uid) for job, uid in attached],
        waiting_jobs=list(waiting),
        replicas=RoleReplicas(desired=desired, ready=ready),
    )


def test_pool_events_say_each_transition_once():
    from grpolora.operator.pool_reconcile import pool_events

    a, b = ("rl/a", "u-a"), ("rl/b", "u-b")
    reasons = lambda old, new: [(e.type, e.reason) for e in pool_events(old, new, max_jobs=1)]  # noqa: E731
    assert reasons(_pool_status(), _pool_status(a, waiting=("rl/b",))) == [
        ("Normal", names.E_POOL_JOB_ATTACHED),
        ("Normal", names.E_POOL_FULL),
    ]
    assert reasons(_pool_status(a, waiting=("rl/b",)), _pool_status(a, waiting=("rl/b",))) == [], "once"
    assert reasons(_pool_status(a, waiting=("rl/b",)), _pool_status(b)) == [
        ("Normal", names.E_POOL_JOB_ATTACHED),
        ("Normal", names.E_POOL_JOB_DETACHED),
    ]
    # Re-created under its name: another job (another uid).
    assert len(pool_events(_pool_status(a), _pool_status(("rl/a", "u-a2")), max_jobs=1)) == 2
    # Waiting for its token Secret with a place free is not "full".
    assert reasons(_pool_status(), _pool_status(waiting=("rl/a",))) == []
    # Scaled: once, when the desired replicas change (a Warning-free story for kubectl describe).
    assert reasons(_pool_status(a, ready=2, desired=2), _pool_status(a, ready=2, desired=3)) == [
        ("Normal", names.E_POOL_SCALED)
    ]
    (scaled,) = pool_events(_pool_status(a, desired=3), _pool_status(a, ready=2, desired=1), max_jobs=1)
    assert scaled.message.startswith("scaled from 3 to 1 server replicas")
    assert reasons(_pool_status(a, desired=3), _pool_status(a, ready=1, desired=3)) == [
        ("Warning", names.E_POOL_REPLICA_LOST)
    ]
    # A replica lost: fewer ready for as many desired; not while the pool starts or scales.
    assert reasons(_pool_status(a, ready=2), _pool_status(a, ready=1)) == [("Warning", names.E_POOL_REPLICA_LOST)]
    assert reasons(_pool_status(a, ready=0), _pool_status(a, ready=1)) == []
    assert reasons(_pool_status(a, ready=2, desired=2), _pool_status(a, ready=1, desired=1)) == [
        ("Normal", names.E_POOL_SCALED)
    ], "scaled down: no replica lost"
