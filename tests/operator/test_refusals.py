"""A create the API server refuses (an admission webhook or ValidatingAdmissionPolicy, RBAC, a count/jobs.batch quota),
before the job started and after. Played in the orders the real components produce:
- The API server calls the admission chain on every create and answers its denial (403/422 with the webhook's
  message; staging/src/k8s.io/apiserver/pkg/admission). A policy added while a job runs refuses only what is created
  from then on: its running Jobs and StatefulSets stay.
- The Job controller's status (tests/operator/job_controller_double.py, Kubernetes >= 1.31 rules) from the pods the
  test runs and fails as the kubelet would; Kueue's scheduler and Workload controller (tests/operator/kueue_double.py).
"""

from __future__ import annotations

from typing import Any

from grpolora.api import constants as c
from grpolora.operator import names
from grpolora.testing import kube_apiserver
from grpolora.testing.kube_emulator import NAMESPACE
from tests.helpers import job_doc
from tests.operator.harness import FakeTrainer, a_pass, wait_for
from tests.operator.kueue_double import FakeKueue, is_true
from tests.operator.test_operator import phase, report

DENIAL = 'admission webhook "deny-jobs.policy.example.com" denied the request: batch Jobs are not allowed here'


def deny_jobs(request: Any, obj: dict[str, Any]) -> None:
    """A validating webhook (a policy engine's rule) refusing every batch/v1 Job create."""
    if (request.resource.group, request.resource.plural) == ("batch", "jobs"):
        raise kube_apiserver.Refused(status=403, reason="Forbidden", message=DENIAL, details={})


async def test_a_refused_trainer_job_leaves_no_inference_statefulset_running(cluster, operator):
    """The trainer Job and the StatefulSet were created side by side: the refusal of one failed the job to start
    while the other went on running, holding its GPUs for ever (and a pass at each of its events created again)."""
    cluster.emulator.webhooks.append(deny_jobs)
    await cluster.apply(job_doc())
    await wait_for(lambda: cluster.condition("demo", names.FAILED).get("reason") == names.R_CREATE_REFUSED, "Failed")
    assert DENIAL in cluster.status("demo")["message"]
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference") is None, "no StatefulSet left")
    # Passes woken as drift repair wakes them (a kept child deleted: a full pass), the kind that created again.
    for path in ("/api/v1/namespaces/{}/services/demo-trainer", "/api/v1/namespaces/{}/services/demo-inference"):
        before = operator.passes()
        await cluster._call("DELETE", path.format(NAMESPACE))
        await wait_for(lambda b=before: operator.passes() > b, "a pass of the operator")
        assert cluster.get("apps/v1/statefulsets", "demo-inference") is None
        assert cluster.get("batch/v1/jobs", "demo-trainer") is None
        assert phase(cluster) == "Failed"


async def test_a_refusal_after_the_job_started_keeps_its_run_its_quota_and_its_next_incarnation(
    cluster, jobs, operator, trainer: FakeTrainer
):
    """A policy added mid-run refuses the replacement trainer Job of a restart. The job started: it is not "failed to
    start". It keeps its restarts, their causes, its token digest, its progress and Created; its Workload keeps its
    quota while its inference pods run; and once the policy goes, the replacement comes with the next restart
    attempt (the incarnation the replicas fence by), not attempt 0."""
    async with FakeKueue(cluster, capacity=1) as kueue:
        doc = job_doc(trainer={"maxRestarts": 2})
        doc["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "gpu-queue"}
        await cluster.apply(doc)
        await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer"), "admitted, the trainer Job")
        await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference"), "the StatefulSet")
        rank0 = await cluster.run_pod_of("batch/v1/jobs", "demo-trainer", node="gpu-node-1")
        trainer.report = report(step=2, syncRound=2, epoch=1)
        await wait_for(lambda: cluster.status("demo").get("step") == 2, "step 2 reported")
        before = cluster.status("demo")
        assert before["tokenDigest"]

        cluster.emulator.webhooks.append(deny_jobs)  # the policy arrives
        trainer.report = None
        await cluster.set_status("v1/pods", rank0, {"phase": "Failed"})  # rank 0 crashes: a counted failure
        await wait_for(
            lambda: cluster.condition("demo", names.PROGRESSING).get("reason") == names.R_CREATE_REFUSED,
            "the replacement refused",
        )
        for _ in range(3):
            await a_pass(cluster, operator)
            status = cluster.status("demo")
            assert status["phase"] in ("Running", "Pending"), status["message"]
            assert status["trainerRestarts"] == 1 and status["restartsByCause"]["failure"] == 1
            assert status["tokenDigest"] == before["tokenDigest"] and status["step"] == 2
            assert cluster.condition("demo", names.CREATED)["status"] == "True"
            assert cluster.condition("demo", names.FAILED)["status"] == "False"
            assert DENIAL in cluster.condition("demo", names.PROGRESSING)["message"]
            workload = kueue.workload("demo")
            assert is_true(workload, "QuotaReserved") and not is_true(workload, "Finished")
            assert cluster.get("apps/v1/statefulsets", "demo-inference") is not None

        cluster.emulator.webhooks.remove(deny_jobs)  # the policy is lifted
        await a_pass(cluster, operator)
        replacement = await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer"), "the replacement")
        assert replacement["metadata"]["annotations"][names.RESTART_ATTEMPT_ANNOTATION] == "1"
        assert replacement["metadata"]["annotations"][names.INCARNATION_ANNOTATION] == "1"
        template = replacement["spec"]["template"]["metadata"]["annotations"]
        assert template[names.INCARNATION_ANNOTATION] == "1"
        await wait_for(lambda: cluster.status("demo").get("trainerIncarnation") == 1, "incarnation 1 recorded")
        assert cluster.status("demo")["trainerRestarts"] == 1
