"""Kueue (played by the test): a queued job's pods exist only while Kueue admits its Workload, both pools at once."""

from __future__ import annotations

from grpolora.api import constants as c
from grpolora.operator import names
from tests.helpers import job_doc
from tests.operator.harness import NAMESPACE, wait_for
from tests.operator.test_operator import phase

WORKLOADS = "kueue.x-k8s.io/v1beta1/workloads"


async def admit(cluster, conditions: list[dict]) -> None:
    path = f"/apis/kueue.x-k8s.io/v1beta1/namespaces/{NAMESPACE}/workloads/demo/status"
    stamped = [{"lastTransitionTime": "2026-01-01T00:00:00Z", "message": "", **cond} for cond in conditions]
    await cluster._call("PATCH", path, {"status": {"conditions": stamped}})


async def test_a_queued_job_runs_only_while_kueue_admits_both_pools(cluster, operator):
    doc = job_doc(inference={"replicas": 2})
    doc["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "gpu-queue"}
    await cluster.apply(doc)
    await wait_for(lambda: cluster.get(WORKLOADS, "demo") is not None, "the Kueue Workload")
    pod_sets = cluster.get(WORKLOADS, "demo")["spec"]["podSets"]
    assert [(p["name"], p["count"]) for p in pod_sets] == [("trainer", 1), ("inference", 2)]
    await wait_for(lambda: cluster.condition("demo", names.ADMITTED).get("reason") == names.R_QUEUED, "Queued")
    assert cluster.get("batch/v1/jobs", "demo-trainer") is None
    assert cluster.get("apps/v1/statefulsets", "demo-inference") is None

    await admit(cluster, [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved"},
                          {"type": "Admitted", "status": "True", "reason": "Admitted"}])  # fmt: skip
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference") is not None, "the workloads")
    assert cluster.get("batch/v1/jobs", "demo-trainer") is not None

    evicted = {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "by job x"}
    await admit(cluster, [{"type": "Admitted", "status": "False", "reason": "Pending"}, evicted])
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference") is None, "inference released")
    await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer") is None, "trainer released")
    # The workloads go before the status that says why is written (deletes come first in a pass).
    await wait_for(lambda: "by job x" in cluster.status("demo")["message"], "the eviction in the message")
    assert phase(cluster) == "Pending"

    await admit(cluster, [{"type": "Admitted", "status": "True", "reason": "Admitted"}])
    await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer") is not None, "the trainer again")
    await cluster.set_status(
        "batch/v1/jobs", "demo-trainer", {"conditions": [{"type": "Complete", "status": "True", "reason": "Done"}]}
    )
    await wait_for(lambda: phase(cluster) == "Succeeded", "Succeeded")
    finished = lambda: [x for x in cluster.get(WORKLOADS, "demo")["status"]["conditions"] if x["type"] == "Finished"]  # noqa: E731
    await wait_for(finished, "the Workload marked Finished")
    kinds = [x["type"] for x in cluster.get(WORKLOADS, "demo")["status"]["conditions"]]
    assert kinds == ["Admitted", "Finished"], "Kueue's own conditions are kept"
