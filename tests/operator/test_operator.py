"""The real operator (Kopf, handlers, controller, API client) against the Kubernetes API emulator over HTTP."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from typing import Any

import aiohttp
import pytest

from grpolora.api import constants as c
from grpolora.api.load import parse_job
from grpolora.api.plan import plan
from grpolora.api.pool import token_fingerprint
from grpolora.operator import names
from grpolora.operator.builders import build_children
from grpolora.testing.kube_emulator import CRD_RESOURCE, NAMESPACE, Cluster, as_stored, running_cluster
from tests.helpers import example, job_doc
from tests.operator.harness import FAST_INTERVAL, OperatorThread, operator_options, wait_for

RESOURCE_OF = {
    "Secret": "v1/secrets",
    "Service": "v1/services",
    "NetworkPolicy": "networking.k8s.io/v1/networkpolicies",
    "PodDisruptionBudget": "policy/v1/poddisruptionbudgets",
    "Job": "batch/v1/jobs",
    "StatefulSet": "apps/v1/statefulsets",
}
SERVER_FIELDS = ("uid", "resourceVersion", "creationTimestamp", "generation")


def as_sent(obj: dict[str, Any]) -> dict[str, Any]:
    """The object without the fields the API server adds."""
    result = copy.deepcopy(obj)
    for key in SERVER_FIELDS:
        result["metadata"].pop(key, None)
    return result


def pod_labels(job: str, role: str) -> dict[str, str]:
    """A pod's labels as the job's pod template sets them (the operator lists its pods by the managed-by label)."""
    return {c.LABEL_MANAGED_BY: c.OPERATOR_NAME, c.LABEL_JOB: job, c.LABEL_ROLE: role}


def report(phase: str = "Running", **fields: Any) -> dict[str, Any]:
    return {"phase": phase, "totalSteps": 3, "syncMembers": [0], **fields}


async def created(cluster: Cluster, name: str = "demo") -> None:
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", f"{name}-inference"), f"{name}'s children")


async def pods_up(cluster: Cluster, name: str = "demo", *, inference: int = 1) -> None:
    """Play the Job and StatefulSet controllers: the trainer pod runs, the inference pods are ready."""
    await cluster.set_status("batch/v1/jobs", f"{name}-trainer", {"active": 1, "ready": 1})
    await cluster.set_status(
        "apps/v1/statefulsets", f"{name}-inference", {"replicas": inference, "readyReplicas": inference}
    )


def phase(cluster: Cluster, name: str = "demo") -> str | None:
    return cluster.status(name).get("phase")


def reasons(cluster: Cluster, name: str = "demo") -> list[str]:
    return [reason for _, reason, _ in cluster.events(name)]


def epoch_of(cluster: Cluster, name: str = "demo") -> int | None:
    return (cluster.status(name).get("rendezvous") or {}).get("epoch")


def history(cluster: Cluster, name: str = "demo") -> list[dict[str, Any]]:
    """Every stored version of the job's status, oldest first."""
    versions = cluster.emulator.objects[CRD_RESOURCE, NAMESPACE, name].history
    return [dict(v.raw.get("status") or {}) for v in versions if v is not None]


# ---- create ------------------------------------------------------------------------------------------------


async def test_a_job_gets_exactly_the_rendered_children_placed_with_rendezvous_env(cluster, operator):
    doc = example("qwen3-0.6b-gpu.yaml")
    doc["metadata"]["namespace"] = NAMESPACE
    await cluster.apply(copy.deepcopy(doc))
    name = doc["metadata"]["name"]
    await created(cluster, name)
    await wait_for(lambda: phase(cluster, name) == "Pending", "phase Pending")
    job = cluster.job(name)
    token = cluster.secret_data(f"{name}-grpolora-token")["token"]
    assert len(token) >= 43  # secrets.token_urlsafe(32)

    expected = build_children(plan(parse_job(doc)), owner_uid=job["metadata"]["uid"], token=token)
    for obj in expected:
        actual = cluster.get(RESOURCE_OF[obj["kind"]], obj["metadata"]["name"])
        assert actual is not None, f"missing {obj['kind']} {obj['metadata']['name']}"
        assert as_sent(actual) == as_stored(obj), f"{obj['kind']} differs from `grpolora render`"

    trainer = cluster.get("batch/v1/jobs", f"{name}-trainer")["spec"]["template"]["spec"]
    inference = cluster.get("apps/v1/statefulsets", f"{name}-inference")["spec"]["template"]["spec"]
    assert trainer["nodeSelector"] == {"grpolora.dev/pool": "trainer"}
    assert inference["nodeSelector"] == {"grpolora.dev/pool": "inference"}
    assert trainer["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert inference["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert trainer["automountServiceAccountToken"] is False and inference["automountServiceAccountToken"] is False
    env = {e["name"]: e.get("value") for e in trainer["containers"][0]["env"]}
    assert env["MASTER_ADDR"] == f"{name}-trainer-0.{name}-trainer.{NAMESPACE}.svc"
    assert env["GRPOLORA_SYNC_WORLD_SIZE"] == "3" and env["GRPOLORA_SYNC_BACKEND"] == "nccl"

    status = cluster.status(name)
    assert status["observedGeneration"] == 1 and status["totalSteps"] == 200
    assert status["rendezvous"]["syncWorldSize"] == 3 and status["replicas"]["inference"] == {"desired": 2, "ready": 0}
    assert cluster.condition(name, names.CREATED)["status"] == "True"
    assert json.loads(job["metadata"]["annotations"][names.APPLIED_SPEC_ANNOTATION])["lora"]["rank"] == 16
    await wait_for(lambda: reasons(cluster, name) == [names.E_CREATED], "the Created event")  # after the write
    assert len(cluster.emulator.created) == len(set(cluster.emulator.created)), "something was created twice"


# ---- status ------------------------------------------------------------------------------------------------


async def test_status_follows_the_trainer_through_sync_rounds_to_succeeded(cluster, trainer, unused_tcp_port):
    operator = await OperatorThread(cluster.url, operator_options(metrics_port=unused_tcp_port)).start()
    try:
        await cluster.apply(job_doc(grpo={"steps": 3}))
        await created(cluster)
        await pods_up(cluster)
        # The trainer pod runs but its server is not up yet: the job waits and says why.
        await wait_for(lambda: "HTTP 503" in cluster.status("demo").get("message", ""), "the trainer's 503")
        assert phase(cluster) == "Pending"

        trainer.report = report("Starting")
        await wait_for(lambda: phase(cluster) == "Running", "phase Running")
        assert cluster.condition("demo", names.RENDEZVOUS_READY)["reason"] == names.R_FORMING
        for rounds in (1, 2, 3):
            trainer.report = report(
                step=rounds,
                syncRound=rounds,
                epoch=1,
                lastSyncSeconds=0.25 * rounds,
                lastSyncBytes=1000 * rounds,
                lastSyncTime=f"2026-01-01T00:00:0{rounds}Z",
                rewardMean=rounds / 10,
                kl=0.01,
                mismatch=0.002,
            )
            await wait_for(lambda r=rounds: cluster.status("demo").get("syncRound") == r, f"sync round {rounds}")
        status = cluster.status("demo")
        assert (status["step"], status["lastSyncBytes"], status["lastSyncSeconds"]) == (3, 3000, 0.75)
        assert (status["rewardMean"], status["kl"], status["mismatch"]) == (0.3, 0.01, 0.002)
        assert status["lastSyncTime"] == "2026-01-01T00:00:03Z" and status["rendezvous"]["epoch"] == 1
        assert cluster.condition("demo", names.RENDEZVOUS_READY)["status"] == "True"

        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{unused_tcp_port}/metrics") as got:
            scraped = await got.text()
        assert f'grpolora_job_sync_rounds_total{{job="demo",namespace="{NAMESPACE}"}} 3.0' in scraped
        assert f'grpolora_job_last_sync_bytes{{job="demo",namespace="{NAMESPACE}"}} 3000.0' in scraped
        assert 'grpolora_jobs{phase="Running"} 1.0' in scraped

        trainer.report = report("Succeeded", step=3, syncRound=3, epoch=1)
        await wait_for(lambda: phase(cluster) == "Succeeded", "phase Succeeded")
        await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference") is None, "inference released")
        status = cluster.status("demo")
        assert status["completionTime"] and "3/3 steps" in status["message"]
        assert cluster.condition("demo", names.SUCCEEDED)["status"] == "True"
        await wait_for(lambda: len(cluster.events("demo")) == 3, "three events")  # posted after the status write
        assert reasons(cluster) == [names.E_CREATED, names.E_RUNNING, names.E_SUCCEEDED]
    finally:
        await operator.stop()

    # Over every status ever stored: syncRound never went back, Created never re-transitioned.
    versions = [s for s in history(cluster) if s.get("syncRound") is not None]
    rounds = [s["syncRound"] for s in versions]
    assert rounds == sorted(rounds) and rounds[-1] == 3
    created_at = {c["lastTransitionTime"] for s in versions for c in s["conditions"] if c["type"] == names.CREATED}
    assert len(created_at) == 1


# ---- invalid -----------------------------------------------------------------------------------------------


async def test_an_invalid_job_fails_with_field_paths_and_gets_no_children_until_fixed(cluster, operator):
    # Errors neither the CRD schema nor its CEL rules express (the API server refuses the others at apply, as in
    # test_apiserver.py).
    await cluster.apply(job_doc(model={"name": "offline:nope"}, task={"name": "nope"}))
    await wait_for(lambda: phase(cluster) == "Failed", "phase Failed")
    invalid = cluster.condition("demo", names.INVALID_SPEC)
    assert invalid["status"] == "True" and invalid["reason"] == names.R_INVALID
    assert "spec.model.name" in invalid["message"] and "spec.task.name" in invalid["message"]
    await wait_for(lambda: names.E_INVALID_SPEC in reasons(cluster), "the InvalidSpec event")
    assert ("Warning", names.E_INVALID_SPEC, invalid["message"]) in cluster.events("demo")
    await asyncio.sleep(5 * FAST_INTERVAL)
    for resource in RESOURCE_OF.values():
        assert cluster.objects(resource) == {}, f"{resource} created for an invalid job"

    await cluster.patch_spec("demo", {"model": {"name": "Qwen/Qwen3-0.6B"}, "task": {"name": "arithmetic"}})
    await created(cluster)
    await wait_for(lambda: phase(cluster) == "Pending", "phase Pending after the fix")
    assert cluster.condition("demo", names.INVALID_SPEC)["status"] == "False"


# ---- suspend -----------------------------------------------------------------------------------------------


async def test_suspend_removes_the_workloads_and_keeps_the_rest_resume_recreates_them(cluster, operator):
    await cluster.apply(job_doc())
    await created(cluster)
    token = cluster.secret_data("demo-grpolora-token")["token"]

    await cluster.patch_spec("demo", {"suspend": True})
    await wait_for(lambda: phase(cluster) == "Suspended", "phase Suspended")
    # Deleted in the foreground: each stays until the collector has seen that it has no pods left.
    await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer") is None, "the trainer Job gone")
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference") is None, "the StatefulSet gone")
    assert set(cluster.objects("v1/services")) == {"demo-trainer", "demo-inference"}
    assert set(cluster.objects("networking.k8s.io/v1/networkpolicies")) == {"demo"}
    assert cluster.condition("demo", names.SUSPENDED)["status"] == "True"
    assert cluster.status("demo")["replicas"]["trainer"]["desired"] == 0

    await cluster.patch_spec("demo", {"suspend": False})
    await created(cluster)
    await wait_for(lambda: phase(cluster) == "Pending", "phase Pending after resume")
    assert cluster.get("batch/v1/jobs", "demo-trainer") is not None
    assert cluster.secret_data("demo-grpolora-token")["token"] == token  # never regenerated
    assert cluster.condition("demo", names.SUSPENDED)["status"] == "False"
    expected = [names.E_CREATED, names.E_SUSPENDED, names.E_RESUMED]
    await wait_for(lambda: reasons(cluster) == expected, "Created, Suspended and Resumed events")


WORKLOADS = (("Job", "batch/v1/jobs", "trainer"), ("StatefulSet", "apps/v1/statefulsets", "inference"))


def fingerprint_of(cluster: Cluster, name: str = "demo") -> str:
    """The fingerprint of the token in the job's Secret (its data, as the API server returns it)."""
    return token_fingerprint(cluster.secret_data(f"{name}-grpolora-token")["token"])


async def test_a_deleted_token_secret_re_keys_the_whole_job_with_an_event(cluster, operator):
    """The token Secret comes back (drift repair) with a new token; pods keep the one they started with, so every
    pod is replaced together, never old and new tokens side by side (trainer and replicas would refuse each other)."""
    await cluster.apply(job_doc())
    await created(cluster)
    await pods_up(cluster)
    await wait_for(lambda: cluster.status("demo").get("tokenDigest") == fingerprint_of(cluster), "tokenDigest")
    first = {kind: cluster.get(res, f"demo-{role}")["metadata"]["uid"] for kind, res, role in WORKLOADS}
    await cluster._call("DELETE", f"/api/v1/namespaces/{NAMESPACE}/secrets/demo-grpolora-token")
    await wait_for(lambda: cluster.get("v1/secrets", "demo-grpolora-token"), "the token Secret re-made (full pass)")
    new = fingerprint_of(cluster)
    await wait_for(lambda: cluster.status("demo").get("tokenDigest") == new, "the job re-keyed", timeout=15)
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference"), "the workloads back")
    for kind, res, role in WORKLOADS:
        assert cluster.get(res, f"demo-{role}")["metadata"]["uid"] != first[kind], f"{kind} not replaced"
    (rekeyed,) = [m for t, r, m in cluster.events("demo") if r == names.E_REKEYED]
    assert "the token Secret demo-grpolora-token was re-made with a new token" in rekeyed


async def test_a_job_created_suspended_gets_only_what_suspension_keeps(cluster, operator):
    doc = job_doc(suspend=True)
    doc["metadata"]["name"] = "sleepy"
    await cluster.apply(doc)
    await wait_for(lambda: phase(cluster, "sleepy") == "Suspended", "phase Suspended")
    assert cluster.get("v1/secrets", "sleepy-grpolora-token") and cluster.get("v1/services", "sleepy-trainer")
    assert cluster.get("batch/v1/jobs", "sleepy-trainer") is None
    assert cluster.get("apps/v1/statefulsets", "sleepy-inference") is None


# ---- delete ------------------------------------------------------------------------------------------------


async def test_deleting_a_job_takes_its_children_and_stops_its_monitor(cluster, operator):
    await cluster.apply(job_doc())
    await created(cluster)
    monitor = operator.controller.jobs[NAMESPACE, "demo"].task
    await cluster.delete_job("demo")
    for resource in RESOURCE_OF.values():  # by the garbage collector, which takes a moment
        await wait_for(lambda r=resource: cluster.objects(r) == {}, f"{resource} to be collected")
    await wait_for(lambda: not operator.controller.jobs, "the operator to forget the job")
    assert "finalizers" not in cluster.emulator.objects[CRD_RESOURCE, NAMESPACE, "demo"].last["metadata"]
    # Its monitor is cancelled, not awaited: once the task is done, no pass of it can send anything more (a request
    # it had already sent may still arrive, a moment later, which the sleep allows for).
    await wait_for(lambda: monitor is None or monitor.done(), "the job's monitor to end")
    await asyncio.sleep(3 * FAST_INTERVAL)
    before = len(cluster.emulator.log)
    await asyncio.sleep(10 * FAST_INTERVAL)
    late = [entry for entry in cluster.emulator.log[before:] if entry[2] == "demo"]
    assert late == [], "the operator kept working on a deleted job"


async def test_a_foreground_deletion_recreates_nothing_while_the_job_waits_for_its_children(cluster, operator):
    """`kubectl delete --cascade=foreground` (Argo CD's default): the job stays, with a deletionTimestamp, until its
    children are gone, and the collector removes them one by one. A pass woken by the trainer Job's removal must not
    create it again (JobSet had the same bug: kubernetes-sigs/jobset#561, fixed by not reconciling a JobSet with a
    deletion timestamp, #562)."""
    cluster.emulator.pod_exit_seconds = None  # the inference pod ignores SIGTERM: its StatefulSet stays a while
    await cluster.apply(job_doc())
    await created(cluster)
    await wait_for(lambda: cluster.condition("demo", names.CREATED).get("status") == "True", "Created recorded")
    await cluster.run_pod_of("apps/v1/statefulsets", "demo-inference")
    creates = len(cluster.emulator.created)
    await cluster.delete_job("demo", cascade="Foreground")
    # The trainer Job (no pods) goes at once; the operator's watch sees it go, which wakes the job's pass.
    await wait_for(lambda: operator.controller.cache.get(("Job", NAMESPACE, "demo-trainer"), 1) is None, "seen")
    await asyncio.sleep(10 * FAST_INTERVAL)  # several light passes and a full one (resync_interval)
    assert cluster.job("demo")["metadata"]["deletionTimestamp"], "the job still waits for its StatefulSet's pod"
    again = [key for key in cluster.emulator.created[creates:] if key[0] != "events"]
    assert again == [], f"created while the job was being deleted: {again}"
    await cluster.emulator.end_grace_periods()
    await wait_for(lambda: cluster.get(CRD_RESOURCE, "demo") is None, "the job removed")
    for resource in RESOURCE_OF.values():
        assert cluster.objects(resource) == {}, resource


# ---- restart -----------------------------------------------------------------------------------------------


async def test_an_operator_restart_mid_job_duplicates_nothing_and_status_continues(cluster, trainer):
    first = await OperatorThread(cluster.url, operator_options()).start()
    try:
        await cluster.apply(job_doc())
        await created(cluster)
        await pods_up(cluster)
        trainer.report = report(step=2, syncRound=2, epoch=1)
        await wait_for(lambda: cluster.status("demo").get("syncRound") == 2, "sync round 2")
        await wait_for(lambda: names.E_RUNNING in reasons(cluster), "the Running event")
    finally:
        await first.stop()
    formed_at = cluster.condition("demo", names.RENDEZVOUS_READY)["lastTransitionTime"]
    creates = list(cluster.emulator.created)

    trainer.report = report(step=3, syncRound=3, epoch=1)
    second = await OperatorThread(cluster.url, operator_options()).start()
    try:
        await wait_for(lambda: cluster.status("demo").get("syncRound") == 3, "sync round 3 after the restart")
    finally:
        await second.stop()
    assert cluster.emulator.created[: len(creates)] == creates
    new_creates = [key for key in cluster.emulator.created[len(creates) :] if key[0] != "events"]
    assert new_creates == [], f"created again after the restart: {new_creates}"
    assert cluster.condition("demo", names.RENDEZVOUS_READY)["lastTransitionTime"] == formed_at
    assert reasons(cluster).count(names.E_CREATED) == 1 and reasons(cluster).count(names.E_RUNNING) == 1


# ---- spec changes ------------------------------------------------------------------------------------------


async def test_a_change_that_cannot_apply_is_refused_and_the_children_stay(cluster, operator):
    await cluster.apply(job_doc())
    await created(cluster)
    await wait_for(lambda: cluster.condition("demo", names.CREATED).get("status") == "True", "Created recorded")
    # The CRD's CEL rule refuses the change at admission ...
    with pytest.raises(AssertionError, match=r"422.*only spec.suspend and spec.ttlSecondsAfterFinished can change"):
        await cluster.patch_spec("demo", {"lora": {"rank": 8}, "trainer": {"replicas": 2}})
    # ... and where it is not enforced (an API server before CEL validation rules, or a CRD installed without
    # them), the operator refuses it itself.
    cluster.emulator.validate = False
    await cluster.patch_spec("demo", {"lora": {"rank": 8}, "trainer": {"replicas": 2}})
    await wait_for(lambda: cluster.condition("demo", names.SPEC_CHANGE_REFUSED).get("status") == "True", "refusal")
    message = cluster.condition("demo", names.SPEC_CHANGE_REFUSED)["message"]
    assert "spec.lora.rank, spec.trainer.replicas cannot change" in message
    await wait_for(lambda: ("Warning", names.E_SPEC_CHANGE_REFUSED, message) in cluster.events("demo"), "the event")
    trainer = cluster.get("batch/v1/jobs", "demo-trainer")
    env = {e["name"]: e.get("value") for e in trainer["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert json.loads(env["GRPOLORA_SPEC"])["lora"]["rank"] == 16
    assert [k for k in cluster.emulator.created if k[0] == "jobs"] == [("jobs", NAMESPACE, "demo-trainer")]
    assert cluster.status("demo")["observedGeneration"] == 2

    await cluster.patch_spec("demo", {"lora": {"rank": 16}, "trainer": {"replicas": 1}})
    await wait_for(lambda: cluster.condition("demo", names.SPEC_CHANGE_REFUSED).get("status") == "False", "revert")


# ---- failures ----------------------------------------------------------------------------------------------


async def test_a_failed_trainer_is_restarted_then_the_job_fails_with_the_reason(cluster, operator):
    await cluster.apply(job_doc(trainer={"maxRestarts": 1}))
    await created(cluster)
    failed = {
        "conditions": [
            {
                "type": "Failed",
                "status": "True",
                "reason": "BackoffLimitExceeded",
                "message": "Job has reached the specified backoff limit",
            }
        ]
    }
    await cluster.set_status("batch/v1/jobs", "demo-trainer", failed)
    await wait_for(lambda: [k for k in cluster.emulator.created if k[0] == "jobs"].__len__() == 2, "a new trainer")
    replacement = cluster.get("batch/v1/jobs", "demo-trainer")
    assert replacement["metadata"]["annotations"][names.RESTART_ATTEMPT_ANNOTATION] == "1"
    assert "status" not in replacement or not replacement["status"].get("conditions")
    await wait_for(lambda: cluster.status("demo").get("trainerRestarts") == 1, "trainerRestarts 1")
    await wait_for(lambda: names.E_TRAINER_RESTARTING in reasons(cluster), "the TrainerRestarting event")

    await cluster.set_status("batch/v1/jobs", "demo-trainer", failed)
    await wait_for(lambda: phase(cluster) == "Failed", "phase Failed")
    failed_condition = cluster.condition("demo", names.FAILED)
    assert failed_condition["reason"] == names.R_BACKOFF_LIMIT and "backoff limit" in failed_condition["message"]
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference") is None, "inference released")
    await wait_for(lambda: reasons(cluster)[-1] == names.E_FAILED, "the Failed event")
    assert [k for k in cluster.emulator.created if k[0] == "jobs"].__len__() == 2


async def test_a_restart_creates_the_new_trainer_job_only_once_the_old_one_and_its_pods_are_gone(cluster, operator):
    """As JobSet does since kubernetes-sigs/jobset#392 (delete child Jobs in the foreground) and #684 (blocking
    recreate): the failed trainer Job is deleted with propagationPolicy Foreground, so it stays until its pods are
    gone, and its replacement is created only then. Old and new trainer pods never overlap: a dying rank 0 still
    answers to the rendezvous name (publishNotReadyAddresses) and holds GPUs the new pods wait for."""
    cluster.emulator.pod_exit_seconds = None  # NCCL workers often ignore SIGTERM: Terminating for the grace period
    await cluster.apply(job_doc(trainer={"maxRestarts": 1}))
    await created(cluster)
    old_pod = await cluster.run_pod_of("batch/v1/jobs", "demo-trainer")
    failed = {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "x"}]}
    await cluster.set_status("batch/v1/jobs", "demo-trainer", failed)
    await wait_for(
        lambda: (
            "waiting for the failed trainer Job and its pods to be gone"
            in cluster.condition("demo", names.PROGRESSING).get("message", "")
        ),
        "the restart waiting for the old pods",
    )
    old_job = cluster.get("batch/v1/jobs", "demo-trainer")
    assert old_job is not None and old_job["metadata"]["finalizers"] == ["foregroundDeletion"], "not Foreground"
    assert old_job["metadata"].get("annotations", {}).get(names.RESTART_ATTEMPT_ANNOTATION) is None, "the old Job"
    await wait_for(lambda: cluster.get("v1/pods", old_pod)["metadata"].get("deletionTimestamp"), "pod Terminating")
    await asyncio.sleep(5 * FAST_INTERVAL)  # a few more passes, woken by the pod's and the Job's changes
    assert len([k for k in cluster.emulator.created if k[0] == "jobs"]) == 1, "replaced while the old pod exists"
    await cluster.emulator.end_grace_periods()  # the kubelet's SIGKILL: the old pod, then the old Job, go
    await wait_for(lambda: len([k for k in cluster.emulator.created if k[0] == "jobs"]) == 2, "the replacement")
    replacement = cluster.get("batch/v1/jobs", "demo-trainer")
    assert replacement["metadata"]["annotations"][names.RESTART_ATTEMPT_ANNOTATION] == "1"
    assert cluster.get("v1/pods", old_pod) is None


def policy_failure(message: str) -> dict[str, Any]:
    """A trainer Job failed by its podFailurePolicy, worded as the Job controller words it."""
    condition = {"type": "Failed", "status": "True", "reason": "PodFailurePolicy", "message": message}
    return {"conditions": [condition]}


async def test_a_disrupted_trainer_restarts_without_spending_max_restarts(cluster, operator):
    await cluster.apply(job_doc(trainer={"maxRestarts": 0}))
    await created(cluster)
    disrupted = policy_failure(
        f"Pod {NAMESPACE}/demo-trainer-0-abcde has condition DisruptionTarget matching FailJob rule at index 1"
    )
    await cluster.set_status("batch/v1/jobs", "demo-trainer", disrupted)
    await wait_for(lambda: len([k for k in cluster.emulator.created if k[0] == "jobs"]) == 2, "a new trainer")
    await wait_for(lambda: cluster.status("demo").get("restartsByCause") == {"failure": 0, "disruption": 1}, "count")
    assert phase(cluster) != "Failed" and cluster.status("demo")["trainerRestarts"] == 1
    assert cluster.get("policy/v1/poddisruptionbudgets", "demo-inference") is not None


async def trainer_refuses_its_data(cluster: Cluster) -> None:
    """Play the kubelet and the Job controller: the trainer exits 65 (bad data) with its termination message, and
    the podFailurePolicy fails the Job."""
    terminated = {"exitCode": 65, "message": "spec.task.dataset.path: file not found: x"}
    container = {"name": "trainer", "image": "x", "imageID": "", "ready": False, "restartCount": 0}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "demo-trainer-0-abcde", "labels": pod_labels("demo", "trainer")},
        "spec": {"containers": [{"name": "trainer", "image": "x"}]},
        "status": {"phase": "Failed", "containerStatuses": [{**container, "state": {"terminated": terminated}}]},
    }
    await cluster.add_pod(pod)
    await cluster.set_status(
        "batch/v1/jobs",
        "demo-trainer",
        policy_failure(
            f"Container trainer for pod {NAMESPACE}/demo-trainer-0-abcde failed with exit code 65 matching FailJob "
            "rule at index 0"
        ),
    )


async def test_a_trainer_that_refuses_its_data_fails_the_job_at_once_with_its_message(cluster, operator):
    await cluster.apply(job_doc(trainer={"maxRestarts": 3}))
    await created(cluster)
    await trainer_refuses_its_data(cluster)
    await wait_for(lambda: phase(cluster) == "Failed", "phase Failed")
    failed_condition = cluster.condition("demo", names.FAILED)
    assert failed_condition["reason"] == names.R_POD_FAILURE_POLICY
    assert "spec.task.dataset.path: file not found: x" in failed_condition["message"]
    assert len([k for k in cluster.emulator.created if k[0] == "jobs"]) == 1
    assert cluster.status("demo")["trainerRestarts"] == 0


async def test_a_lost_inference_pod_re_forms_the_sync_group_and_the_job_goes_on(cluster, trainer, operator):
    await cluster.apply(job_doc(inference={"replicas": 2}))
    await created(cluster)
    await pods_up(cluster, inference=2)
    for epoch, members, rounds in ((1, [0, 1], 1), (2, [0], 2), (3, [0, 1], 3)):
        trainer.report = report(syncRound=rounds, step=rounds, epoch=epoch, syncMembers=members)
        await wait_for(lambda e=epoch: epoch_of(cluster) == e, f"epoch {epoch}")
        assert phase(cluster) == "Running"
    assert "[0, 1] (2/2)" in cluster.condition("demo", names.RENDEZVOUS_READY)["message"]
    await wait_for(lambda: reasons(cluster).count(names.E_GROUP_REFORMED) == 2, "two SyncGroupReformed events")
    assert [k for k in cluster.emulator.created if k[0] == "statefulsets"] == [
        ("statefulsets", NAMESPACE, "demo-inference")
    ]


async def test_pods_stuck_unschedulable_or_pulling_say_why(cluster, operator):
    await cluster.apply(job_doc())
    await created(cluster)
    labels = pod_labels("demo", "trainer")
    await cluster.add_pod(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "demo-trainer-0-abcde", "namespace": NAMESPACE, "labels": labels},
            "status": {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                    }
                ],
            },
        }
    )
    # Another job's pod must not be blamed (the operator lists by label selector).
    await cluster.add_pod(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "other-trainer-0-x", "namespace": NAMESPACE, "labels": pod_labels("other", "trainer")},
            "status": {
                "phase": "Pending",
                "containerStatuses": [
                    {
                        "name": "trainer",
                        "ready": False,
                        "restartCount": 0,
                        "image": "worker:1",
                        "imageID": "",
                        "state": {"waiting": {"reason": "ImagePullBackOff", "message": "denied"}},
                    }
                ],
            },
        }
    )
    await wait_for(lambda: cluster.condition("demo", names.PODS_READY).get("reason") == "Unschedulable", "why")
    message = cluster.condition("demo", names.PODS_READY)["message"]
    assert "demo-trainer-0-abcde: 0/3 nodes are available" in message and "other" not in message
    assert "Insufficient nvidia.com/gpu" in cluster.status("demo")["message"]
    await wait_for(lambda: names.E_PODS_NOT_READY in reasons(cluster), "the PodsNotReady event")
    assert [r for t, r, _ in cluster.events("demo") if t == "Warning"] == [names.E_PODS_NOT_READY]


async def test_ttl_deletes_a_finished_job(cluster, operator):
    await cluster.apply(job_doc(ttlSecondsAfterFinished=2))
    await created(cluster)
    completed = time.monotonic()
    await cluster.set_status("batch/v1/jobs", "demo-trainer", {"conditions": [{"type": "Complete", "status": "True"}]})
    # Not "phase Succeeded, then gone": the TTL counts from the completion stamp, which has whole seconds (as
    # Kubernetes' own TTL controller counts from a condition's lastTransitionTime), so the phase may show for a
    # moment only and a poll can miss it (a CI run did, with a 1 s TTL). What stays is the Succeeded event; and
    # with the stamp's truncation (< 1 s), a 2 s TTL cannot end sooner than 1 s after the completion.
    await wait_for(lambda: cluster.get(CRD_RESOURCE, "demo") is None, "deletion after the TTL", timeout=10)
    assert time.monotonic() - completed >= 1.0, "deleted before ttlSecondsAfterFinished had passed"
    assert ("Normal", names.E_SUCCEEDED) in [(kind, reason) for kind, reason, _ in cluster.events("demo")]
    for resource in RESOURCE_OF.values():
        await wait_for(lambda r=resource: cluster.objects(r) == {}, f"{resource} to be collected")


# ---- what a real API server refuses --------------------------------------------------------------------------


async def test_a_child_the_api_refuses_fails_the_job_with_the_apis_message_and_a_fix_recovers(cluster, operator):
    # Valid by the schema (so `grpolora validate` passes it) but refused by the API server's own rules.
    await cluster.apply(job_doc(trainer={"tolerations": [{"key": "gpu", "operator": "Exists", "value": "yes"}]}))
    await wait_for(lambda: phase(cluster) == "Failed", "phase Failed")
    api_message = (
        'Job.batch "demo-trainer" is invalid: spec.template.spec.tolerations[0].operator: Invalid value: "yes": '
        "value must be empty when `operator` is 'Exists'"
    )
    failed = cluster.condition("demo", names.FAILED)
    assert failed["status"] == "True" and failed["reason"] == names.R_CREATE_REFUSED
    assert api_message in failed["message"] and "trainer Job demo-trainer" in failed["message"]
    assert api_message in cluster.status("demo")["message"]
    assert cluster.condition("demo", names.CREATED)["reason"] == names.R_CREATE_REFUSED
    await wait_for(lambda: any(t == "Warning" and api_message in m for t, _, m in cluster.events("demo")), "event")
    assert cluster.get("batch/v1/jobs", "demo-trainer") is None

    # The children were never all created, so the spec may still change: fixing it runs the job.
    await cluster.patch_spec("demo", {"trainer": {"tolerations": [{"key": "gpu", "operator": "Exists"}]}})
    await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer"), "the trainer Job after the fix")
    await wait_for(lambda: phase(cluster) == "Pending", "phase Pending after the fix")
    assert cluster.condition("demo", names.SPEC_CHANGE_REFUSED)["status"] == "False"
    assert cluster.condition("demo", names.FAILED)["status"] == "False"


async def test_without_rights_on_the_jobs_finalizers_the_job_fails_saying_so(trainer):
    # OpenShift's OwnerReferencesPermissionEnforcement with an operator lacking update on grpolorajobs/finalizers.
    def without_finalizers(verb: str, group: str, resource: str) -> bool:
        return resource != f"{c.PLURAL}/finalizers"

    async with running_cluster(authorize=without_finalizers) as cluster:
        operator = await OperatorThread(cluster.url, operator_options()).start()
        try:
            await cluster.apply(job_doc())
            await wait_for(lambda: phase(cluster) == "Failed", "phase Failed")
        finally:
            await operator.stop()
        message = cluster.condition("demo", names.FAILED)["message"]
        assert "forbidden: cannot set blockOwnerDeletion" in message and "grpolorajobs/finalizers" in message


async def test_delete_and_re_apply_under_the_same_name_gets_children_owned_by_the_new_job(cluster, operator):
    await cluster.apply(job_doc())
    await created(cluster)
    old_uid = cluster.job("demo")["metadata"]["uid"]
    # The old trainer Job completed: it must never mark the new job Succeeded.
    await cluster.set_status("batch/v1/jobs", "demo-trainer", {"conditions": [{"type": "Complete", "status": "True"}]})
    await wait_for(lambda: phase(cluster) == "Succeeded", "the old job succeeded")
    cluster.emulator.gc_delay = 1.0  # the collector is slow: the new job meets the old one's children
    await cluster.delete_job("demo")
    await cluster.apply(job_doc())
    new_uid = cluster.job("demo")["metadata"]["uid"]
    assert new_uid != old_uid
    versions_before = len(history(cluster)) - 1  # the stored versions of the new job start with its creation

    def owners() -> dict[str, str]:
        found = {}
        for resource in RESOURCE_OF.values():
            for name, obj in cluster.objects(resource).items():
                found[f"{resource}/{name}"] = obj["metadata"]["ownerReferences"][0]["uid"]
        return found

    await wait_for(
        lambda: len(owners()) == len(RESOURCE_OF) + 1 and set(owners().values()) == {new_uid},
        "every child owned by the new job",
        timeout=10,
    )
    # The status write follows the children in the same pass: wait for it rather than race it.
    await wait_for(lambda: phase(cluster) == "Pending", "the new job Pending")
    assert [s.get("phase") for s in history(cluster)[versions_before:] if s.get("phase") == "Succeeded"] == []
    assert cluster.get("batch/v1/jobs", "demo-trainer").get("status", {}).get("conditions") is None


async def test_a_job_naming_a_secret_the_operator_manages_fails_before_its_pods_exist(cluster, operator):
    """Confused deputy: the names the operator gives its Secrets are refused at validation; a Secret that carries its
    managed-by label under another name (e.g. one made by another release of it) is refused when the pods would be
    created, naming the field."""
    labels = {c.LABEL_MANAGED_BY: c.OPERATOR_NAME, c.LABEL_JOB: "victim"}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "victim-creds", "labels": labels},
              "stringData": {"MLFLOW_TRACKING_TOKEN": "theirs"}}  # fmt: skip
    await cluster._call("POST", f"/api/v1/namespaces/{NAMESPACE}/secrets", secret)
    mlflow = {"trackingUri": "http://mlflow.mlflow.svc:5000", "secretName": "victim-creds"}
    await cluster.apply(job_doc(tracking={"mlflow": mlflow}))
    await wait_for(lambda: phase(cluster) == "Failed", "phase Failed")
    failed = cluster.condition("demo", names.FAILED)
    assert failed["reason"] == names.R_MANAGED_SECRET
    assert failed["message"].startswith("spec.tracking.mlflow.secretName: Secret 'victim-creds' is managed by")
    assert [k for k in cluster.emulator.created if k[0] in ("jobs", "statefulsets")] == []


async def test_a_job_re_applied_after_a_background_delete_waits_for_the_old_trainer_pods(cluster, operator):
    """`kubectl delete glj` (background) then apply again: the collector removes the old trainer Job at once and its
    pods terminate for their grace period. The new job's trainer Job is created only once they are gone, or its
    ranks would meet the old ones (same labels, same rendezvous name) and wait for the GPUs they hold."""
    cluster.emulator.pod_exit_seconds = None  # the old ranks ignore SIGTERM
    await cluster.apply(job_doc())
    await created(cluster)
    old_pod = await cluster.run_pod_of("batch/v1/jobs", "demo-trainer")
    await cluster.delete_job("demo")
    await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer") is None, "the old trainer Job collected")
    await wait_for(lambda: cluster.get("v1/pods", old_pod)["metadata"].get("deletionTimestamp"), "pod Terminating")
    await cluster.apply(job_doc())
    await wait_for(lambda: "waiting for 1 pod of a previous trainer Job" in cluster.status("demo").get("message", ""),
                   "the new job waiting for the old pod")  # fmt: skip
    assert cluster.get("batch/v1/jobs", "demo-trainer") is None
    await cluster.emulator.end_grace_periods()
    await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer"), "the new trainer Job", timeout=15)


async def test_a_deleted_service_or_network_policy_comes_back(cluster, operator):
    await cluster.apply(job_doc())
    await created(cluster)
    uid = cluster.job("demo")["metadata"]["uid"]
    await cluster._call("DELETE", f"/api/v1/namespaces/{NAMESPACE}/services/demo-trainer")
    await cluster._call("DELETE", f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies/demo")
    await wait_for(lambda: cluster.get("v1/services", "demo-trainer"), "the Service back")
    await wait_for(lambda: cluster.get("networking.k8s.io/v1/networkpolicies", "demo"), "the NetworkPolicy back")
    assert cluster.get("v1/services", "demo-trainer")["metadata"]["ownerReferences"][0]["uid"] == uid


# ---- pods that are never created, volumes that cannot attach ------------------------------------------------------


async def post_event(cluster: Cluster, kind: str, name: str, reason: str, message: str) -> None:
    """A Warning event as the Job or StatefulSet controller or the kubelet posts it."""
    api_version = {"Job": "batch/v1", "StatefulSet": "apps/v1", "Pod": "v1"}[kind]
    await cluster._call(
        "POST",
        f"/api/v1/namespaces/{NAMESPACE}/events",
        {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": NAMESPACE},
            "involvedObject": {"apiVersion": api_version, "kind": kind, "name": name, "namespace": NAMESPACE},
            "type": "Warning",
            "reason": reason,
            "message": message,
        },
    )


async def test_pods_the_cluster_refuses_to_create_say_why_in_the_status(cluster, operator):
    await cluster.apply(job_doc())
    await created(cluster)
    quota = (
        'Error creating: pods "demo-trainer-0-x7k2p" is forbidden: exceeded quota: gpu-quota, requested: '
        "requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=4, limited: requests.nvidia.com/gpu=4"
    )
    await post_event(cluster, "Job", "demo-trainer", "FailedCreate", quota)
    await wait_for(lambda: cluster.condition("demo", names.PODS_READY).get("reason") == "FailedCreate", "why")
    assert f"Job demo-trainer: {quota}" in cluster.condition("demo", names.PODS_READY)["message"]
    assert "exceeded quota: gpu-quota" in cluster.status("demo")["message"]
    await wait_for(lambda: ("Warning", names.E_PODS_NOT_READY) in [e[:2] for e in cluster.events("demo")], "event")


async def test_a_volume_that_cannot_attach_says_why_instead_of_a_quiet_container_creating(cluster, operator):
    await cluster.apply(job_doc())
    await created(cluster)
    await cluster.add_pod(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "demo-inference-0", "namespace": NAMESPACE, "labels": pod_labels("demo", "inference")},
            "status": {
                "phase": "Pending",
                "containerStatuses": [
                    {
                        "name": "inference",
                        "ready": False,
                        "restartCount": 0,
                        "image": "worker:1",
                        "imageID": "",
                        "state": {"waiting": {"reason": "ContainerCreating"}},
                    }
                ],
            },
        }
    )
    multi_attach = 'Multi-Attach error for volume "pvc-4f1c" Volume is already used by pod(s) demo-trainer-0-x7k2p'
    await post_event(cluster, "Pod", "demo-inference-0", "FailedAttachVolume", multi_attach)
    await wait_for(lambda: cluster.condition("demo", names.PODS_READY).get("reason") == "FailedAttachVolume", "why")
    assert multi_attach in cluster.condition("demo", names.PODS_READY)["message"]
    await wait_for(lambda: any(multi_attach in m for t, _, m in cluster.events("demo") if t == "Warning"), "event")


async def add_claim(cluster: Cluster, name: str, *modes: str) -> None:
    await cluster._call(
        "POST",
        f"/api/v1/namespaces/{NAMESPACE}/persistentvolumeclaims",
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"accessModes": list(modes), "resources": {"requests": {"storage": "10Gi"}}},
        },
    )


async def test_a_read_write_once_model_claim_shared_by_several_pods_is_a_warning(cluster, operator):
    await add_claim(cluster, "weights", "ReadWriteOnce")
    await cluster.apply(job_doc(model={"source": {"pvc": {"claimName": "weights"}}}, inference={"replicas": 2}))
    await created(cluster)  # it may work if every pod lands on one node: warned, not refused
    await wait_for(lambda: cluster.condition("demo", names.VOLUMES_SHAREABLE).get("status") == "False", "warning")
    message = cluster.condition("demo", names.VOLUMES_SHAREABLE)["message"]
    assert "weights" in message and "ReadWriteOnce" in message and "ReadOnlyMany or ReadWriteMany" in message
    await wait_for(lambda: any("weights" in m for t, _, m in cluster.events("demo") if t == "Warning"), "event")


async def test_a_checkpoint_claim_that_several_trainer_ranks_cannot_share_is_refused(cluster, operator):
    await add_claim(cluster, "ckpts", "ReadWriteOncePod")
    await cluster.apply(job_doc(checkpoint={"pvc": {"claimName": "ckpts"}}, trainer={"replicas": 2}))
    await wait_for(lambda: phase(cluster) == "Failed", "phase Failed")
    message = cluster.condition("demo", names.FAILED)["message"]
    assert "ckpts" in message and "ReadWriteOncePod" in message and "ReadWriteMany" in message
    assert cluster.get("batch/v1/jobs", "demo-trainer") is None


async def test_a_toleration_the_kubernetes_schema_refuses_fails_the_job_naming_the_field(cluster, operator):
    # The CRD keeps tolerations as written (x-kubernetes-preserve-unknown-fields), so the apply passes; the operator
    # checks them as the API server would, before creating anything.
    await cluster.apply(job_doc(trainer={"tolerations": [{"key": "gpu", "operator": "Exist"}]}))
    await wait_for(lambda: phase(cluster) == "Failed", "phase Failed")
    invalid = cluster.condition("demo", names.INVALID_SPEC)
    assert 'spec.trainer.tolerations[0].operator: Unsupported value: "Exist"' in invalid["message"]
    assert cluster.get("v1/secrets", "demo-grpolora-token") is None
    assert cluster.get("batch/v1/jobs", "demo-trainer") is None


# ---- spec.activeDeadlineSeconds ---------------------------------------------------------------------------------


async def test_a_job_past_its_active_deadline_fails_with_deadline_exceeded_and_its_workloads_go(cluster, operator):
    """As a Kubernetes Job (and a RayJob): a cap on the whole run; then every pod goes and the job fails."""
    await cluster.apply(job_doc(activeDeadlineSeconds=2))
    await created(cluster)
    await pods_up(cluster)
    # Stamped by the status patch that ends the pass which created the children: `created` sees the children first
    # (CI once found the status still empty here).
    await wait_for(lambda: cluster.status("demo").get("activeSince"), "the job's activeSince stamped")
    await wait_for(lambda: phase(cluster) == "Failed", "the job failed at its deadline", timeout=15)
    assert cluster.condition("demo", "Failed")["reason"] == "DeadlineExceeded"
    await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer") is None, "the trainer Job gone")
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference") is None, "the StatefulSet gone")


async def test_a_re_applied_job_is_served_by_its_own_pods_not_by_the_old_ones_still_terminating(cluster, operator):
    """Deleted and applied again under its name, a job has a new uid; its old inference pod, Terminating (its
    containers ignore SIGTERM), keeps its DNS record in a headless Service that publishes not-ready addresses. The
    new job's Services select by its uid, so the new trainer never reaches the old replica."""
    cluster.emulator.pod_exit_seconds = None
    await cluster.apply(job_doc())
    await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference"), "the inference StatefulSet")
    old_pod = await cluster.run_pod_of("apps/v1/statefulsets", "demo-inference")
    old_uid = cluster.job("demo")["metadata"]["uid"]
    await cluster.delete_job("demo")
    await wait_for(lambda: (cluster.get("v1/pods", old_pod) or {}).get("metadata", {}).get("deletionTimestamp"),
                   "the old pod Terminating")  # fmt: skip
    await wait_for(lambda: cluster.get(CRD_RESOURCE, "demo") is None, "the old job gone")
    await cluster.apply(job_doc())
    new_uid = cluster.job("demo")["metadata"]["uid"]
    assert new_uid != old_uid

    def owned_by_new(resource: str, name: str) -> dict | None:
        found = cluster.get(resource, name)
        return found if found and found["metadata"]["ownerReferences"][0]["uid"] == new_uid else None

    service = await wait_for(lambda: owned_by_new("v1/services", "demo-inference"), "the new job's Service")
    statefulset = await wait_for(lambda: owned_by_new("apps/v1/statefulsets", "demo-inference"), "its StatefulSet")
    selector = service["spec"]["selector"].items()
    old_labels = cluster.get("v1/pods", old_pod)["metadata"]["labels"]
    assert cluster.get("v1/pods", old_pod)["metadata"].get("deletionTimestamp"), "still Terminating"
    assert not selector <= old_labels.items(), "the new job's Service selects the old job's pod"
    assert selector <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    await cluster.emulator.end_grace_periods()
