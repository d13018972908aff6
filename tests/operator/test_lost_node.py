"""A trainer pod on a lost node: its kubelet never confirms the kill, so the pod stays Terminating and, deleted in the
foreground, holds its Job. The restart must not wait for it forever, nor let it answer at rank 0's rendezvous name.

What the real components do, which the emulator plays (grpolora.testing.kube_emulator) and the operator's rule
(grpolora.operator.observe.pod_gone_for_replacement) is measured against:
- The API server marks a bound pod Terminating (deletionTimestamp = the delete plus its grace period) and only the
  kubelet removes it (pkg/registry/core/pod/strategy.go CheckGracefulDelete). A node whose kubelet is gone never does:
  the pod stays until the node object is deleted, the node gets the out-of-service taint (PodGC gcTerminating;
  KEP-3329 sets phase Failed before deleting) or an admin force-deletes it. `Emulator.lost_nodes` plays such a node.
- The garbage collector keeps a Job deleted with propagationPolicy Foreground (finalizer foregroundDeletion) while a
  dependent with blockOwnerDeletion exists (pkg/controller/garbagecollector processDeletingDependentsItem), and a
  Terminating pod exists. JobSet deletes its child Jobs that way before a restart (kubernetes-sigs/jobset#392, #684),
  so it waits for such a pod as well.
- A second DELETE with propagationPolicy Background on an object held by foregroundDeletion makes the API server drop
  that finalizer (staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go, Delete ->
  updateForGracefulDeletionAndFinalizers -> deletionFinalizersForGarbageCollection: both GC finalizers are removed,
  then added back only for Orphan or Foreground); with none left, the object is removed and its name is free.
- The Job controller replaces a pod only once it is terminal when a podFailurePolicy is set (podReplacementPolicy
  Failed, pkg/apis/batch/types.go), so it too would wait for a pod on a lost node.
- A Terminating pod stays in a publishNotReadyAddresses Service's EndpointSlice as ready
  (staging/src/k8s.io/endpointslice/utils.go podToEndpoint: ready := PublishNotReadyAddresses || ...), so the Indexed
  Job's fixed hostname <job>-trainer-0 would resolve to the old pod beside the new one: the operator removes the lost
  pod's job-uid label, which the job's Services select by.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

from grpolora.api import constants as c
from grpolora.api import contract
from grpolora.operator import names
from grpolora.operator.observe import POD_LOST_AFTER_SECONDS
from grpolora.testing.kube_emulator import CRD_RESOURCE as CRD
from grpolora.testing.kube_emulator import Cluster
from tests.helpers import job_doc
from tests.operator.harness import OperatorThread, wait_for
from tests.operator.job_controller_double import JobController

LOST_NODE = "gpu-node-lost"
EXITED_1 = {
    "phase": "Failed",
    "containerStatuses": [{"name": c.ROLE_TRAINER, "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}],
}


def progressing(cluster: Cluster) -> str:
    found = next((k for k in cluster.status("demo").get("conditions") or [] if k["type"] == names.PROGRESSING), {})
    return str(found.get("message", ""))


def trainer_job_status(cluster: Cluster) -> dict:
    return (cluster.get("batch/v1/jobs", "demo-trainer") or {}).get("status") or {}


def trainer_condition(cluster: Cluster, type_: str) -> bool:
    return any(
        k["type"] == type_ and k["status"] == "True" for k in trainer_job_status(cluster).get("conditions") or []
    )


def trainer_jobs_created(cluster: Cluster) -> int:
    return len([k for k in cluster.emulator.created if k[0] == "jobs"])


def clock_at(when: datetime.datetime) -> Callable[[], datetime.datetime]:
    """The operator's clock, set to `when` now and running on from there."""
    start = time.monotonic()
    return lambda: when + datetime.timedelta(seconds=time.monotonic() - start)


def deadline_of(pod: dict) -> datetime.datetime:
    return datetime.datetime.fromisoformat(pod["metadata"]["deletionTimestamp"].replace("Z", "+00:00"))


async def passes_after(cluster: Cluster, count: int) -> None:
    """Wait until the operator has listed the job's pods `count` more times (one list per pass while its trainer Job
    is leaving): the passes that follow a change of the clock have run."""
    before = cluster.emulator.log.count(("list", "pods", None))
    await wait_for(lambda: cluster.emulator.log.count(("list", "pods", None)) >= before + count, f"{count} passes")


async def fail_the_trainer_on_a_lost_node(cluster: Cluster, jobs: JobController) -> tuple[str, dict]:
    """Two trainer ranks; rank 1's node is lost. In the order the real components produce it: the taint manager
    deletes the pod on the unreachable node (NoExecute, after tolerationSeconds; pkg/controller/tainteviction), which
    stays Terminating; rank 0's collective then times out and its container exits 1; the Job controller (played by
    `jobs`, 1.31+ rules) writes FailureTarget BackoffLimitExceeded and never Failed, since a pod still terminates."""
    cluster.emulator.pod_exit_seconds = None  # the containers ignore SIGTERM (NCCL): Terminating for the whole grace
    cluster.emulator.lost_nodes.add(LOST_NODE)
    await cluster.apply(job_doc(trainer={"maxRestarts": 1, "replicas": 2}))
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference"), "the children")
    await cluster.run_pod_of("batch/v1/jobs", "demo-trainer", 0, node="gpu-node-1")
    pod = await cluster.run_pod_of("batch/v1/jobs", "demo-trainer", 1, node=LOST_NODE)
    await cluster.delete_pod(pod)  # the taint manager
    await wait_for(lambda: trainer_job_status(cluster).get("terminating") == 1, "the Job counting the pod terminating")
    survivor = next(name for name in cluster.objects("v1/pods") if name.startswith("demo-trainer-0-"))
    await cluster.set_status("v1/pods", survivor, EXITED_1)
    await wait_for(lambda: trainer_condition(cluster, "FailureTarget"), "FailureTarget on the trainer Job")
    assert not trainer_condition(cluster, "Failed"), "the Job controller wrote Failed while a pod terminates"
    await cluster.emulator.end_grace_periods()  # the kubelet's SIGKILL comes from healthy nodes only
    found = cluster.get("v1/pods", pod)
    assert found is not None, "a lost node's kubelet removed its pod"
    return pod, found


async def test_a_restart_waits_while_the_pod_is_within_its_deadline_and_says_until_when(cluster, jobs, operator):
    """Slow, not lost: while the grace period and the margin after it last, the pod is waited for."""
    pod, found = await fail_the_trainer_on_a_lost_node(cluster, jobs)
    lost_at = deadline_of(found) + datetime.timedelta(seconds=POD_LOST_AFTER_SECONDS)
    await wait_for(lambda: f"pod {pod} Terminating since" in progressing(cluster), "the restart naming the pod")
    assert f"taken as lost at {lost_at.strftime('%Y-%m-%dT%H:%M:%SZ')}" in progressing(cluster)
    assert isinstance(operator, OperatorThread) and operator.controller is not None
    operator.controller.clock = clock_at(lost_at - datetime.timedelta(seconds=5))  # its grace is over, not the margin
    await passes_after(cluster, 3)
    assert trainer_jobs_created(cluster) == 1, "replaced while the pod may still be stopping"
    old_job = cluster.get("batch/v1/jobs", "demo-trainer")
    assert old_job is not None and old_job["metadata"]["finalizers"] == ["foregroundDeletion"]
    assert c.LABEL_JOB_UID in cluster.get("v1/pods", pod)["metadata"]["labels"], "fenced before it was lost"


async def test_a_pod_whose_node_never_confirms_is_taken_as_lost_and_the_job_restarts_and_finishes(
    cluster, jobs, operator
):
    pod, found = await fail_the_trainer_on_a_lost_node(cluster, jobs)
    service = cluster.get("v1/services", "demo-trainer")
    assert service is not None
    selector = service["spec"]["selector"]
    assert all(found["metadata"]["labels"].get(k) == v for k, v in selector.items()), "the old pod in the Service"
    await wait_for(lambda: f"pod {pod} Terminating since" in progressing(cluster), "the restart naming the pod")
    assert operator.controller is not None
    lost_at = deadline_of(found) + datetime.timedelta(seconds=POD_LOST_AFTER_SECONDS)
    operator.controller.clock = clock_at(lost_at + datetime.timedelta(seconds=1))

    await wait_for(lambda: trainer_jobs_created(cluster) == 2, "the replacement trainer Job", timeout=15)
    replacement = cluster.get("batch/v1/jobs", "demo-trainer")
    assert replacement["metadata"]["annotations"][names.RESTART_ATTEMPT_ANNOTATION] == "1"
    # The lost pod is still there (only its node or an admin can remove it), out of the job's Services.
    left = cluster.get("v1/pods", pod)
    assert left is not None and left["metadata"]["deletionTimestamp"]
    assert not all(left["metadata"]["labels"].get(k) == v for k, v in selector.items()), "still in the Service"
    assert ("delete", "jobs", "demo-trainer") in cluster.emulator.log
    lost_events = [m for _, reason, m in cluster.events("demo") if reason == names.E_TRAINER_POD_LOST]
    assert lost_events and f"pod {pod} Terminating since" in lost_events[0]
    assert f"taken as lost at {lost_at.strftime('%Y-%m-%dT%H:%M:%SZ')}" in lost_events[0]

    # The replacement's two ranks run and complete (the Job controller writes SuccessCriteriaMet, then Complete):
    # the job finishes.
    for rank in (0, 1):
        done = await cluster.run_pod_of("batch/v1/jobs", "demo-trainer", rank, node="gpu-node-1")
        await cluster.set_status("v1/pods", done, {"phase": "Succeeded"})
    await wait_for(lambda: cluster.status("demo").get("phase") == "Succeeded", "the job Succeeded")
    assert cluster.status("demo")["trainerRestarts"] == 1


async def test_one_rank_on_a_lost_node_restarts_the_trainer_once_the_pod_is_past_its_lost_deadline(
    cluster, jobs, operator
):
    """One rank: the Job controller shows active 0, terminating 1 and no condition for as long as the pod stays
    (no pod is terminal, so neither the backoff limit nor the podFailurePolicy's DisruptionTarget rule, which only
    terminal pods are matched against, ever fires). The operator takes its current trainer's pod as lost once past
    its lost deadline, and restarts the trainer as after a disruption."""
    cluster.emulator.pod_exit_seconds = None
    cluster.emulator.lost_nodes.add(LOST_NODE)
    await cluster.apply(job_doc(trainer={"maxRestarts": 0}))
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference"), "the children")
    pod = await cluster.run_pod_of("batch/v1/jobs", "demo-trainer", node=LOST_NODE)
    await cluster.delete_pod(pod)  # the taint manager
    await wait_for(lambda: trainer_job_status(cluster).get("terminating") == 1, "the Job counting the pod terminating")
    found = cluster.get("v1/pods", pod)
    assert found is not None
    lost_at = deadline_of(found) + datetime.timedelta(seconds=POD_LOST_AFTER_SECONDS)
    assert operator.controller is not None
    operator.controller.clock = clock_at(lost_at - datetime.timedelta(seconds=5))
    await passes_after(cluster, 3)
    assert trainer_jobs_created(cluster) == 1 and not cluster.status("demo").get("trainerRestarts")
    assert trainer_job_status(cluster) == {**trainer_job_status(cluster), "active": 0, "terminating": 1}
    assert not any(k["status"] == "True" for k in trainer_job_status(cluster).get("conditions") or [])

    operator.controller.clock = clock_at(lost_at + datetime.timedelta(seconds=1))
    await wait_for(lambda: trainer_jobs_created(cluster) == 2, "the replacement trainer Job", timeout=15)
    replacement = cluster.get("batch/v1/jobs", "demo-trainer")
    assert replacement["metadata"]["annotations"][names.RESTART_ATTEMPT_ANNOTATION] == "1"
    status = cluster.status("demo")
    assert status["trainerRestarts"] == 1 and status["restartsByCause"]["disruption"] == 1, status
    await passes_after(cluster, 3)
    assert trainer_jobs_created(cluster) == 2, "restarted again for the same lost pod"
    done = await cluster.run_pod_of("batch/v1/jobs", "demo-trainer", node="gpu-node-1")
    await cluster.set_status("v1/pods", done, {"phase": "Succeeded"})
    await wait_for(lambda: cluster.status("demo").get("phase") == "Succeeded", "the job Succeeded")


async def test_a_fenced_trainer_is_replaced_without_spending_a_restart(cluster, jobs, operator):
    """A trainer that the inference replicas refuse as older than the newest incarnation they saw stops with
    contract.EXIT_FENCED (workers/trainer/main.py exit_code). The trainer Job's podFailurePolicy has a FailJob rule for
    that code, so the Job controller writes FailureTarget, PodFailurePolicy, naming the rule's index
    (pod_failure_policy.go getFailJobMessage), and the operator reads it as no crash: with maxRestarts 0 the job is
    not Failed; a new trainer Job comes with the next incarnation, the restart counted as a disruption."""
    await cluster.apply(job_doc(trainer={"maxRestarts": 0}))
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference"), "the children")
    pod = await cluster.run_pod_of("batch/v1/jobs", "demo-trainer", node="gpu-node-1")
    fenced = {
        "phase": "Failed",
        "containerStatuses": [
            {"name": c.ROLE_TRAINER, "state": {"terminated": {"exitCode": contract.EXIT_FENCED, "reason": "Error"}}}
        ],
    }
    await cluster.set_status("v1/pods", pod, fenced)
    await wait_for(lambda: trainer_condition(cluster, "FailureTarget"), "FailureTarget on the trainer Job")
    assert "matching FailJob rule at index" in next(
        k["message"] for k in trainer_job_status(cluster)["conditions"] if k["type"] == "FailureTarget"
    )
    await wait_for(lambda: trainer_jobs_created(cluster) == 2, "the replacement trainer Job")
    status = cluster.status("demo")
    assert status["phase"] != "Failed", status["message"]
    assert status["restartsByCause"] == {"failure": 0, "disruption": 1}
    replacement = cluster.get("batch/v1/jobs", "demo-trainer")
    assert replacement["metadata"]["annotations"][names.INCARNATION_ANNOTATION] == "1"
    await passes_after(cluster, 2)
    assert cluster.status("demo")["phase"] != "Failed"


async def test_an_inference_statefulset_held_by_a_lost_pod_is_released_on_resume(cluster, operator):
    """Suspend deletes the StatefulSet in the foreground; a server pod on a lost node holds it there (the garbage
    collector waits for a dependent with blockOwnerDeletion that still exists: a Terminating pod does). On resume the
    job wanted a StatefulSet, saw one (leaving) and created none: it ran with no replicas at all, not one short.
    Released as the trainer's lost pods are: once the pod is past its lost deadline, deleted again in the Background
    (the API server drops foregroundDeletion), and a new StatefulSet is created. Its pod of the lost one's name waits
    for that name, as a StatefulSet does; the others run."""
    cluster.emulator.lost_nodes.add(LOST_NODE)
    await cluster.apply(job_doc(inference={"replicas": 2}))
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference"), "the children")
    await cluster.run_pod_of("batch/v1/jobs", "demo-trainer", node="gpu-node-1")
    lost = await cluster.run_pod_of("apps/v1/statefulsets", "demo-inference", 0, node=LOST_NODE)
    await cluster.run_pod_of("apps/v1/statefulsets", "demo-inference", 1, node="gpu-node-2")
    await cluster.patch_spec("demo", {"suspend": True})
    await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer") is None, "the trainer Job gone")
    await wait_for(lambda: (cluster.get("v1/pods", lost) or {}).get("metadata", {}).get("deletionTimestamp"), "lost")
    found = cluster.get("v1/pods", lost)
    assert found is not None
    lost_at = deadline_of(found) + datetime.timedelta(seconds=POD_LOST_AFTER_SECONDS)
    held = cluster.get("apps/v1/statefulsets", "demo-inference")
    assert held is not None and held["metadata"]["finalizers"] == ["foregroundDeletion"]

    assert operator.controller is not None
    operator.controller.clock = clock_at(lost_at - datetime.timedelta(seconds=5))
    await cluster.patch_spec("demo", {"suspend": False})
    await wait_for(lambda: trainer_jobs_created(cluster) == 2, "the trainer Job again")
    await passes_after(cluster, 3)
    assert len([k for k in cluster.emulator.created if k[0] == "statefulsets"]) == 1, "released while not lost"

    operator.controller.clock = clock_at(lost_at + datetime.timedelta(seconds=1))
    await wait_for(
        lambda: len([k for k in cluster.emulator.created if k[0] == "statefulsets"]) == 2, "a new StatefulSet"
    )
    fresh = cluster.get("apps/v1/statefulsets", "demo-inference")
    assert fresh is not None and not fresh["metadata"].get("deletionTimestamp")
    assert cluster.get("v1/pods", lost) is not None, "only its node or an admin removes the lost pod"
    assert c.LABEL_JOB_UID not in cluster.get("v1/pods", lost)["metadata"]["labels"], "still in the Services"


async def test_a_job_deleted_in_the_foreground_is_not_held_for_ever_by_a_lost_pod(cluster, operator):
    """`kubectl delete glj demo --cascade=foreground` (Argo CD deletes so): the garbage collector deletes the trainer
    Job in the foreground too (its owner waits for it, and it has dependents), and a trainer pod on a lost node holds
    it, so the job's deletion hung for as long as the node object stayed. Being deleted, the job creates nothing, but
    its workloads held by lost pods are released as on a restart: once past the lost deadline, deleted again in the
    Background; the collector then finishes the job's removal."""
    cluster.emulator.lost_nodes.add(LOST_NODE)
    await cluster.apply(job_doc())
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference"), "the children")
    pod = await cluster.run_pod_of("batch/v1/jobs", "demo-trainer", node=LOST_NODE)
    await cluster.delete_job("demo", cascade="Foreground")
    await wait_for(lambda: (cluster.get("v1/pods", pod) or {}).get("metadata", {}).get("deletionTimestamp"), "lost")
    found = cluster.get("v1/pods", pod)
    assert found is not None
    lost_at = deadline_of(found) + datetime.timedelta(seconds=POD_LOST_AFTER_SECONDS)
    assert operator.controller is not None
    operator.controller.clock = clock_at(lost_at - datetime.timedelta(seconds=5))
    before = operator.passes()
    await wait_for(lambda: operator.passes() >= before + 3, "passes of the job being deleted")
    assert cluster.get(CRD, "demo") is not None and cluster.get("batch/v1/jobs", "demo-trainer") is not None

    operator.controller.clock = clock_at(lost_at + datetime.timedelta(seconds=1))
    await wait_for(lambda: cluster.get(CRD, "demo") is None, "the job removed", timeout=15)
    assert cluster.get("batch/v1/jobs", "demo-trainer") is None
    assert trainer_jobs_created(cluster) == 1, "a deleted job created a trainer Job"
