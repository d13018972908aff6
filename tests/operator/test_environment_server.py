"""spec.environment.server as a role the operator runs (issue 48), walked with the real operator against the emulator:
its StatefulSet `<job>-env`, headless Service, PodDisruptionBudget and NetworkPolicy created as `grpolora render`
builds them, its readiness in the job's status and PodsReady, a lost server pod over several passes, suspend and
resume with a pod on a lost node, Kueue's pod sets and eviction, and deletion with the job.

What the real components do, which the tests play (as test_lost_node.py and test_kueue.py do; nothing copied):
- The StatefulSet controller writes status.readyReplicas from its pods' Ready condition (pkg/controller/statefulset/
  stateful_set_control.go computeReplicaStatus: isRunningAndReady; Kubernetes 1.33), which the node lifecycle
  controller sets False on the pods of an unreachable node (pkg/controller/nodelifecycle, MarkPodsNotReady), and
  makes a pod of a lost pod's name only once that pod is gone (its identity is the name: processReplica skips a
  terminating pod). The tests write readyReplicas as it would (Cluster.set_status) and make pods as it does
  (Cluster.run_pod_of).
- The kubelet of a lost node never confirms a pod's end (Emulator.lost_nodes), so the pod stays Terminating and, with
  blockOwnerDeletion, holds its StatefulSet's foreground deletion (pkg/controller/garbagecollector
  processDeletingDependentsItem); a second DELETE in the Background drops the foregroundDeletion finalizer
  (apiserver registry/store.go deletionFinalizersForGarbageCollection), as test_lost_node.py cites. Kubernetes 1.33.
- The garbage collector deletes every child whose owner (ownerReferences, controller true) is gone (the emulator's
  collect_garbage).
"""

from __future__ import annotations

import datetime
from typing import Any

from grpolora.api import constants as c
from grpolora.api.load import parse_job
from grpolora.api.plan import plan
from grpolora.api.pool import environment_token
from grpolora.operator import names
from grpolora.operator.builders import build_children
from grpolora.operator.observe import POD_LOST_AFTER_SECONDS
from grpolora.testing.kube_emulator import CRD_RESOURCE as CRD
from grpolora.testing.kube_emulator import NAMESPACE, Cluster, as_stored
from tests.helpers import job_doc
from tests.operator.harness import OperatorThread, wait_for
from tests.operator.kueue_double import FakeKueue, find
from tests.operator.test_kueue import add_flavor, queued
from tests.operator.test_lost_node import LOST_NODE, clock_at, deadline_of
from tests.operator.test_operator import RESOURCE_OF, as_sent, phase

STS = "apps/v1/statefulsets"
SERVER = {"builtin": "calculator", "server": {"replicas": 2, "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}}


def served(**spec: Any) -> dict[str, Any]:
    return job_doc(environment=SERVER, **spec)


def environment(cluster: Cluster) -> dict[str, Any]:
    return (cluster.status("demo").get("replicas") or {}).get("environment") or {}


def pods_ready(cluster: Cluster) -> dict[str, Any]:
    return cluster.condition("demo", names.PODS_READY)


def statefulsets_created(cluster: Cluster, name: str) -> int:
    return len([k for k in cluster.emulator.created if k[0] == "statefulsets" and k[-1] == name])


async def up(cluster: Cluster, env_ready: int = 2) -> None:
    """The Job and StatefulSet controllers: the trainer pod runs, the replica is ready, `env_ready` server pods."""
    await cluster.set_status("batch/v1/jobs", "demo-trainer", {"active": 1, "ready": 1})
    await cluster.set_status(STS, "demo-inference", {"replicas": 1, "readyReplicas": 1})
    await cluster.set_status(STS, "demo-env", {"replicas": 2, "readyReplicas": env_ready})


async def passes(operator: OperatorThread, count: int) -> None:
    before = operator.passes()
    await wait_for(lambda: operator.passes() >= before + count, f"{count} passes of the operator")


async def test_the_server_is_created_as_rendered_counted_in_readiness_survives_a_lost_pod_and_goes_with_the_job(
    cluster, operator, trainer
):
    await cluster.apply(served())
    await wait_for(lambda: cluster.get(STS, "demo-env"), "the environment server's StatefulSet")
    await wait_for(lambda: cluster.get(STS, "demo-inference"), "the inference StatefulSet beside it")
    job = cluster.job("demo")
    token = cluster.secret_data("demo-grpolora-token")["token"]
    for obj in build_children(plan(parse_job(served())), owner_uid=job["metadata"]["uid"], token=token):
        actual = cluster.get(RESOURCE_OF[obj["kind"]], obj["metadata"]["name"])
        assert actual is not None, f"missing {obj['kind']} {obj['metadata']['name']}"
        assert as_sent(actual) == as_stored(obj), f"{obj['kind']} {obj['metadata']['name']} differs from the render"
    for kind, name in (("Service", "demo-env"), ("NetworkPolicy", "demo.env"), ("PodDisruptionBudget", "demo-env")):
        assert cluster.get(RESOURCE_OF[kind], name) is not None, kind
    await wait_for(lambda: environment(cluster) == {"desired": 2, "ready": 0}, "status.replicas.environment")

    # Ready: every role's pods, the server's included.
    trainer.report = {"phase": "Running", "totalSteps": 3, "syncMembers": [0], "step": 1}
    await up(cluster)
    await wait_for(lambda: pods_ready(cluster).get("status") == "True", "PodsReady")
    assert environment(cluster) == {"desired": 2, "ready": 2} and cluster.status("demo")["ready"] == "4/4"
    await wait_for(lambda: phase(cluster) == "Running", "Running")

    # A server pod lost (its node gone): the StatefulSet controller counts one ready, and cannot make a pod of its
    # name while it stays. The job runs on with the other server, over several passes: nothing is deleted or made.
    lost = await cluster.run_pod_of(STS, "demo-env", 0, node=LOST_NODE)
    cluster.emulator.lost_nodes.add(LOST_NODE)
    await cluster.delete_pod(lost)
    await up(cluster, env_ready=1)
    await wait_for(lambda: pods_ready(cluster).get("status") == "False", "PodsReady False")
    assert "environment 1/2 ready" in pods_ready(cluster)["message"]
    for _ in range(3):
        await passes(operator, 2)
        assert phase(cluster) == "Running" and environment(cluster) == {"desired": 2, "ready": 1}
        assert statefulsets_created(cluster, "demo-env") == 1 and cluster.get(STS, "demo-env") is not None
        assert cluster.get("v1/pods", lost) is not None, "only its node or an admin removes the lost pod"
    # Its node comes back and confirms; the controller makes the pod again and it turns ready.
    cluster.emulator.lost_nodes.discard(LOST_NODE)
    await cluster.emulator.end_grace_periods()
    await up(cluster, env_ready=2)
    await wait_for(lambda: pods_ready(cluster).get("status") == "True", "PodsReady again")

    # Deleted with the job: the collector removes every child of it, the server's too.
    await cluster.delete_job("demo")
    await wait_for(lambda: cluster.get(CRD, "demo") is None, "the job removed")
    await wait_for(lambda: cluster.get(STS, "demo-env") is None, "the server's StatefulSet collected", timeout=15)
    for kind, name in (("Service", "demo-env"), ("NetworkPolicy", "demo.env"), ("PodDisruptionBudget", "demo-env")):
        await wait_for(lambda k=kind, n=name: cluster.get(RESOURCE_OF[k], n) is None, f"the server's {kind} collected")


async def test_suspend_removes_the_server_and_a_pod_on_a_lost_node_does_not_hold_its_return(cluster, operator):
    """Suspend deletes the server's StatefulSet in the foreground with the other workloads; a server pod on a lost
    node holds it there. On resume the job wanted it again: it is released as the inference StatefulSet is (deleted
    again in the Background once the pod is past its lost deadline, the pod fenced out of the job's Services) and
    made again; before that deadline nothing is released."""
    await cluster.apply(served())
    await wait_for(lambda: cluster.get(STS, "demo-env"), "the children")
    lost = await cluster.run_pod_of(STS, "demo-env", 0, node=LOST_NODE)
    await cluster.run_pod_of(STS, "demo-env", 1, node="cpu-node-1")
    cluster.emulator.lost_nodes.add(LOST_NODE)
    await cluster.patch_spec("demo", {"suspend": True})
    await wait_for(lambda: phase(cluster) == "Suspended", "Suspended")
    await wait_for(lambda: cluster.get(STS, "demo-inference") is None, "the inference StatefulSet gone")
    await wait_for(lambda: (cluster.get("v1/pods", lost) or {}).get("metadata", {}).get("deletionTimestamp"), "lost")
    held = cluster.get(STS, "demo-env")
    assert held is not None and held["metadata"]["finalizers"] == ["foregroundDeletion"]
    assert environment(cluster).get("desired") == 0

    lost_at = deadline_of(cluster.get("v1/pods", lost)) + datetime.timedelta(seconds=POD_LOST_AFTER_SECONDS)
    assert operator.controller is not None
    operator.controller.clock = clock_at(lost_at - datetime.timedelta(seconds=5))
    await cluster.patch_spec("demo", {"suspend": False})
    await wait_for(lambda: statefulsets_created(cluster, "demo-inference") == 2, "the inference StatefulSet again")
    for _ in range(3):
        await passes(operator, 1)
        assert statefulsets_created(cluster, "demo-env") == 1, "released while not lost"

    operator.controller.clock = clock_at(lost_at + datetime.timedelta(seconds=1))
    await wait_for(lambda: statefulsets_created(cluster, "demo-env") == 2, "the server's StatefulSet made again")
    fresh = cluster.get(STS, "demo-env")
    assert fresh is not None and not fresh["metadata"].get("deletionTimestamp")
    assert c.LABEL_JOB_UID not in cluster.get("v1/pods", lost)["metadata"]["labels"], "still in its Service"


async def test_a_job_deleted_in_the_foreground_is_not_held_by_a_lost_server_pod(cluster, operator):
    await cluster.apply(served())
    await wait_for(lambda: cluster.get(STS, "demo-env"), "the children")
    lost = await cluster.run_pod_of(STS, "demo-env", 0, node=LOST_NODE)
    cluster.emulator.lost_nodes.add(LOST_NODE)
    await cluster.delete_job("demo", cascade="Foreground")
    await wait_for(lambda: (cluster.get("v1/pods", lost) or {}).get("metadata", {}).get("deletionTimestamp"), "lost")
    lost_at = deadline_of(cluster.get("v1/pods", lost)) + datetime.timedelta(seconds=POD_LOST_AFTER_SECONDS)
    assert operator.controller is not None
    operator.controller.clock = clock_at(lost_at - datetime.timedelta(seconds=5))
    await passes(operator, 3)
    assert cluster.get(CRD, "demo") is not None and cluster.get(STS, "demo-env") is not None

    operator.controller.clock = clock_at(lost_at + datetime.timedelta(seconds=1))
    await wait_for(lambda: cluster.get(CRD, "demo") is None, "the job removed", timeout=15)
    assert cluster.get(STS, "demo-env") is None and statefulsets_created(cluster, "demo-env") == 1


async def test_kueue_admits_the_server_as_a_third_pod_set_and_an_eviction_removes_it(cluster, operator):
    """The server's pods are the Workload's third pod set (`environment`, `replicas` pods): admitted with the others
    or not at all, placed by their own ResourceFlavor (a sandbox node pool's labels and taint go on its pods only),
    and removed with the others on an eviction, the quota given back once they are inactive."""
    sandbox = {"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}
    await add_flavor(cluster, "default", {})
    await add_flavor(cluster, "gvisor-nodes", {"sandbox.example.com/runtime": "gvisor"}, [sandbox])
    async with FakeKueue(cluster) as kueue:
        await cluster.apply(queued(environment=SERVER))
        await wait_for(lambda: kueue.workload("demo"), "the Kueue Workload")
        sets = kueue.workload("demo")["spec"]["podSets"]
        assert [(s["name"], s["count"]) for s in sets] == [("trainer", 1), ("inference", 1), ("environment", 2)]
        assert sets[2]["template"]["spec"]["containers"][0]["resources"] == SERVER["server"]["resources"]
        assert cluster.get(STS, "demo-env") is None, "not before Kueue admits the job"

        flavors = {"trainer": {"cpu": "default"}, "inference": {"cpu": "default"}}
        await kueue.admit("demo", {**flavors, "environment": {"cpu": "gvisor-nodes"}})
        await wait_for(lambda: cluster.get(STS, "demo-env"), "the server, once admitted")
        template = cluster.get(STS, "demo-env")["spec"]["template"]
        assert template["metadata"]["labels"]["kueue.x-k8s.io/podset"] == "environment"
        assert template["spec"]["nodeSelector"] == {"sandbox.example.com/runtime": "gvisor"}
        assert sandbox in template["spec"]["tolerations"]
        inference = cluster.get(STS, "demo-inference")["spec"]["template"]["spec"]
        assert "nodeSelector" not in inference and sandbox not in (inference.get("tolerations") or [])

        # Evicted: every workload goes, the server's too, and then the quota is given back.
        await kueue.evict("demo")
        await wait_for(lambda: cluster.get(STS, "demo-env") is None, "the server released")
        await wait_for(lambda: find(kueue.workload("demo"), "QuotaReserved")["status"] == "False", "the quota back")
        assert cluster.get(STS, "demo-inference") is None and cluster.get("batch/v1/jobs", "demo-trainer") is None


async def test_a_job_named_like_another_jobs_server_gets_its_own_network_policy(cluster, operator):
    """A job's NetworkPolicy is named after the job; had the server's been `<job>-env`, the jobs `calc` and
    `calc-env` of one namespace would both want the NetworkPolicy `calc-env`, and the second would wait for ever
    for "a deleted job of the same name" to leave it. The server's is `<job>.env`: a dot, which NetworkPolicy names
    (DNS subdomains) allow and job names (RFC 1035 labels) do not."""
    for name, environment_ in (("calc", SERVER), ("calc-env", None)):
        doc = job_doc(environment=environment_) if environment_ else job_doc()
        doc["metadata"]["name"] = name
        await cluster.apply(doc)
    for name in ("calc", "calc-env"):
        await wait_for(
            lambda n=name: cluster.condition(n, names.CREATED).get("status") == "True", f"{name}'s children created"
        )
    policies = cluster.objects("networking.k8s.io/v1/networkpolicies")
    owners = {name: obj["metadata"]["ownerReferences"][0]["name"] for name, obj in policies.items()}
    assert owners == {"calc": "calc", "calc.env": "calc", "calc-env": "calc-env"}, owners


def _secret_data(cluster: Cluster) -> dict[str, str]:
    """The job's token Secret as a real API server returns it (`data`, decoded; stringData is write-only)."""
    return cluster.secret_data("demo-grpolora-token")


async def test_a_token_secret_made_before_the_environment_key_gains_it_and_nothing_is_rekeyed(cluster, operator):
    """An operator upgraded over a running job: its token Secret was made by a release that wrote the job's token
    only, and the server's pods (made again by a resume, a restart) mount its key environment-token, without which
    the kubelet cannot start them. A pass adds the key, derived from the token the Secret holds; the token stays, so
    the job is not re-keyed and no workload is made again, over several passes."""
    await cluster.apply(served())
    await wait_for(lambda: cluster.get(STS, "demo-env"), "the children")
    token = _secret_data(cluster)[c.TOKEN_SECRET_KEY]
    # As an earlier release left it: `data` with one key.
    path = f"/api/v1/namespaces/{NAMESPACE}/secrets/demo-grpolora-token"
    await cluster._call("PATCH", path, {"data": {c.ENVIRONMENT_TOKEN_SECRET_KEY: None}})
    assert _secret_data(cluster) == {c.TOKEN_SECRET_KEY: token}
    await up(cluster)
    want = {c.TOKEN_SECRET_KEY: token, c.ENVIRONMENT_TOKEN_SECRET_KEY: environment_token(token)}
    await wait_for(lambda: _secret_data(cluster) == want, "the environment token added to the job's Secret")
    for _ in range(3):
        await passes(operator, 2)
        assert _secret_data(cluster) == want
        assert statefulsets_created(cluster, "demo-env") == 1 and statefulsets_created(cluster, "demo-inference") == 1
        assert cluster.condition("demo", names.PROGRESSING).get("reason") != names.R_REKEYING


NETWORK_POLICIES = "networking.k8s.io/v1/networkpolicies"
OPEN_EGRESS = [{"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"port": 443}]}]
STORED_EGRESS = [{"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"port": 443, "protocol": "TCP"}]}]


async def _full_pass(cluster: Cluster, operator: OperatorThread) -> None:
    """A full pass, as a kept child's deletion wakes one (drift repair): one of the job's Services deleted."""
    before = operator.passes()
    await cluster._call("DELETE", f"/api/v1/namespaces/{NAMESPACE}/services/demo-trainer")
    await wait_for(lambda: operator.passes() > before and cluster.get("v1/services", "demo-trainer"), "a full pass")


async def test_a_spec_fixed_after_a_refused_start_closes_the_servers_egress_and_leaves_its_pods_out(cluster, operator):
    """A create refused before the job started (here its trainer Job, by a policy) fails it without Created, and
    its spec may then change as a whole; its kept children were made from the first spec. The NetworkPolicies, the
    sandbox's only fence, follow the spec the job runs with: the server's egress closed by the fix is closed (it kept
    0.0.0.0/0), and a server added by the fix is left out of the job's NetworkPolicy (its pods were the job's
    peers on every port). A NetworkPolicy already as built is not written again, over several full passes (its
    egress port without a protocol, which a real API server defaults to TCP, too)."""
    from tests.operator.test_refusals import deny_jobs

    cluster.emulator.webhooks.append(deny_jobs)
    doc = job_doc(environment={"builtin": "calculator"})
    await cluster.apply(doc)
    await wait_for(lambda: cluster.condition("demo", names.FAILED).get("reason") == names.R_CREATE_REFUSED, "Failed")
    assert "matchExpressions" not in cluster.get(NETWORK_POLICIES, "demo")["spec"]["podSelector"]
    cluster.emulator.webhooks.remove(deny_jobs)
    server = {"replicas": 1, "resources": SERVER["server"]["resources"], "egress": OPEN_EGRESS}
    await cluster.patch_spec("demo", {"environment": {"server": server}})
    await wait_for(lambda: cluster.get(STS, "demo-env"), "the server, once the spec is fixed")
    assert cluster.get(NETWORK_POLICIES, "demo.env")["spec"]["egress"] == STORED_EGRESS
    job_pods = cluster.get(NETWORK_POLICIES, "demo")["spec"]["podSelector"]
    assert job_pods["matchExpressions"] == [{"key": c.LABEL_ROLE, "operator": "NotIn", "values": ["environment"]}]

    cluster.emulator.webhooks.append(deny_jobs)  # refused again: the egress is closed by the next fix
    await cluster.delete_job("demo")
    await wait_for(
        lambda: cluster.get(CRD, "demo") is None and cluster.get(NETWORK_POLICIES, "demo.env") is None, "gone"
    )
    await cluster.apply(job_doc(environment={"builtin": "calculator", "server": server}))
    await wait_for(lambda: cluster.condition("demo", names.FAILED).get("reason") == names.R_CREATE_REFUSED, "Failed")
    assert cluster.get(NETWORK_POLICIES, "demo.env")["spec"]["egress"] == STORED_EGRESS
    cluster.emulator.webhooks.remove(deny_jobs)
    await cluster.patch_spec("demo", {"environment": {"server": {"egress": []}}})
    await wait_for(lambda: cluster.get("batch/v1/jobs", "demo-trainer"), "the trainer Job, once the spec is fixed")
    await wait_for(lambda: cluster.get(NETWORK_POLICIES, "demo.env")["spec"]["egress"] == [], "the egress closed")

    start = len(cluster.emulator.log)
    for _ in range(3):
        await _full_pass(cluster, operator)
    written = [e for e in cluster.emulator.log[start:] if e[0] == "patch" and e[1] == "networkpolicies"]
    assert written == [], "a NetworkPolicy as built is written again"
