"""Kueue: a job labelled kueue.x-k8s.io/queue-name gets one Kueue Workload with a pod set per role, so Kueue admits
both pools' pods together or neither; its workloads exist only while that Workload is admitted, and a finished job
marks it Finished (Kueue releases the quota)."""

from __future__ import annotations

import json
from typing import Any

from grpolora.api import constants as c
from grpolora.api.load import parse_job
from grpolora.api.plan import plan
from grpolora.api.status import JobStatus
from grpolora.operator import builders, names
from grpolora.operator.reconcile import ChildRef, Observed, decide, job_view, spec_json
from tests.helpers import job_doc
from tests.unit.test_operator_reconcile import NOW, body, condition, statefulset, trainer_job


def queued_doc(**spec: Any) -> dict[str, Any]:
    doc = job_doc(**spec)
    doc["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "gpu-queue"}
    return doc


def test_a_queued_job_renders_one_workload_with_a_pod_set_per_role():
    objects = builders.build_children(
        plan(parse_job(queued_doc(trainer={"replicas": 2}, inference={"replicas": 3}))), owner_uid="u", token="t"
    )
    (workload,) = [o for o in objects if o["kind"] == "Workload"]
    assert workload["apiVersion"] == "kueue.x-k8s.io/v1beta1" and workload["metadata"]["name"] == "demo"
    assert workload["spec"]["queueName"] == "gpu-queue"
    trainer = next(o for o in objects if o["kind"] == "Job")["spec"]["template"]
    inference = next(o for o in objects if o["kind"] == "StatefulSet")["spec"]["template"]
    assert workload["spec"]["podSets"] == [
        {"name": "trainer", "count": 2, "template": trainer},
        {"name": "inference", "count": 3, "template": inference},
    ]
    assert workload["metadata"]["ownerReferences"][0]["controller"] is True
    assert not [
        o
        for o in builders.build_children(plan(parse_job(job_doc())), owner_uid="u", token="t")
        if o["kind"] == "Workload"
    ]


def view_of(doc: dict[str, Any]):
    doc = json.loads(json.dumps(doc))
    doc["metadata"].update(uid="uid-1", generation=2)
    first = job_view(doc)
    applied = json.loads(spec_json(first.job.spec))
    stored = body(applied=applied)
    stored["metadata"]["labels"] = doc["metadata"]["labels"]
    return job_view(stored)


def admitted(status: str = "True", evicted: bool = False) -> dict[str, Any]:
    conditions = [{"type": "Admitted", "status": status, "reason": "Admitted" if status == "True" else "Pending"}]
    if evicted:
        conditions.append({"type": "Evicted", "status": "True", "reason": "Preempted", "message": "preempted by x"})
    return {"metadata": {"name": "demo"}, "status": {"conditions": conditions}}


def test_until_kueue_admits_both_pools_no_workload_is_created():
    view = view_of(queued_doc())
    decision = decide(view, JobStatus(), Observed(queue_workload={"metadata": {"name": "demo"}}), NOW)
    assert decision.create == () and decision.status.phase == "Pending"
    assert condition(decision, names.ADMITTED) == ("False", names.R_QUEUED)
    assert "gpu-queue" in decision.status.message


def test_once_admitted_the_workloads_are_created():
    decision = decide(view_of(queued_doc()), JobStatus(), Observed(queue_workload=admitted()), NOW)
    assert sorted(o["kind"] for o in decision.create) == ["Job", "StatefulSet"]
    assert condition(decision, names.ADMITTED) == ("True", names.R_ADMITTED)


def test_an_evicted_job_gives_both_pools_back():
    observed = Observed(trainer_job(active=1), statefulset(1), queue_workload=admitted("False", evicted=True))
    decision = decide(view_of(queued_doc()), JobStatus(), observed, NOW)
    assert set(decision.delete) == {ChildRef("Job", "demo-trainer"), ChildRef("StatefulSet", "demo-inference")}
    assert decision.create == () and decision.status.phase == "Pending"
    assert condition(decision, names.ADMITTED) == ("False", names.R_EVICTED)
    assert "preempted by x" in decision.status.message


def test_a_finished_job_marks_its_workload_finished():
    observed = Observed(trainer_job(condition="Complete"), statefulset(1), queue_workload=admitted())
    decision = decide(view_of(queued_doc()), JobStatus(), observed, NOW)
    assert decision.status.phase == "Succeeded" and decision.finish_queue_workload
    again = decide(view_of(queued_doc()), decision.status, observed, NOW)
    assert again.finish_queue_workload  # until the Workload says Finished
    done = admitted()
    done["status"]["conditions"].append({"type": "Finished", "status": "True"})
    assert not decide(view_of(queued_doc()), decision.status, Observed(queue_workload=done), NOW).finish_queue_workload
