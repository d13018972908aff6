"""Kueue (played by tests/operator/kueue_double.py, which does only what Kueue itself does): a queued job's pods exist
only while Kueue admits its Workload, both pools at once; on eviction the operator gives the quota back, as Kueue's
own job integrations do, so that the preemptor is admitted and the evicted job queues again."""

from __future__ import annotations

import asyncio
import datetime

from grpolora.api import constants as c
from grpolora.operator import names
from grpolora.testing.kube_emulator import NAMESPACE, running_cluster
from tests.helpers import job_doc
from tests.operator.harness import OperatorThread, a_pass, operator_options, wait_for
from tests.operator.job_controller_double import JobController
from tests.operator.kueue_double import REGISTERED, FakeKueue, find, is_true
from tests.operator.test_lost_node import clock_at
from tests.operator.test_operator import phase

WORKLOADS = "kueue.x-k8s.io/v1beta1/workloads"


def queued(name: str = "demo", **spec) -> dict:
    doc = job_doc(**spec)
    doc["metadata"]["name"] = name
    doc["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "gpu-queue"}
    return doc


async def complete(cluster, job: str) -> None:
    """The Job controller: the trainer Job completed."""
    await cluster.set_status(
        "batch/v1/jobs", f"{job}-trainer", {"conditions": [{"type": "Complete", "status": "True", "reason": "Done"}]}
    )


async def test_a_queued_job_runs_only_while_kueue_admits_both_pools(cluster, operator):
    async with FakeKueue(cluster) as kueue:
        await cluster.apply(queued(inference={"replicas": 2}))
        await wait_for(lambda: kueue.workload("demo") is not None, "the Kueue Workload")
        pod_sets = kueue.workload("demo")["spec"]["podSets"]
        assert [(p["name"], p["count"]) for p in pod_sets] == [("trainer", 1), ("inference", 2)]
        await wait_for(lambda: cluster.condition("demo", names.ADMITTED).get("reason") == names.R_QUEUED, "Queued")
        assert cluster.get("batch/v1/jobs", "demo-trainer") is None
        assert cluster.get("apps/v1/statefulsets", "demo-inference") is None

        await kueue.admit("demo")
        await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference") is not None, "the workloads")
        assert cluster.get("batch/v1/jobs", "demo-trainer") is not None
        await complete(cluster, "demo")
        await wait_for(lambda: phase(cluster) == "Succeeded", "Succeeded")
        finished = await wait_for(lambda: find(kueue.workload("demo"), "Finished"), "the Workload marked Finished")
        assert (finished["status"], finished["reason"]) == ("True", "Succeeded")
        kinds = [x["type"] for x in kueue.workload("demo")["status"]["conditions"]]
        assert {"QuotaReserved", "Admitted", "Finished"} <= set(kinds), "Kueue's own conditions are kept"


async def test_an_evicted_job_gives_its_quota_back_so_the_preemptor_runs_and_it_is_admitted_again(cluster, operator):
    """Kueue only sets Evicted; the integration, once the job's pods are gone, clears the admission, sets
    QuotaReserved False and Requeued (True for a preemption): pkg/controller/jobframework/reconciler.go, "handle
    eviction". Without that the Workload holds its quota for ever and the preemptor is never admitted."""
    async with FakeKueue(cluster, capacity=1) as kueue:  # quota for one job at a time
        await cluster.apply(queued("demo"))
        await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer"), "demo admitted and started")
        # A job of a higher priority (another integration's, e.g. a batch Job) comes and preempts it.
        await kueue.add_workload("urgent", priority=100)
        await kueue.preempt("demo", by="urgent")
        await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference") is None, "inference released")
        await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer") is None, "trainer released")
        # The quota goes back: Kueue admits the preemptor.
        await wait_for(lambda: kueue.admissions == ["demo", "urgent"], "the preemptor admitted")
        workload = kueue.workload("demo")
        assert "admission" not in workload["status"]
        quota, requeued = find(workload, "QuotaReserved"), find(workload, "Requeued")
        assert (quota["status"], quota["reason"]) == ("False", "Pending")
        assert quota["message"] == find(workload, "Evicted")["message"]
        assert (requeued["status"], requeued["reason"]) == ("True", "Preempted")
        assert find(workload, "Admitted")["status"] == "False"
        assert find(workload, "Evicted")["status"] == "True", "Evicted is Kueue's to reset, at the next admission"
        await wait_for(lambda: "admitted again" in cluster.status("demo").get("message", ""), "demo waits again")
        assert phase(cluster) == "Pending" and "prioritization in the ClusterQueue" in cluster.status("demo")["message"]
        admitted = cluster.condition("demo", names.ADMITTED)
        assert (admitted["status"], admitted["reason"]) == ("False", names.R_EVICTED)

        # The preemptor finishes, its quota goes back, and the evicted job is admitted and runs again.
        await kueue.finish("urgent")
        await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer"), "demo admitted again and restarted")
        assert kueue.admissions == ["demo", "urgent", "demo"]
        await wait_for(lambda: cluster.condition("demo", names.ADMITTED).get("status") == "True", "demo Admitted")
        assert find(kueue.workload("demo"), "Evicted")["status"] == "False"


async def test_pods_ready_is_written_so_kueues_wait_for_pods_ready_evicts_only_jobs_whose_pods_are_not_ready(
    cluster, operator
):
    """Kueue's waitForPodsReady evicts an admitted Workload whose PodsReady condition is not True in time; the
    integration writes that condition (jobframework/reconciler.go generatePodsReadyCondition)."""
    async with FakeKueue(cluster, capacity=1, pods_ready_timeout=0.5) as kueue:
        await cluster.apply(queued("demo"))
        await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer"), "demo admitted and started")
        ready = await wait_for(lambda: find(kueue.workload("demo"), "PodsReady"), "PodsReady written")
        assert (ready["status"], ready["reason"]) == ("False", "WaitForStart")
        # The pods do not get ready in time: evicted, released, requeued after Kueue's backoff, admitted again.
        await wait_for(lambda: kueue.timed_out == ["demo"], "the PodsReady timeout")
        # The second time the pods get ready in time. The test plays the clock: the timeout is stretched while it
        # makes them ready (on a loaded machine the operator's write could come later than 0.5 s), and shortened
        # again once PodsReady is True on the Workload.
        kueue.pods_ready_timeout = 3600.0
        await wait_for(lambda: kueue.admissions == ["demo", "demo"], "admitted again after the backoff")
        requeued = find(kueue.workload("demo"), "Requeued")
        assert (requeued["status"], requeued["reason"]) == ("True", "BackoffFinished")
        await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer"), "started again")

        # Now they do: PodsReady True from the same counts as the job's own PodsReady, and no eviction.
        await cluster.set_status("batch/v1/jobs", "demo-trainer", {"active": 1, "ready": 1})
        await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference"), "the inference StatefulSet")
        await cluster.set_status("apps/v1/statefulsets", "demo-inference", {"readyReplicas": 1})
        await wait_for(lambda: cluster.condition("demo", names.PODS_READY).get("status") == "True", "pods ready")
        await wait_for(lambda: is_true(kueue.workload("demo"), "PodsReady"), "PodsReady True on the Workload")
        kueue.pods_ready_timeout = 0.5
        await wait_for(lambda: kueue.ready_in_time == ["demo"], "the timeout passed with the pods ready")
        ready = find(kueue.workload("demo"), "PodsReady")
        assert (ready["status"], ready["reason"]) == ("True", "Started")
        assert kueue.timed_out == ["demo"] and cluster.get("batch/v1/jobs", "demo-trainer") is not None


async def test_a_workload_status_write_never_overwrites_what_kueue_wrote_since_it_was_read(cluster, kueue):
    """The operator's status patch replaces the Workload's whole conditions list (a merge patch replaces lists), so it
    carries the resourceVersion it was decided from: a Kueue write in between makes it a 409 (the emulator answers as
    the API server does), the pass drops its cached Workload and decides again from a fresh read."""
    import kopf

    from grpolora.api.status import JobStatus
    from grpolora.operator import kube
    from grpolora.operator import kueue as integration
    from grpolora.operator.controller import Controller
    from grpolora.operator.reconcile import Decision
    from grpolora.operator.scheduler import Tracked

    await kueue.add_workload("demo", priority=0)
    await kueue.admit("demo")
    client = kube.KubeClient(lambda: kopf.ConnectionInfo(server=cluster.url))
    controller = Controller(client, trainer=None, metrics=None)  # type: ignore[arg-type]
    job = Tracked(NAMESPACE, "demo", "uid", {}, {})
    try:
        read = await client.get(kube.KUEUE_WORKLOAD, NAMESPACE, "demo")
        controller._remember(("Workload", NAMESPACE, "demo"), read, read)
        finished = integration.integration_write(
            read, now="2026-01-01T00:00:00Z", inactive=True, pods_ready=False, finished=("Succeeded", "done"),
            suspended=False,
        )  # fmt: skip
        await kueue.evict("demo", "Preempted", "meanwhile")  # Kueue writes after the operator read
        assert not await controller._write_queue_workload(job, Decision(JobStatus(), queue_workload_write=finished))
        assert ("Workload", NAMESPACE, "demo") not in controller.cache, "read again by the next pass"
        assert find(kueue.workload("demo"), "Evicted")["message"] == "meanwhile" and not find(
            kueue.workload("demo"), "Finished"
        )  # fmt: skip

        fresh = await client.get(kube.KUEUE_WORKLOAD, NAMESPACE, "demo")
        again = integration.integration_write(
            fresh, now="2026-01-01T00:00:00Z", inactive=True, pods_ready=False, finished=("Succeeded", "done"),
            suspended=False,
        )  # fmt: skip
        assert await controller._write_queue_workload(job, Decision(JobStatus(), queue_workload_write=again))
        assert find(kueue.workload("demo"), "Finished")["status"] == "True"
        assert find(kueue.workload("demo"), "Evicted")["message"] == "meanwhile", "Kueue's write is kept"
    finally:
        await client.close()


async def test_a_workload_kueue_deactivated_after_too_many_requeues_is_shown_so(cluster, operator):
    """waitForPodsReady's requeuingStrategy.backoffLimitCount: past it Kueue deactivates the Workload (reason
    RequeuingLimitExceeded); the job then says so and how to reactivate it, not that it waits to be admitted again."""
    async with FakeKueue(cluster, capacity=1, pods_ready_timeout=0.3, requeuing_limit=0) as kueue:
        await cluster.apply(queued("demo"))
        await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer"), "demo admitted and started")
        await wait_for(lambda: kueue.workload("demo")["spec"].get("active") is False, "deactivated by Kueue")
        await wait_for(lambda: "admission" not in kueue.workload("demo")["status"], "the quota given back")
        await wait_for(lambda: cluster.condition("demo", names.ADMITTED).get("reason") == names.R_DEACTIVATED, "shown")
        message = cluster.status("demo")["message"]
        assert (
            "RequeuingLimitExceeded" in message and "spec.active" in message and "to be admitted again" not in message
        )
        # The quota goes back once no pod is active (6bd0807), which can be shown before the deleted Job has left the
        # API (its foreground deletion waits for the pods): wait for it to go rather than catch it gone at once.
        await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer") is None, "the trainer Job deleted")
        assert kueue.workload("demo")["spec"]["active"] is False, "the operator does not undo Kueue's deactivation"


async def test_under_manage_jobs_without_queue_name_the_trainer_job_runs_only_with_the_kind_registered(
    cluster, operator
):
    """Kueue's Job webhook suspends a Job whose owner's kind it does not know (and queues it a second time);
    listing GRPOLoraJob in integrations.externalFrameworks makes the GRPOLoraJob its Kueue-managed ancestor."""
    async with FakeKueue(cluster, manage_jobs_without_queue_name=True) as kueue:  # nothing registered
        await cluster.apply(queued("demo"))
        await wait_for(lambda: kueue.workload("demo"), "the Workload")
        await kueue.admit("demo")
        await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer"), "the trainer Job")
        assert cluster.get("batch/v1/jobs", "demo-trainer")["spec"]["suspend"] is True
        await wait_for(lambda: "integrations.externalFrameworks" in cluster.status("demo")["message"], "the reason")
        assert REGISTERED[0] in cluster.status("demo")["message"]
        reason = cluster.condition("demo", names.PODS_READY)["reason"]
        assert reason == names.R_TRAINER_JOB_SUSPENDED
        await cluster.delete_job("demo")
    await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer") is None, "demo's children collected")

    async with FakeKueue(cluster, manage_jobs_without_queue_name=True, external_frameworks=REGISTERED) as kueue:
        await cluster.apply(queued("registered"))
        await wait_for(lambda: kueue.workload("registered"), "the Workload")
        await kueue.admit("registered")
        await wait_for(lambda: cluster.get("batch/v1/jobs", "registered-trainer"), "the trainer Job")
        await wait_for(lambda: cluster.get("apps/v1/statefulsets", "registered-inference"), "the StatefulSet")
        await kueue.tick()  # the Job reconciler has looked at it: its ancestor's Workload is admitted
        assert not cluster.get("batch/v1/jobs", "registered-trainer")["spec"].get("suspend"), kueue.suspended_jobs
        assert kueue.suspended_jobs == []

        # A job without a queue label there: Kueue holds its trainer (its managed owner has no Workload).
        unqueued = job_doc()
        unqueued["metadata"]["name"] = "unqueued"
        await cluster.apply(unqueued)
        await wait_for(lambda: kueue.suspended_jobs == ["unqueued-trainer"], "Kueue suspends the trainer Job")
        await wait_for(lambda: "queue-name" in cluster.status("unqueued").get("message", ""), "the reason")


async def test_with_the_kind_registered_kueue_must_be_able_to_read_it(cluster, operator):
    """Registered in integrations.externalFrameworks, GRPOLoraJob is read by Kueue's Job webhook through Kueue's own
    client (FindAncestorJobManagedByKueue); Kueue's ClusterRole has no rule for grpolora.dev, so without the grant
    the chart binds to Kueue's account (grpolora.operator.rbac.KUEUE_READS) the webhook refuses every trainer Job.
    The test with the grant is the one above (the registered job runs)."""
    async with FakeKueue(cluster, external_frameworks=REGISTERED, kueue_rbac=()) as kueue:  # no grant
        await cluster.apply(queued("demo"))
        await wait_for(lambda: kueue.workload("demo"), "the Workload")
        await kueue.admit("demo")
        failed = await wait_for(
            lambda: cluster.condition("demo", names.FAILED).get("reason") == names.R_CREATE_REFUSED, "refused"
        )
        assert failed
        message = cluster.status("demo")["message"]
        assert 'cannot get resource "grpolorajobs" in API group "grpolora.dev"' in message, message
        assert "system:serviceaccount:kueue-system:kueue-controller-manager" in message
        assert kueue.webhook_refusals and cluster.get("batch/v1/jobs", "demo-trainer") is None


async def test_a_refused_create_under_kueue_stays_failed_until_the_spec_changes(cluster, operator):
    """A create refused by the API server (here Kueue's own Job webhook, which cannot read the job) ends the job:
    Failed, its Workload Finished (FailedToStart), as Kueue's jobframework marks a Workload Finished for a job that
    finished. Kueue never admits a Finished Workload again (pkg/workload/workload.go IsAdmissible) and the
    integration keeps it (reconciler.go ensureOneWorkload deletes only a Workload that no longer matches its job).
    The refusal is known only from the create, so the job must not take its own Finished Workload for a fixed spec:
    that deleted it, queued a new one, got it admitted (possibly preempting others) and was refused again, every few
    seconds. Walked over 40 s of the operator's clock, with passes forced by a metadata change; only a spec change
    (a generation past the failure's) runs it again."""
    async with FakeKueue(cluster, capacity=1, external_frameworks=REGISTERED, kueue_rbac=()) as kueue:
        await cluster.apply(queued("demo"))
        await wait_for(
            lambda: cluster.condition("demo", names.FAILED).get("reason") == names.R_CREATE_REFUSED, "Failed"
        )
        await wait_for(lambda: is_true(kueue.workload("demo"), "Finished"), "the Workload marked Finished")
        assert operator.controller is not None
        start = datetime.datetime.now(datetime.UTC)
        for seconds in (10, 20, 30, 40):
            operator.controller.clock = clock_at(start + datetime.timedelta(seconds=seconds))
            # An event on the job's Workload (Kueue writes its Workloads for its own reasons) wakes a pass; the job's
            # spec is unchanged.
            before = operator.passes()
            touch = {"metadata": {"annotations": {"touched": str(seconds)}}}
            await cluster._call("PATCH", f"/apis/kueue.x-k8s.io/v1beta1/namespaces/{NAMESPACE}/workloads/demo", touch)
            await wait_for(lambda b=before: operator.passes() > b, "a pass of the operator")
            await asyncio.sleep(0.5)  # Kueue's double ticks every 0.05 s: time for a re-admission, were one asked
            assert phase(cluster) == "Failed", cluster.status("demo")
            created = [k for k in cluster.emulator.created if k[0] == "workloads"]
            assert len(created) == 1 and len(kueue.workloads()) == 1, created
            assert kueue.admissions == ["demo"] and len(kueue.webhook_refusals) == 1

        # A spec change runs it again: a new Workload, admitted, and (still refused) Failed again at that generation.
        await cluster.patch_spec("demo", {"trainer": {"maxRestarts": 5}})
        await wait_for(lambda: len(kueue.webhook_refusals) == 2, "a second run")
        await wait_for(lambda: phase(cluster) == "Failed", "Failed again")
        assert len(kueue.admissions) == 2


async def test_a_suspended_job_neither_holds_nor_takes_quota_and_queues_again_when_resumed(cluster, operator):
    """The operator deactivates the Workload of a suspended job (spec.active false, as Kueue's integrations with
    custom activation do: jobframework/reconciler.go JobWithCustomWorkloadActivation); Kueue evicts it
    (Deactivated), the operator gives the quota back, and reactivates it when the job resumes."""
    async with FakeKueue(cluster, capacity=1) as kueue:
        await cluster.apply(queued("demo", suspend=True))  # created suspended, before the other job
        await wait_for(lambda: kueue.workload("demo"), "demo's Workload")
        assert kueue.workload("demo")["spec"]["active"] is False
        await cluster.apply(queued("other"))
        await wait_for(lambda: cluster.get("batch/v1/jobs", "other-trainer"), "other admitted and started")
        assert kueue.admissions == ["other"] and phase(cluster) == "Suspended"

        await cluster.patch_spec("demo", {"suspend": False})  # waits: other holds the quota
        await wait_for(lambda: kueue.workload("demo")["spec"].get("active") is True, "demo's Workload reactivated")
        await wait_for(lambda: cluster.condition("demo", names.ADMITTED).get("reason") == names.R_QUEUED, "queued")

        await cluster.patch_spec("other", {"suspend": True})  # gives its quota back: demo runs
        await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer"), "demo admitted and started")
        assert kueue.admissions == ["other", "demo"]
        workload = kueue.workload("other")
        assert workload["spec"]["active"] is False and "admission" not in workload["status"]
        assert find(workload, "Evicted")["reason"] == "Deactivated"
        assert (find(workload, "Requeued")["status"], find(workload, "Requeued")["reason"]) == ("False", "Deactivated")
        assert phase(cluster, "other") == "Suspended"

        await cluster.patch_spec("other", {"suspend": False})
        requeued = lambda: find(kueue.workload("other"), "Requeued")  # noqa: E731
        await wait_for(lambda: requeued()["reason"] == "Reactivated", "other reactivated and requeued")
        await wait_for(lambda: cluster.condition("other", names.ADMITTED).get("status") == "False", "other waits")
        # No live trainer Job for a job that waits: the one its suspension deleted (in the foreground) may still be
        # held by the garbage collector, which removes its pods first and, on a loaded machine, sweeps late.
        trainer = cluster.get("batch/v1/jobs", "other-trainer")
        assert trainer is None or "deletionTimestamp" in trainer["metadata"], trainer["metadata"]
        await wait_for(lambda: cluster.get("batch/v1/jobs", "other-trainer") is None, "other's trainer Job gone")


KUEUE_CRDS = ("kueue.x-k8s.io/v1beta1/workloads", "kueue.x-k8s.io/v1beta1/resourceflavors")


async def test_kueue_installed_after_the_operator_is_noticed_without_waiting_for_a_resync(trainer):
    """Kopf discovers the resources it watches once, at start (scanning is off), so the operator cannot watch
    Workloads when Kueue comes later: it then reads a queued job's Workload on each pass, and a job queued before
    Kueue exists waits for it instead of failing."""
    async with running_cluster(uninstalled=KUEUE_CRDS) as cluster:
        operator = await OperatorThread(cluster.url, operator_options(resync_interval=3600.0)).start()
        try:
            await cluster.apply(queued("demo"))
            await wait_for(lambda: "is Kueue installed" in cluster.status("demo").get("message", ""), "the wait")
            assert phase(cluster) == "Pending" and cluster.get("batch/v1/jobs", "demo-trainer") is None
            assert cluster.condition("demo", names.ADMITTED)["reason"] == names.R_KUEUE_NOT_INSTALLED

            cluster.install(*KUEUE_CRDS)
            async with FakeKueue(cluster) as kueue:
                await wait_for(lambda: kueue.workload("demo"), "the Workload, once Kueue's API is served")
                await kueue.admit("demo")
                await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer"), "the admission, with no watch")
                await kueue.evict("demo", "Preempted", "by a job of a higher priority")
                released = lambda: kueue.why_not_admissible(kueue.workload("demo")) is None  # noqa: E731
                await wait_for(released, "the eviction noticed and the quota given back")
        finally:
            await operator.stop()


FLAVORS_PATH = "/apis/kueue.x-k8s.io/v1beta1/resourceflavors"
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


async def add_flavor(cluster, name: str, node_labels: dict[str, str], tolerations: list | None = None) -> None:
    """A ResourceFlavor (cluster-scoped), as the platform team creates it."""
    spec = {"nodeLabels": node_labels, "tolerations": tolerations or []}
    doc = {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ResourceFlavor", "metadata": {"name": name}, "spec": spec}
    await cluster._call("POST", FLAVORS_PATH, doc)


def to(trainer: str, inference: str) -> dict[str, dict[str, str]]:
    """Each pod set's GPUs from a ResourceFlavor (the trainer's CPUs from the default one)."""
    return {"trainer": {"nvidia.com/gpu": trainer, "cpu": "default"}, "inference": {"nvidia.com/gpu": inference}}


def pod_spec(cluster, resource: str, name: str) -> dict:
    return cluster.get(resource, name)["spec"]["template"]["spec"]


async def test_the_admitted_flavors_reach_the_trainer_and_inference_pods(cluster, operator, kueue):
    await add_flavor(cluster, "default", {})
    await add_flavor(cluster, "h100", {"gpu.example.com/pool": "h100"}, [GPU_TAINT])
    await add_flavor(cluster, "l4", {"gpu.example.com/pool": "l4"})
    doc = job_doc(trainer={"nodeSelector": {"topology.kubernetes.io/zone": "a"}})
    doc["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "gpu-queue"}
    await cluster.apply(doc)
    await wait_for(lambda: cluster.get(WORKLOADS, "demo") is not None, "the Kueue Workload")
    await kueue.admit("demo", to(trainer="h100", inference="l4"))
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

    # Evicted, then admitted elsewhere: the new pods follow the new flavors, nothing is left of the old ones. (The
    # quota goes back once no pod is active, which may be before the old workloads have left the API.)
    first = cluster.get("batch/v1/jobs", "demo-trainer")["metadata"]["uid"]
    await kueue.evict("demo", "Preempted", "by job x")
    await wait_for(lambda: kueue.why_not_admissible(kueue.workload("demo")) is None, "the quota given back")
    await kueue.admit("demo", to(trainer="l4", inference="h100"))
    await wait_for(
        lambda: (
            (cluster.get("batch/v1/jobs", "demo-trainer") or {"metadata": {"uid": first}})["metadata"]["uid"] != first
        ),
        "the trainer again",
    )
    trainer = pod_spec(cluster, "batch/v1/jobs", "demo-trainer")
    assert trainer["nodeSelector"] == {"topology.kubernetes.io/zone": "a", "gpu.example.com/pool": "l4"}
    assert "tolerations" not in trainer


async def test_a_flavor_that_contradicts_the_node_selector_fails_the_job_and_finishes_the_workload(
    cluster, operator, kueue
):
    await add_flavor(cluster, "default", {})
    await add_flavor(cluster, "h100", {"gpu.example.com/pool": "h100"})
    doc = job_doc(trainer={"nodeSelector": {"gpu.example.com/pool": "a100"}})
    doc["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "gpu-queue"}
    await cluster.apply(doc)
    await wait_for(lambda: cluster.get(WORKLOADS, "demo") is not None, "the Kueue Workload")
    await kueue.admit("demo", to(trainer="h100", inference="h100"))
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


async def test_a_runtime_that_names_a_queue_queues_its_jobs_and_a_jobs_own_label_wins(cluster, operator):
    """A platform team sets the LocalQueue once, on the runtime (spec.scheduling.queueName); its jobs carry no label.
    The operator makes their Workload itself, so Kueue reads the queue from the Workload's spec.queueName alone; with
    no label on the job, Kueue's batch/v1 Job integration leaves its trainer Job alone unless
    manageJobsWithoutQueueName, when the job is its Kueue-managed ancestor either way (FindAncestorJobManagedByKueue,
    pkg/controller/jobframework)."""
    from tests.operator.test_runtime import cluster_runtime, job_on_runtime

    async with FakeKueue(cluster) as kueue:
        await cluster.apply(
            cluster_runtime(
                trainer={"gpusPerReplica": 0},
                inference={"gpusPerReplica": 0, "kvCacheGiB": 1},
                sync={"backend": "gloo"},
                scheduling={"queueName": "team-queue"},
            )
        )
        await cluster.apply(job_on_runtime("demo"))
        await wait_for(lambda: kueue.workload("demo") is not None, "the Kueue Workload")
        assert kueue.workload("demo")["spec"]["queueName"] == "team-queue"
        await wait_for(lambda: cluster.condition("demo", names.ADMITTED).get("reason") == names.R_QUEUED, "Queued")
        assert cluster.get("batch/v1/jobs", "demo-trainer") is None
        await kueue.admit("demo")
        await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer"), "the trainer Job once admitted")

        labelled = job_on_runtime("labelled")
        labelled["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "urgent-queue"}
        await cluster.apply(labelled)
        await wait_for(lambda: kueue.workload("labelled") is not None, "the labelled job's Workload")
        assert kueue.workload("labelled")["spec"]["queueName"] == "urgent-queue"


async def test_an_admitted_job_whose_pool_is_deleted_fails_and_gives_its_quota_back(cluster, operator, kueue):
    """Every ending marks the Workload Finished (job_queue.finish_workload), not only the main decision's: Kueue counts
    a Workload's quota until it is Finished (jobframework/reconciler.go: a finished job's Workload is finished)."""
    from tests.operator.test_pool import POOL, job_on_pool, pool_doc, trainer

    job = job_on_pool("on-pool")
    job["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "gpu-queue"}
    await cluster.apply(pool_doc())
    await cluster.apply(job)
    await wait_for(lambda: kueue.workload("on-pool"), "the Kueue Workload")
    await kueue.admit("on-pool")
    await wait_for(lambda: trainer(cluster, "on-pool"), "the trainer Job")
    await cluster.delete_pool(POOL)
    await wait_for(lambda: cluster.status("on-pool").get("phase") == "Failed", "Failed")
    assert cluster.condition("on-pool", names.FAILED)["reason"] == names.R_POOL_DELETED
    finished = await wait_for(lambda: find(kueue.workload("on-pool"), "Finished"), "the Workload Finished")
    assert (finished["status"], finished["reason"]) == ("True", "Failed")
    assert not kueue.holds_quota(kueue.workload("on-pool"))


async def test_a_job_that_failed_to_start_gives_its_quota_back_and_queues_anew_once_fixed(cluster, operator, kueue):
    """A claim its pods cannot share fails the job before it starts (FailedToStart, as Kueue says it): its Workload
    is Finished at once, so that Kueue never admits it. Fixed (a spec change; such a failure has no completionTime),
    the job runs again with a new Workload: the Finished one is never admitted again (Kueue's IsAdmissible), yet
    still says Admitted."""
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "ckpts"},
             "spec": {"accessModes": ["ReadWriteOncePod"]}}  # fmt: skip
    await cluster._call("POST", f"/api/v1/namespaces/{NAMESPACE}/persistentvolumeclaims", claim)
    await cluster.apply(queued(checkpoint={"pvc": {"claimName": "ckpts"}}, trainer={"replicas": 2}))
    # It fails in its first pass, its Workload Finished at once: Kueue never admits (and holds quota for) it.
    failed = names.R_VOLUME_ACCESS_MODE
    await wait_for(lambda: cluster.condition("demo", names.FAILED).get("reason") == failed, "Failed")
    finished = await wait_for(lambda: find(kueue.workload("demo"), "Finished"), "the Workload Finished")
    assert (finished["status"], finished["reason"]) == ("True", "FailedToStart")
    old_uid = kueue.workload("demo")["metadata"]["uid"]

    await cluster.patch_spec("demo", {"trainer": {"replicas": 1}})  # one pod: ReadWriteOncePod serves it
    await wait_for(lambda: (kueue.workload("demo") or {}).get("metadata", {}).get("uid") not in (None, old_uid),
                   "a new Workload")  # fmt: skip
    assert find(kueue.workload("demo"), "Finished") is None
    await wait_for(lambda: cluster.condition("demo", names.ADMITTED).get("reason") == names.R_QUEUED, "Queued again")
    assert cluster.get("batch/v1/jobs", "demo-trainer") is None, "nothing runs before Kueue admits it again"
    await kueue.admit("demo")
    await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer"), "the trainer Job")


async def test_kueue_evicts_only_a_job_that_cannot_make_progress(cluster, operator):
    """The Workload's PodsReady says what the job needs to go on (every trainer rank and one serving replica):
    with one of two inference replicas ready the job trains, and Kueue's waitForPodsReady leaves it running. Once a
    trainer rank is lost it cannot go on: PodsReady False (WaitForRecovery), and Kueue's recoveryTimeout, by default
    its timeout (the double plays Kueue's default), evicts it."""
    async with FakeKueue(cluster, capacity=1, pods_ready_timeout=3600.0) as kueue:
        await cluster.apply(queued("demo", inference={"replicas": 2}))
        await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference"), "admitted and started")
        await cluster.set_status("batch/v1/jobs", "demo-trainer", {"active": 1, "ready": 1})
        await cluster.set_status("apps/v1/statefulsets", "demo-inference", {"readyReplicas": 1})
        await wait_for(lambda: is_true(kueue.workload("demo"), "PodsReady"), "PodsReady True with 1/2 servers")
        assert cluster.condition("demo", names.PODS_READY)["status"] == "False", "the job's own counts every pod"
        # The test plays the clock: the timeout is shortened once PodsReady is True (see the test above).
        kueue.pods_ready_timeout = 0.5
        await wait_for(lambda: kueue.ready_in_time == ["demo"], "the timeout passed with the job making progress")
        assert kueue.timed_out == []

        await cluster.set_status("batch/v1/jobs", "demo-trainer", {"active": 1, "ready": 0})  # a rank lost
        ready = await wait_for(
            lambda: (find(kueue.workload("demo"), "PodsReady") or {}).get("reason") == "WaitForRecovery" and
            find(kueue.workload("demo"), "PodsReady"), "WaitForRecovery")  # fmt: skip
        assert ready["status"] == "False"
        await wait_for(lambda: kueue.timed_out == ["demo"], "evicted after the recovery timeout")
        evicted = find(kueue.workload("demo"), "Evicted")
        assert (evicted["status"], evicted["reason"]) == ("True", "PodsReadyTimeout")


async def test_a_rank_that_finished_first_still_counts_for_pods_ready(cluster, operator):
    """Ranks > 0 exit after the final gather while rank 0 saves and pushes the final adapter. The Job controller then
    shows ready 1, succeeded 1 (tests/operator/job_controller_double.py), and Kueue's own Job integration counts both
    (kubernetes-sigs/kueue pkg/controller/jobs/job/job_controller.go, (*Job).PodsReady: Status.Succeeded +
    Status.Ready >= podsCount(), the same from release-0.6 to main). Counting only ready ranks turned PodsReady to
    WaitForRecovery for the whole final push, and recoveryTimeout evicted the job at its very end."""
    async with (
        FakeKueue(cluster, capacity=1, pods_ready_timeout=3600.0) as kueue,
        JobController(cluster),
    ):
        await cluster.apply(queued("demo", trainer={"replicas": 2}))
        await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference"), "admitted and started")
        ranks = [await cluster.run_pod_of("batch/v1/jobs", "demo-trainer", i, node=f"gpu-{i}") for i in (0, 1)]
        for pod in ranks:
            await cluster.set_status("v1/pods", pod, {"conditions": [{"type": "Ready", "status": "True"}]})
        await cluster.set_status("apps/v1/statefulsets", "demo-inference", {"readyReplicas": 1})
        await wait_for(lambda: is_true(kueue.workload("demo"), "PodsReady"), "PodsReady True")
        kueue.pods_ready_timeout = 0.5  # recoveryTimeout unset: Kueue's default, the timeout

        await cluster.set_status("v1/pods", ranks[1], {"phase": "Succeeded", "conditions": []})  # rank 1 is done
        await wait_for(
            lambda: (cluster.get("batch/v1/jobs", "demo-trainer").get("status") or {}).get("succeeded") == 1,
            "the Job counting rank 1 succeeded",
        )
        for _ in range(3):  # passes, and more than the recovery timeout
            await a_pass(cluster, operator)
            await asyncio.sleep(0.3)
            assert is_true(kueue.workload("demo"), "PodsReady"), find(kueue.workload("demo"), "PodsReady")
        assert kueue.timed_out == [] and not is_true(kueue.workload("demo"), "Evicted")


async def relabel(cluster, name: str, queue: str | None) -> None:
    """`kubectl label glj NAME kueue.x-k8s.io/queue-name=QUEUE --overwrite` (None: `...queue-name-`)."""
    await cluster.patch_object(
        {"kind": c.KIND, "metadata": {"name": name, "namespace": NAMESPACE}},
        {"metadata": {"labels": {c.KUEUE_QUEUE_LABEL: queue}}},
    )


async def test_the_queue_label_is_followed_while_the_job_waits_and_held_once_kueue_admits_it(cluster, operator):
    """Kueue's webhooks refuse a change of a running Job's queue-name label (jobframework/validation.go) and of an
    admitted Workload's queueName (workload_webhook.go); until then the Workload follows the label."""
    async with FakeKueue(cluster) as kueue:
        await cluster.apply(queued("demo"))
        await wait_for(lambda: kueue.workload("demo"), "the Workload")
        await relabel(cluster, "demo", "other-queue")
        await wait_for(lambda: kueue.workload("demo")["spec"]["queueName"] == "other-queue", "the Workload moved")
        await kueue.admit("demo")
        await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer"), "admitted and started")

        await relabel(cluster, "demo", "third-queue")
        refused = await wait_for(
            lambda: (
                cluster.condition("demo", names.SPEC_CHANGE_REFUSED).get("status") == "True"
                and cluster.condition("demo", names.SPEC_CHANGE_REFUSED)
            ),
            "the change refused",
        )
        assert "other-queue" in refused["message"] and c.KUEUE_QUEUE_LABEL in refused["message"]
        assert kueue.workload("demo")["spec"]["queueName"] == "other-queue"
        assert cluster.get("batch/v1/jobs", "demo-trainer") is not None, "the job runs on"
        assert cluster.condition("demo", names.ADMITTED)["status"] == "True"

        # A job that runs without a queue does not join one: no Workload, its trainer stays.
        plain = job_doc()
        plain["metadata"]["name"] = "plain"
        await cluster.apply(plain)
        await wait_for(lambda: cluster.get("batch/v1/jobs", "plain-trainer"), "plain runs")
        await relabel(cluster, "plain", "gpu-queue")
        await wait_for(lambda: cluster.condition("plain", names.SPEC_CHANGE_REFUSED).get("status") == "True", "held")
        assert kueue.workload("plain") is None and cluster.get("batch/v1/jobs", "plain-trainer") is not None


async def test_a_queued_job_ranks_with_its_priority_class_or_the_clusters_default(cluster, operator):
    classes = "/apis/scheduling.k8s.io/v1/priorityclasses"
    for name, value, default in (("research-high", 1000, False), ("normal", 10, True)):
        doc = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name},
               "value": value, "globalDefault": default}  # fmt: skip
        await cluster._call("POST", classes, doc)
    async with FakeKueue(cluster, capacity=0) as kueue:
        await cluster.apply(queued("high", scheduling={"priorityClassName": "research-high"}))
        await cluster.apply(queued("plain"))
        high = await wait_for(lambda: kueue.workload("high"), "high's Workload")
        plain = await wait_for(lambda: kueue.workload("plain"), "plain's Workload")
        assert (high["spec"]["priorityClassName"], high["spec"]["priority"]) == ("research-high", 1000)
        assert high["spec"]["priorityClassSource"] == "scheduling.k8s.io/priorityclass"
        assert (plain["spec"]["priorityClassName"], plain["spec"]["priority"]) == ("normal", 10)
        await kueue.admit("high")
        trainer = await wait_for(lambda: cluster.get("batch/v1/jobs", "high-trainer"), "high's trainer Job")
        assert trainer["spec"]["template"]["spec"]["priorityClassName"] == "research-high"


async def test_an_evicted_jobs_quota_goes_back_once_no_pod_is_active_not_once_its_pods_are_gone(cluster, operator):
    """Kueue's own integrations give the quota back once nothing of the job is active (jobframework/reconciler.go,
    "handle eviction": once !job.IsActive(); for a batch Job IsActive is status.active != 0, and the Job controller
    does not count a terminating pod as active: pkg/controller/jobs/job/job_controller.go). A pod stuck Terminating
    (its node lost: no kubelet ever confirms it gone) held the quota, and the preemptor, for as long as it stayed:
    the operator waited for the workloads to leave the API, which their foreground deletion ties to their pods."""
    cluster.emulator.pod_exit_seconds = None  # the pods stay Terminating for their whole grace period (30 s)
    async with FakeKueue(cluster, capacity=1) as kueue:
        await cluster.apply(queued("demo"))
        await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference"), "admitted and started")
        trainer_pod = await cluster.run_pod_of("batch/v1/jobs", "demo-trainer")
        server_pod = await cluster.run_pod_of("apps/v1/statefulsets", "demo-inference")
        await kueue.add_workload("urgent", priority=100)
        await kueue.preempt("demo", by="urgent")
        await wait_for(lambda: (cluster.get("v1/pods", trainer_pod) or {}).get("metadata", {}).get(
            "deletionTimestamp"), "the trainer pod Terminating")  # fmt: skip
        await wait_for(lambda: kueue.admissions == ["demo", "urgent"], "the quota back: the preemptor admitted")
        assert cluster.get("v1/pods", trainer_pod) is not None and cluster.get("v1/pods", server_pod) is not None
        assert find(kueue.workload("demo"), "QuotaReserved")["status"] == "False"
        await cluster.emulator.end_grace_periods()
