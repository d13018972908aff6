"""A failed job can be read: the operator reads the failed trainer pod's log (pods/log) in the pass that sees the
attempt fail, before the restart deletes the pod, and keeps its tail in status.lastFailedAttempt and a
TrainerAttemptFailed event. Against the API emulator, which serves pods/log as the API server does
(grpolora.testing.kube_emulator.Emulator.pod_logs)."""

from __future__ import annotations

from typing import Any

import kopf
import pytest

from grpolora.operator import kube, names
from grpolora.testing.kube_emulator import NAMESPACE, Cluster, running_cluster
from tests.helpers import job_doc
from tests.operator.harness import wait_for
from tests.operator.test_operator import created, pod_labels, reasons

LOG = "".join(f"step {i}: loss 0.{i:03d}\n" for i in range(200)) + (
    "Traceback (most recent call last):\n"
    '  File "/app/workers/trainer/step.py", line 88, in step\n'
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
)


def failed_trainer_pod(cluster: Cluster, name: str, exit_code: int, *, finished: str) -> dict[str, Any]:
    """A trainer pod of the current trainer Job whose container exited, as the Job controller and kubelet leave it."""
    owner = cluster.get("batch/v1/jobs", "demo-trainer")
    assert owner is not None
    terminated = {"exitCode": exit_code, "reason": "Error", "finishedAt": finished}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": pod_labels("demo", "trainer"),
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": "demo-trainer",
                    "uid": owner["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {"containers": [{"name": "trainer", "image": "x"}]},
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "name": "trainer",
                    "image": "x",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": terminated},
                }
            ],
        },
    }


async def test_the_client_reads_a_containers_log_tail_as_the_api_serves_it():
    async with running_cluster(authorize=None) as cluster:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p", "labels": {}},
            "spec": {"containers": [{"name": "trainer", "image": "x"}]},
        }
        await cluster.add_pod(pod)
        client = kube.KubeClient(lambda: kopf.ConnectionInfo(server=cluster.url))
        try:
            with pytest.raises(kube.ApiError) as waiting:
                await client.pod_log(NAMESPACE, "p", container="trainer", tail_lines=5, limit_bytes=1000)
            assert waiting.value.status == 400 and "waiting to start" in str(waiting.value)
            cluster.emulator.pod_logs[(NAMESPACE, "p", "trainer")] = LOG
            tail = await client.pod_log(NAMESPACE, "p", container="trainer", tail_lines=2, limit_bytes=10_000)
            assert tail == "".join(LOG.splitlines(keepends=True)[-2:])  # the last two lines, as written
            assert tail.endswith("Tried to allocate 2.00 GiB\n")
            # limitBytes cuts the front of the tail window: the server stops reading there.
            cut = await client.pod_log(NAMESPACE, "p", container="trainer", tail_lines=2, limit_bytes=10)
            assert cut == tail[:10]
            assert await client.pod_log(NAMESPACE, "gone", container="trainer", tail_lines=2, limit_bytes=10) is None
            with pytest.raises(kube.ApiError, match="container sidecar is not valid for pod p"):
                await client.pod_log(NAMESPACE, "p", container="sidecar", tail_lines=2, limit_bytes=10)
        finally:
            await client.close()


async def test_a_restart_keeps_the_failed_pods_log_tail_in_status_and_an_event(cluster, operator):
    await cluster.apply(job_doc(trainer={"maxRestarts": 2}))
    await created(cluster)
    # Rank 1 ran out of memory; torch then stopped rank 0 (SIGTERM): rank 1's log says why.
    await cluster.add_pod(failed_trainer_pod(cluster, "demo-trainer-0-aaaaa", 143, finished="2026-01-01T00:00:11Z"))
    await cluster.add_pod(failed_trainer_pod(cluster, "demo-trainer-1-bbbbb", 1, finished="2026-01-01T00:00:10Z"))
    cluster.emulator.pod_logs[(NAMESPACE, "demo-trainer-0-aaaaa", "trainer")] = "stopped by SIGTERM\n"
    cluster.emulator.pod_logs[(NAMESPACE, "demo-trainer-1-bbbbb", "trainer")] = LOG
    failed = {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}
    await cluster.set_status("batch/v1/jobs", "demo-trainer", failed)

    await wait_for(lambda: cluster.status("demo").get("lastFailedAttempt"), "the failed attempt kept")
    kept = cluster.status("demo")["lastFailedAttempt"]
    assert kept["attempt"] == 1 and kept["pod"] == "demo-trainer-1-bbbbb" and kept["exitCode"] == 1
    assert kept["logTail"].endswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert len(kept["logTail"].split("\n")) == 50 and kept["logTail"].startswith("step 153: ")
    await wait_for(lambda: names.E_TRAINER_ATTEMPT_FAILED in reasons(cluster), "the event")
    (message,) = [m for _, reason, m in cluster.events("demo") if reason == names.E_TRAINER_ATTEMPT_FAILED]
    assert message.startswith("attempt 1: pod demo-trainer-1-bbbbb exited with code 1 (Error)")
    assert message.endswith("Tried to allocate 2.00 GiB")

    # The restart deletes the pods with their Job; the kept attempt stays through the passes after it.
    await wait_for(lambda: len([k for k in cluster.emulator.created if k[0] == "jobs"]) == 2, "the restart")
    await wait_for(lambda: cluster.get("v1/pods", "demo-trainer-1-bbbbb") is None, "the failed pod gone")
    assert cluster.status("demo")["trainerRestarts"] == 1
    assert cluster.status("demo")["lastFailedAttempt"] == kept
