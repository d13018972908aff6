"""RBAC: a whole job lifecycle under Kopf peering and --all-namespaces, recording every API call the operator makes.

Every call must be allowed by grpolora.operator.rbac.RULES (the chart's ClusterRole is checked against RULES), and
every verb of every rule must have been needed: least privilege in both directions.
"""

from __future__ import annotations

import datetime

from grpolora.api import constants as c
from grpolora.operator import rbac
from grpolora.operator.scheduler import utcnow
from grpolora.testing.kube_emulator import CRD_RESOURCE, NAMESPACE, running_cluster
from tests.helpers import job_doc
from tests.operator.harness import OperatorThread, fake_trainer, operator_options, wait_for
from tests.operator.test_attempts import failed_trainer_pod
from tests.operator.test_pool import job_on_pool, pool_doc

PEERING = "grpo-lora-operator"
STAMP = "2026-01-01T00:00:00Z"


async def test_rules_cover_every_call_of_a_whole_lifecycle_and_each_verb_is_needed():
    async with running_cluster(peering=True) as cluster, fake_trainer() as trainer:
        # No peering object yet: the operator creates it (the chart cannot: see tests/chart/test_chart.py).
        options = operator_options(namespaces=(), all_namespaces=True, peering=PEERING, priority=10)
        operator = await OperatorThread(cluster.url, options).start()
        try:
            checkpoints = {"pvc": {"claimName": "ckpts"}}  # its access modes are read
            await cluster.apply(job_doc(trainer={"maxRestarts": 1}, checkpoint=checkpoints, ttlSecondsAfterFinished=0))
            await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference"), "children")
            await cluster.set_status("batch/v1/jobs", "demo-trainer", {"active": 1})
            trainer.report = {"phase": "Running", "totalSteps": 100, "step": 1, "syncRound": 1}
            await wait_for(lambda: cluster.status("demo").get("syncRound") == 1, "a trainer report")
            # Children that lost the operator's label (the watches follow it) get it back (patch).
            for api, plural, name in (
                ("/api/v1", "services", "demo-trainer"),
                ("/apis/policy/v1", "poddisruptionbudgets", "demo-inference"),
                ("/apis/batch/v1", "jobs", "demo-trainer"),
            ):
                unlabel = {"metadata": {"labels": {c.LABEL_MANAGED_BY: None}}}
                await cluster._call("PATCH", f"{api}/namespaces/{NAMESPACE}/{plural}/{name}", unlabel)
                await wait_for(lambda p=plural, n=name: ("patch", p, n) in cluster.emulator.log, f"{plural} relabelled")

            failed = {"conditions": [{"type": "Failed", "status": "True", "reason": "PodFailure"}]}
            # Its failed pod's log is read before the restart deletes it (pods/log).
            await cluster.add_pod(failed_trainer_pod(cluster, "demo-trainer-0-abcde", 1, finished=STAMP))
            cluster.emulator.pod_logs[(NAMESPACE, "demo-trainer-0-abcde", "trainer")] = "Traceback ...\n"
            await cluster.set_status("batch/v1/jobs", "demo-trainer", failed)
            await wait_for(lambda: ("get", "pods/log", "demo-trainer-0-abcde") in cluster.emulator.log, "the log read")
            await wait_for(lambda: len([k for k in cluster.emulator.created if k[0] == "jobs"]) == 2, "a restart")

            # Its pod's node is lost: suspended, the trainer Job (deleted in the foreground) stays, held by the pod.
            cluster.emulator.lost_nodes.add("gpu-node-lost")
            lost = await cluster.run_pod_of("batch/v1/jobs", "demo-trainer", node="gpu-node-lost")
            await cluster.patch_spec("demo", {"suspend": True})
            await wait_for(lambda: cluster.status("demo").get("phase") == "Suspended", "suspend")
            await wait_for(lambda: cluster.get("v1/pods", lost)["metadata"].get("deletionTimestamp"), "Terminating")
            # Resumed once the pod is taken as lost (the clock played): taken out of the Services (pods patch), its
            # Job deleted again in the background, and the trainer Job created again.
            assert operator.controller is not None
            operator.controller.clock = lambda: utcnow() + datetime.timedelta(minutes=5)
            await cluster.patch_spec("demo", {"suspend": False})
            await wait_for(lambda: ("patch", "pods", lost) in cluster.emulator.log, "the lost pod fenced")
            await wait_for(lambda: len([k for k in cluster.emulator.created if k[0] == "jobs"]) == 3, "resume")
            operator.controller.clock = utcnow

            complete = {"conditions": [{"type": "Complete", "status": "True"}]}
            await cluster.set_status("batch/v1/jobs", "demo-trainer", complete)
            await wait_for(lambda: cluster.get(CRD_RESOURCE, "demo", NAMESPACE) is None, "deletion after the TTL")

            # A job queued in Kueue: its Workload is created, followed, and marked Finished at the end.
            queued = job_doc(suspend=True)  # its Workload is created inactive, and reactivated on resume
            queued["metadata"].update(name="queued", labels={c.KUEUE_QUEUE_LABEL: "q"})
            # A Workload of that name still there from an older job (not collected yet): the create answers 409, and
            # the operator reads it (get) to learn whose it is, then waits for it to go.
            stale = {
                "apiVersion": "kueue.x-k8s.io/v1beta1",
                "kind": "Workload",
                "metadata": {"name": "queued", "labels": {c.LABEL_MANAGED_BY: c.OPERATOR_NAME, c.LABEL_JOB: "queued"}},
                "spec": {"queueName": "q", "podSets": []},
            }
            stale_path = f"/apis/kueue.x-k8s.io/v1beta1/namespaces/{NAMESPACE}/workloads"
            await cluster._call("POST", stale_path, stale)
            await cluster.apply(queued)
            await wait_for(lambda: ("get", "workloads", "queued") in cluster.emulator.log, "the owner of the old one")
            await cluster._call("DELETE", f"{stale_path}/queued")
            workloads = "kueue.x-k8s.io/v1beta1/workloads"
            await wait_for(lambda: (cluster.get(workloads, "queued") or {}).get("metadata", {}).get("ownerReferences"),
                           "the Kueue Workload")  # fmt: skip
            await cluster.patch_spec("queued", {"suspend": False})
            await wait_for(lambda: cluster.get(workloads, "queued")["spec"].get("active"), "the Workload reactivated")
            # Followed by watch; listed once per resync (what the watch missed: Controller._relisted).
            await wait_for(lambda: ("list", "workloads", None) in cluster.emulator.log, "a resync's re-list")
            admitted = [{"type": "Admitted", "status": "True", "reason": "Admitted", "message": "",
                         "lastTransitionTime": "2026-01-01T00:00:00Z"}]  # fmt: skip
            # Admitted to a ResourceFlavor, which the operator reads to place the pods.
            flavor = {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ResourceFlavor", "metadata": {"name": "gpu"}}
            await cluster._call("POST", "/apis/kueue.x-k8s.io/v1beta1/resourceflavors", flavor)
            assignments = [{"name": role, "flavors": {"nvidia.com/gpu": "gpu"}} for role in ("trainer", "inference")]
            admission = {"clusterQueue": "cq", "podSetAssignments": assignments}
            path = f"/apis/kueue.x-k8s.io/v1beta1/namespaces/{NAMESPACE}/workloads/queued/status"
            await cluster._call("PATCH", path, {"status": {"conditions": admitted, "admission": admission}})
            await wait_for(lambda: cluster.get("batch/v1/jobs", "queued-trainer"), "admitted")
            await cluster.set_status("batch/v1/jobs", "queued-trainer", complete)
            finished = lambda: "Finished" in str(cluster.get(workloads, "queued")["status"]["conditions"])  # noqa: E731
            await wait_for(finished, "the Workload Finished")
            # One that fails to start (a claim one pod at a time can use, two trainer ranks): its Workload Finished at
            # once; fixed, it runs again with a new one (the Finished one deleted).
            claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "once"},
                     "spec": {"accessModes": ["ReadWriteOncePod"]}}  # fmt: skip
            await cluster._call("POST", f"/api/v1/namespaces/{NAMESPACE}/persistentvolumeclaims", claim)
            refit = job_doc(checkpoint={"pvc": {"claimName": "once"}}, trainer={"replicas": 2})
            refit["metadata"].update(name="refit", labels={c.KUEUE_QUEUE_LABEL: "q"})
            await cluster.apply(refit)
            await wait_for(lambda: "FailedToStart" in str(cluster.get(workloads, "refit") or ""), "refit Finished")
            await cluster.patch_spec("refit", {"trainer": {"replicas": 1}})
            await wait_for(lambda: ("delete", "workloads", "refit") in cluster.emulator.log, "the Finished one deleted")

            # A RolloutPool of one place and two jobs on it: the second attaches when the first finishes (the pool
            # rewrites its attachment list and its NetworkPolicy); then it is scaled (its StatefulSet patched).
            await cluster.apply(pool_doc())
            await cluster.apply(job_on_pool("pool-a"))
            await cluster.apply(job_on_pool("pool-b"))
            await wait_for(lambda: cluster.get("batch/v1/jobs", "pool-a-trainer"), "pool-a attached")
            await cluster.set_status("batch/v1/jobs", "pool-a-trainer", complete)
            await wait_for(lambda: cluster.get("batch/v1/jobs", "pool-b-trainer"), "pool-b attached")
            pool = (
                f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{NAMESPACE}/{c.POOL_PLURAL}/{pool_doc()['metadata']['name']}"
            )
            await cluster._call("PATCH", f"{pool}/scale", {"spec": {"replicas": 2}})
            servers = f"{pool_doc()['metadata']['name']}-pool"
            await wait_for(lambda: cluster.get("apps/v1/statefulsets", servers)["spec"]["replicas"] == 2, "scaled")

            # Jobs on runtimes: a ClusterGRPOLoraRuntime and a GRPOLoraRuntime, each read until its job starts.
            spec = {"trainer": {"gpusPerReplica": 0}, "inference": {"gpusPerReplica": 0}, "sync": {"backend": "gloo"}}
            for kind, name in ((c.CLUSTER_RUNTIME_KIND, "everywhere"), (c.RUNTIME_KIND, "here")):
                meta = {"name": name, **({"namespace": NAMESPACE} if kind == c.RUNTIME_KIND else {})}
                await cluster.apply({"apiVersion": c.API_VERSION, "kind": kind, "metadata": meta, "spec": spec})
                on_runtime = job_doc(runtimeRef={"kind": kind, "name": name})
                on_runtime["metadata"]["name"] = f"on-{name}"
                await cluster.apply(on_runtime)
                await wait_for(lambda n=name: cluster.get("batch/v1/jobs", f"on-{n}-trainer"), f"the job on {name}")
        finally:
            await operator.stop()

        assert cluster.get("kopf.dev/v1/clusterkopfpeerings", PEERING, None) is not None
        calls = cluster.emulator.calls
        denied = sorted(call for call in calls if not rbac.allowed(*call))
        assert not denied, f"not allowed by RULES: {denied}"
        unused = [
            (rule.api_groups, rule.resources, verb)
            for rule in rbac.RULES
            for verb in rule.verbs
            if not any((verb, group, resource) in calls for group in rule.api_groups for resource in rule.resources)
        ]
        assert not unused, f"RULES grant verbs the operator never used: {unused}"
        assert ("patch", c.GROUP, f"{c.PLURAL}/status") in calls
