"""The job pass against the API emulator, without Kopf: what one pass reads and how often it decides."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest

from grpolora.api import constants as c
from grpolora.operator import kube
from grpolora.operator import reconcile as rec
from grpolora.operator.controller import Controller
from grpolora.operator.metrics import Metrics
from grpolora.operator.scheduler import ControllerConfig
from grpolora.operator.trainer_client import TrainerStatusClient
from grpolora.testing.kube_emulator import NAMESPACE, Cluster
from tests.helpers import job_doc
from tests.operator.harness import wait_for
from tests.operator.test_kueue import add_flavor, to


@pytest.fixture
async def controller(cluster: Cluster) -> AsyncIterator[Controller]:
    """The operator's Controller on a client of the emulator; its passes are run by the test (no monitors, no Kopf:
    what its watches would report, the test gives it)."""
    client = kube.KubeClient(lambda: kopf.ConnectionInfo(server=cluster.url))
    metrics = Metrics()
    running = Controller(client, TrainerStatusClient(metrics=metrics), metrics, ControllerConfig(3600.0, 3600.0))
    yield running
    await running.stop()
    await client.close()


async def test_a_pass_that_needs_every_read_reads_them_at_once_and_decides_twice(
    cluster, kueue, controller, monkeypatch
):
    """A started, queued job admitted to ResourceFlavors, whose workloads are to be created while a trainer pod of
    an earlier Job of its name is left: its pass must read the owner again, the flavors, the trainer pods and the
    Secrets the job names. It decides once, reads all of that, and decides a second and last time."""
    await add_flavor(cluster, "default", {})
    await add_flavor(cluster, "h100", {"gpu.example.com/pool": "h100"})
    doc = job_doc(model={"name": "Qwen/Qwen3-0.6B", "tokenFrom": {"secretName": "hub-token"}})
    doc["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "gpu-queue"}
    await cluster.apply(doc)
    job = controller._track(cluster.job("demo"))
    await controller._pass(job, full=True)  # its first pass: the kept children and its Workload
    await wait_for(lambda: kueue.workload("demo"), "the Workload")
    await kueue.admit("demo", to(trainer="h100", inference="h100"))
    # A trainer pod of an earlier Job of this name, stopped and left (its Job deleted in the background).
    labels = {c.LABEL_MANAGED_BY: c.OPERATOR_NAME, c.LABEL_JOB: "demo", c.LABEL_ROLE: c.ROLE_TRAINER}
    left = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "demo-trainer-0-old", "labels": labels},
            "spec": {"containers": [{"name": "trainer", "image": "x"}]}, "status": {"phase": "Failed"}}  # fmt: skip
    await cluster.add_pod(left)

    decisions: list[rec.Decision] = []
    real = rec.decide

    def counted(*args: Any, **kwargs: Any) -> rec.Decision:
        decisions.append(real(*args, **kwargs))
        return decisions[-1]

    controller.cache.pop(("Workload", NAMESPACE, "demo"), None)  # what the Workload's watch would have reported
    monkeypatch.setattr(rec, "decide", counted)
    before = len(cluster.emulator.log)
    job.body = cluster.job("demo")
    await controller._pass(job, full=True)

    assert len(decisions) == 2, [d.needs for d in decisions]
    first, last = decisions
    assert first.needs == rec.Needs(owner=True, flavors=("default", "h100"), trainer_pods=True, secrets=True)
    assert not last.needs and {o["kind"] for o in last.create} == {"Job", "StatefulSet"}
    reads = cluster.emulator.log[before:]
    for read in (
        ("get", "grpolorajobs", "demo"),
        ("get", "resourceflavors", "default"),
        ("get", "resourceflavors", "h100"),
        ("list", "pods", None),
        ("get", "secrets", "hub-token"),
    ):
        assert read in reads, f"not read: {read}"
    assert cluster.get("batch/v1/jobs", "demo-trainer") is not None
    assert cluster.get("apps/v1/statefulsets", "demo-inference") is not None
