"""Kueue (played by the test): a queued job's pods exist only while Kueue admits its Workload, both pools at once."""

from __future__ import annotations

from grpolora.api import constants as c
from grpolora.operator import names
from grpolora.testing.kube_emulator import NAMESPACE
from tests.helpers import job_doc
from tests.operator.harness import wait_for
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


FLAVORS_PATH = "/apis/kueue.x-k8s.io/v1beta1/resourceflavors"
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


async def add_flavor(cluster, name: str, node_labels: dict[str, str], tolerations: list | None = None) -> None:
    """A ResourceFlavor (cluster-scoped), as the platform team creates it."""
    spec = {"nodeLabels": node_labels, "tolerations": tolerations or []}
    doc = {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ResourceFlavor", "metadata": {"name": name}, "spec": spec}
    await cluster._call("POST", FLAVORS_PATH, doc)


async def admit_to(cluster, trainer: str, inference: str) -> None:
    """Kueue admits the Workload: each pod set's GPUs from a ResourceFlavor (the status write Kueue makes)."""
    path = f"/apis/kueue.x-k8s.io/v1beta1/namespaces/{NAMESPACE}/workloads/demo/status"
    assignments = [
        {"name": "trainer", "flavors": {"nvidia.com/gpu": trainer, "cpu": "default"}, "count": 1},
        {"name": "inference", "flavors": {"nvidia.com/gpu": inference}, "count": 1},
    ]
    admitted = {"type": "Admitted", "status": "True", "reason": "Admitted", "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z"}  # fmt: skip
    status = {"admission": {"clusterQueue": "cq", "podSetAssignments": assignments}, "conditions": [admitted]}
    await cluster._call("PATCH", path, {"status": status})


def pod_spec(cluster, resource: str, name: str) -> dict:
    return cluster.get(resource, name)["spec"]["template"]["spec"]


async def test_the_admitted_flavors_reach_the_trainer_and_inference_pods(cluster, operator):
    await add_flavor(cluster, "default", {})
    await add_flavor(cluster, "h100", {"gpu.example.com/pool": "h100"}, [GPU_TAINT])
    await add_flavor(cluster, "l4", {"gpu.example.com/pool": "l4"})
    doc = job_doc(trainer={"nodeSelector": {"topology.kubernetes.io/zone": "a"}})
    doc["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "gpu-queue"}
    await cluster.apply(doc)
    await wait_for(lambda: cluster.get(WORKLOADS, "demo") is not None, "the Kueue Workload")
    await admit_to(cluster, trainer="h100", inference="l4")
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference") is not None, "the workloads")
    trainer = pod_spec(cluster, "batch/v1/jobs", "demo-trainer")
    assert trainer["nodeSelector"] == {"topology.kubernetes.io/zone": "a", "gpu.example.com/pool": "h100"}
    assert trainer["tolerations"] == [GPU_TAINT]
    inference = pod_spec(cluster, "apps/v1/statefulsets", "demo-inference")
    assert inference["nodeSelector"] == {"gpu.example.com/pool": "l4"} and "tolerations" not in inference
    assert (
        cluster.get("apps/v1/statefulsets", "demo-inference")["spec"]["template"]["metadata"]["labels"][
            "kueue.x-k8s.io/podset"
        ]
        == "inference"
    )
    # The Workload keeps the templates as rendered (Kueue compares them with the pods' owners' on its own side).
    assert "gpu.example.com/pool" not in str(cluster.get(WORKLOADS, "demo")["spec"])

    # Evicted, then admitted elsewhere: the new pods follow the new flavors, nothing is left of the old ones.
    evicted = {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "by job x",
               "lastTransitionTime": "2026-01-01T00:00:00Z"}  # fmt: skip
    await admit(cluster, [{"type": "Admitted", "status": "False", "reason": "Pending"}, evicted])
    await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer") is None, "trainer released")
    await admit_to(cluster, trainer="l4", inference="h100")
    await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer") is not None, "the trainer again")
    trainer = pod_spec(cluster, "batch/v1/jobs", "demo-trainer")
    assert trainer["nodeSelector"] == {"topology.kubernetes.io/zone": "a", "gpu.example.com/pool": "l4"}
    assert "tolerations" not in trainer


async def test_a_flavor_that_contradicts_the_node_selector_fails_the_job_and_finishes_the_workload(cluster, operator):
    await add_flavor(cluster, "default", {})
    await add_flavor(cluster, "h100", {"gpu.example.com/pool": "h100"})
    doc = job_doc(trainer={"nodeSelector": {"gpu.example.com/pool": "a100"}})
    doc["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "gpu-queue"}
    await cluster.apply(doc)
    await wait_for(lambda: cluster.get(WORKLOADS, "demo") is not None, "the Kueue Workload")
    await admit_to(cluster, trainer="h100", inference="h100")
    await wait_for(lambda: phase(cluster) == "Failed", "Failed")
    assert cluster.condition("demo", names.FAILED)["reason"] == names.R_FAILED_TO_START
    assert cluster.get("batch/v1/jobs", "demo-trainer") is None
    assert cluster.get("apps/v1/statefulsets", "demo-inference") is None
    await wait_for(lambda: [e for e in cluster.events("demo") if e[1] == "Failed"], "the Failed event")
    (event,) = [e for e in cluster.events("demo") if e[1] == "Failed"]
    assert event[0] == "Warning" and "a100" in event[2] and "h100" in event[2]
    finished = lambda: [x for x in cluster.get(WORKLOADS, "demo")["status"]["conditions"] if x["type"] == "Finished"]  # noqa: E731
    (condition,) = await wait_for(finished, "the Workload marked Finished")
    assert condition["reason"] == "FailedToStart"
