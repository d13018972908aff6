"""The objects of a RolloutPool, built by the same builders as a job's inference role, and those of a job on a pool."""

from __future__ import annotations

import base64
import json

import kubernetes_validate

from grpolora.api import constants as c
from grpolora.api import contract
from grpolora.api.load import parse_job
from grpolora.api.plan import plan, plan_pool
from grpolora.api.pool import Attachments, PoolReplicas, attachment
from grpolora.api.spec import RolloutPool
from grpolora.operator import builders
from tests.helpers import job_doc
from tests.unit.test_pool import job_on_pool, pool, pool_doc

TOKEN = "a-job-token-that-must-never-reach-the-pool"


def attached(*names: str) -> Attachments:
    job = job_on_pool()
    return Attachments(pool="shared", jobs=[attachment("rl", name, f"uid-{name}", TOKEN, job.spec) for name in names])


def pool_children(rollout_pool: RolloutPool | None = None, *names: str) -> dict[str, dict]:
    objects = builders.build_pool_children(
        plan_pool(rollout_pool or pool(nodeSelector={"gpu": "h100"}, maxJobs=3)),
        owner_uid="pool-uid",
        attachments=attached(*names),
    )
    return {o["kind"]: o for o in objects}


def test_a_pool_gets_its_secret_service_network_policy_budget_and_statefulset_all_owned_by_it():
    objects = builders.build_pool_children(plan_pool(pool()), owner_uid="pool-uid", attachments=attached("a"))
    assert [o["kind"] for o in objects] == ["Secret", "Service", "NetworkPolicy", "PodDisruptionBudget", "StatefulSet"]
    assert [o["metadata"]["name"] for o in objects] == [
        "shared-pool-jobs", "shared-pool", "shared-pool", "shared-pool", "shared-pool"
    ]  # fmt: skip
    for obj in objects:
        kubernetes_validate.validate(obj, "1.33.0", strict=True)
        assert obj["metadata"]["namespace"] == "rl"
        assert obj["metadata"]["ownerReferences"] == [
            {"apiVersion": "grpolora.dev/v1alpha1", "kind": "RolloutPool", "name": "shared", "uid": "pool-uid",
             "controller": True, "blockOwnerDeletion": True}
        ]  # fmt: skip
        assert obj["metadata"]["labels"][c.LABEL_POOL] == "shared" and c.LABEL_JOB not in obj["metadata"]["labels"]


def test_the_pool_statefulset_runs_the_pool_plan_with_the_attachment_list_mounted_and_no_job_token():
    sts = pool_children()["StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert sts["spec"]["selector"]["matchLabels"] == {c.LABEL_POOL: "shared", c.LABEL_ROLE: "inference"}
    assert sts["spec"]["serviceName"] == "shared-pool" and sts["spec"]["replicas"] == 2
    assert container["name"] == "inference" and container["args"] == ["worker", "inference", "--lora-slots=6"]
    env = {e["name"]: e for e in container["env"]}
    expected = plan_pool(pool(nodeSelector={"gpu": "h100"}, maxJobs=3)).inference.env
    assert [e["name"] for e in container["env"]] == [v.name for v in expected]
    assert contract.TOKEN not in env and not any("secretKeyRef" in e.get("valueFrom", {}) for e in env.values())
    assert env[contract.POOL_NAME]["value"] == "shared"
    assert env[contract.REPLICA_INDEX]["valueFrom"]["fieldRef"]["fieldPath"] == c.STATEFULSET_POD_INDEX_FIELD
    jobs_file = env[contract.POOL_JOBS_FILE]["value"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "pool-jobs")
    assert mount == {"name": "pool-jobs", "mountPath": jobs_file.rsplit("/", 1)[0], "readOnly": True}
    assert jobs_file.rsplit("/", 1)[1] == "jobs.json"
    assert {"name": "pool-jobs", "secret": {"secretName": "shared-pool-jobs"}} in pod["volumes"]
    assert pod["automountServiceAccountToken"] is False and pod["nodeSelector"] == {"gpu": "h100"}
    # The same builder as a job's inference role: the same probes and container hardening.
    own = builders.inference_statefulset(plan(parse_job(job_doc())))
    own_container = own["spec"]["template"]["spec"]["containers"][0]
    for key in ("startupProbe", "readinessProbe", "livenessProbe", "securityContext", "terminationMessagePolicy"):
        assert container[key] == own_container[key], key


def test_the_attachment_secret_lists_the_jobs_without_their_token():
    secret = pool_children(None, "a", "b")["Secret"]
    text = base64.b64decode(secret["data"]["jobs.json"]).decode()
    assert TOKEN not in text
    assert [j["job"] for j in json.loads(text)["jobs"]] == ["rl/a", "rl/b"]
    assert builders.attachments_of(secret) == attached("a", "b")
    assert builders.attachments_of(None) is None


def test_the_pool_network_policy_admits_exactly_the_attached_jobs_trainers_and_the_operator():
    policy = pool_children(None, "b", "a")["NetworkPolicy"]["spec"]
    assert policy["podSelector"] == {"matchLabels": {c.LABEL_POOL: "shared"}}
    jobs, operator = policy["ingress"]
    assert jobs == {
        "from": [
            {"podSelector": {"matchLabels": {c.LABEL_JOB: "a", c.LABEL_ROLE: "trainer"}}},
            {"podSelector": {"matchLabels": {c.LABEL_JOB: "b", c.LABEL_ROLE: "trainer"}}},
        ]
    }  # no namespaceSelector: the pool's own namespace, where its jobs are
    assert operator["from"][0]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": c.DEFAULT_OPERATOR_NAMESPACE}
    }
    assert operator["ports"] == [{"port": 8000, "protocol": "TCP"}]


def test_with_no_job_attached_the_pool_network_policy_admits_only_the_operator():
    (only,) = pool_children()["NetworkPolicy"]["spec"]["ingress"]
    assert only["from"][0]["podSelector"] == {"matchLabels": {c.LABEL_NAME: c.OPERATOR_NAME}}  # never `from: []`


def test_metrics_peers_of_the_pool_reach_its_http_port():
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    rollout_pool = RolloutPool.model_validate(pool_doc(networkPolicy={"metricsFrom": [peer]}))
    assert pool_children(rollout_pool)["NetworkPolicy"]["spec"]["ingress"][-1] == {
        "from": [peer],
        "ports": [{"port": 8000, "protocol": "TCP"}],
    }


def test_a_job_on_a_pool_brings_only_its_trainer_and_admits_the_pool_servers():
    job = job_on_pool()
    objects = builders.build_children(plan(job, pool=pool()), owner_uid="u", token="t")
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("Secret", "demo-grpolora-token"), ("Service", "demo-trainer"), ("NetworkPolicy", "demo"),
        ("Job", "demo-trainer"),
    ]  # fmt: skip
    for obj in objects:
        kubernetes_validate.validate(obj, "1.33.0", strict=True)
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy")["spec"]
    assert policy["ingress"][0]["from"] == [
        {"podSelector": {"matchLabels": {c.LABEL_JOB: "demo"}}},
        {"podSelector": {"matchLabels": {c.LABEL_POOL: "shared"}}},
    ]
    trainer = next(o for o in objects if o["kind"] == "Job")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert (
        env[contract.INFERENCE_ENDPOINTS]
        == "http://shared-pool-0.shared-pool.rl.svc:8000,http://shared-pool-1.shared-pool.rl.svc:8000"
    )


def test_kueue_queues_only_the_trainer_of_a_job_on_a_pool():
    doc = job_doc(model={"name": "Qwen/Qwen3-0.6B", "dtype": "bfloat16"}, inference={"poolRef": {"name": "shared"}})
    doc["metadata"] |= {"namespace": "rl", "labels": {c.KUEUE_QUEUE_LABEL: "gpu"}}
    objects = builders.build_children(plan(parse_job(doc), pool=pool()), owner_uid="u", token="t")
    workload = next(o for o in objects if o["kind"] == "Workload")
    assert [(s["name"], s["count"]) for s in workload["spec"]["podSets"]] == [("trainer", 1)]


def test_a_job_on_a_pool_round_trips_through_its_wire_form():
    """The operator records the applied spec as JSON (to_wire) and reads it back on every pass; a job on a pool
    wrote only poolRef under inference, so its wire form must too (the defaults would read as set fields)."""
    from grpolora.api.spec import GRPOLoraJobSpec

    spec = job_on_pool().spec
    assert spec.to_wire()["inference"] == {"poolRef": {"name": "shared"}}
    assert GRPOLoraJobSpec.model_validate(spec.to_wire()) == spec


def test_a_pool_pod_template_cannot_replace_the_attachment_list_or_the_pool_label():
    import pytest

    from grpolora.api.spec import FieldErrors

    swap = {"spec": {"volumes": [{"name": "pool-jobs", "secret": {"secretName": "my-own-list"}}]}}
    relabel = {"metadata": {"labels": {c.LABEL_POOL: "other"}}}
    remount = {"spec": {"containers": [{"name": "inference", "volumeMounts": [
        {"name": "x", "mountPath": "/var/run/grpolora/pool"}]}]}}  # fmt: skip
    for overlay, path in ((swap, "spec.volumes"), (relabel, "metadata.labels"), (remount, "volumeMounts")):
        with pytest.raises((FieldErrors, ValueError)) as caught:
            RolloutPool.model_validate(pool_doc(podTemplate=overlay))
        assert path in str(caught.value), overlay


def test_the_pool_statefulset_template_does_not_depend_on_replicas_so_scaling_replaces_no_pod():
    """A scale is a patch of spec.replicas alone: a template that changed with it would roll every server (and
    every job's rollouts) for a scale-up. So the servers' env holds no count of replicas (the pool's spec less
    replicas, their own port rather than every replica's endpoint); the replicas are in the attachment list."""
    one, three = (pool_children(pool(replicas=n))["StatefulSet"] for n in (1, 3))
    assert (one["spec"]["replicas"], three["spec"]["replicas"]) == (1, 3)
    assert one["spec"]["template"] == three["spec"]["template"]
    env = {e["name"]: e.get("value") for e in one["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert contract.INFERENCE_ENDPOINTS not in env and env[contract.HTTP_PORT] == "8000"
    assert "replicas" not in json.loads(env[contract.POOL_SPEC])


def test_the_pool_secret_names_the_pools_replicas_for_the_jobs_trainers_beside_the_attachment_list():
    """Trainers learn of a scaled pool's replicas from its servers, which read them from the Secret's volume (it
    follows the Secret; the pool's generation tells the newer list from an older one a server still holds). A key
    of its own: a server of an earlier release refuses fields its attachment list does not know."""
    objects = builders.build_pool_children(
        plan_pool(pool(replicas=3)), owner_uid="pool-uid", attachments=attached("a"), generation=5
    )
    secret = next(o for o in objects if o["kind"] == "Secret")
    assert set(secret["data"]) == {"jobs.json", "replicas.json"}
    assert set(json.loads(base64.b64decode(secret["data"]["jobs.json"]))) == {"pool", "jobs"}
    listed = PoolReplicas.model_validate_json(base64.b64decode(secret["data"]["replicas.json"]))
    assert listed.generation == 5 and listed.endpoints == (
        "http://shared-pool-0.shared-pool.rl.svc:8000",
        "http://shared-pool-1.shared-pool.rl.svc:8000",
        "http://shared-pool-2.shared-pool.rl.svc:8000",
    )
