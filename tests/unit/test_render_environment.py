"""spec.environment.server rendered (issue 48): its StatefulSet of per-pod names, the headless Service selecting its
pods, its NetworkPolicy (ingress from the job's trainer pods on its port only, no egress unless the spec opens it),
the job's NetworkPolicy leaving its pods out, the trainer's GRPOLORA_ENVIRONMENT_URL, the token file, its pod set in
the Kueue Workload; all valid Kubernetes objects."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import yaml

from grpolora.api import constants as c
from grpolora.api import contract
from grpolora.api.load import parse_job
from grpolora.api.plan import LoopbackNetwork, environment_server_command, plan
from grpolora.api.pool import environment_token
from grpolora.api.spec import RolloutPool
from grpolora.operator.builders import JOB_UID_LABEL, build_children
from tests.helpers import job_doc
from tests.unit.test_cli_conventions import run
from tests.unit.test_pool import pool_doc
from tests.unit.test_render import K8S_VERSION, by_kind, env_of

SERVER = {"replicas": 2, "runtimeClassName": "gvisor", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}


def served(**server: Any) -> dict[str, Any]:
    doc = job_doc(environment={"builtin": "calculator", "server": {**SERVER, **server}})
    doc["metadata"]["name"] = "job"
    return doc


def children(doc: dict[str, Any], **kw: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return by_kind(build_children(plan(parse_job(doc)), owner_uid="u-1", token="tok", **kw))


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, and matchExpressions In/NotIn/Exists/DoesNotExist) against a pod's labels, as
    apimachinery's labels.Selector reads one (k8s.io/apimachinery pkg/apis/meta/v1/helpers.go
    LabelSelectorAsSelector, v0.33)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for rule in selector.get("matchExpressions") or []:
        key, op, values = rule["key"], rule["operator"], rule.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if (op == "Exists") != (key in labels) and op in ("Exists", "DoesNotExist"):
            return False
    return True


def _pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def test_server_of_two_replicas_renders_a_statefulset_a_service_and_a_network_policy():
    doc = served()
    doc["metadata"]["name"] = "calc"
    objects = children(doc)
    sts = objects[("StatefulSet", "calc-env")]
    assert sts["spec"]["replicas"] == 2 and sts["spec"]["serviceName"] == "calc-env"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    pod = sts["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "gvisor" and pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "grpolora.workers.environments.service"]
    token_file = env_of(sts)[contract.ENVIRONMENT_TOKEN_FILE]
    assert container["args"] == ["--environment", "calculator", "--port", "8000", "--token-file", token_file]
    assert container["resources"] == SERVER["resources"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    # The environment token as a file; no other Secret, no model, no spec.
    assert env_of(sts) == {contract.ENVIRONMENT_TOKEN_FILE: token_file, contract.ENVIRONMENT_PORT: "8000"}
    (secret_volume,) = [v for v in pod["volumes"] if "secret" in v]
    assert secret_volume["secret"]["secretName"] == "calc-grpolora-token"
    assert token_file.startswith(next(m["mountPath"] for m in container["volumeMounts"] if m["name"] ==
                                      secret_volume["name"]))  # fmt: skip

    service = objects[("Service", "calc-env")]
    assert service["spec"]["clusterIP"] == "None"
    assert _matches({"matchLabels": service["spec"]["selector"]}, _pod_labels(sts))
    trainer, inference = objects[("Job", "calc-trainer")], objects[("StatefulSet", "calc-inference")]
    assert not _matches({"matchLabels": service["spec"]["selector"]}, _pod_labels(trainer))
    assert not _matches({"matchLabels": service["spec"]["selector"]}, _pod_labels(inference))

    # The trainer reaches each pod by its own name, in pod order.
    assert env_of(trainer)[contract.ENVIRONMENT_URL] == (
        "http://calc-env-0.calc-env.team-a.svc:8000,http://calc-env-1.calc-env.team-a.svc:8000"
    )
    assert contract.ENVIRONMENT_URL not in env_of(inference)


def test_the_server_pods_hold_the_environment_token_and_never_the_jobs():
    """The server runs model-driven code: its pods mount only the token Secret's environment key (a token derived from
    the job's, which the inference servers refuse), not the job's token, with which a compromised server could call
    the replicas' control and generate endpoints. The trainer mounts the job's token and derives the server's."""
    objects = children(served())
    secret = objects[("Secret", "job-grpolora-token")]
    assert secret["stringData"] == {
        c.TOKEN_SECRET_KEY: "tok",
        c.ENVIRONMENT_TOKEN_SECRET_KEY: environment_token("tok"),
    }
    assert environment_token("tok") != "tok" and len(environment_token("tok")) == 64

    def secret_items(workload: dict[str, Any]) -> list[tuple[str, str]]:
        volumes = workload["spec"]["template"]["spec"]["volumes"]
        secrets = [v["secret"] for v in volumes if "secret" in v]
        return [(secret["secretName"], item["key"]) for secret in secrets for item in secret["items"]]

    env_key, job_key = [("job-grpolora-token", key) for key in (c.ENVIRONMENT_TOKEN_SECRET_KEY, c.TOKEN_SECRET_KEY)]
    assert secret_items(objects[("StatefulSet", "job-env")]) == [env_key]
    assert secret_items(objects[("Job", "job-trainer")]) == [job_key]
    assert secret_items(objects[("StatefulSet", "job-inference")]) == [job_key]


def test_network_policies_admit_only_the_trainer_to_the_server_and_keep_the_server_out_of_the_job():
    doc = served()
    doc["metadata"]["name"] = "calc"
    objects = children(doc)
    pods = {
        role: _pod_labels(objects[key])
        for role, key in (
            ("trainer", ("Job", "calc-trainer")),
            ("inference", ("StatefulSet", "calc-inference")),
            ("environment", ("StatefulSet", "calc-env")),
        )
    }
    other_job = {**pods["trainer"], c.LABEL_JOB: "other", JOB_UID_LABEL: "u-2"}

    mine = objects[("NetworkPolicy", "calc.env")]["spec"]
    assert mine["policyTypes"] == ["Ingress", "Egress"] and mine["egress"] == []
    assert [role for role, labels in pods.items() if _matches(mine["podSelector"], labels)] == ["environment"]
    (rule,) = mine["ingress"]
    assert rule["ports"] == [{"port": 8000, "protocol": "TCP"}]
    admitted = [role for role, labels in pods.items() if any(_matches(p["podSelector"], labels) for p in rule["from"])]
    assert admitted == ["trainer"] and not any(_matches(p["podSelector"], other_job) for p in rule["from"])

    # The job's own policy: its pods admit each other on every port, but the environment's pods are neither
    # protected by it (theirs is above) nor admitted by it (a sandbox that opened egress reaches no trainer).
    job = objects[("NetworkPolicy", "calc")]["spec"]
    assert [role for role, labels in pods.items() if _matches(job["podSelector"], labels)] == ["trainer", "inference"]
    peers = job["ingress"][0]["from"]
    assert [role for role, labels in pods.items() if any(_matches(p["podSelector"], labels) for p in peers)] == [
        "trainer",
        "inference",
    ]
    # spec.networkPolicy.enabled false drops the job's policy, never the sandbox's.
    off = children(served() | {"spec": {**served()["spec"], "networkPolicy": {"enabled": False}}})
    assert [name for kind, name in off if kind == "NetworkPolicy"] == ["job.env"]


def test_egress_is_what_the_spec_opens():
    dns = {"to": [{"namespaceSelector": {}}], "ports": [{"port": 53, "protocol": "UDP"}]}
    objects = children(served(egress=[dns]))
    assert objects[("NetworkPolicy", "job.env")]["spec"]["egress"] == [dns]


def test_every_object_validates_and_the_kueue_workload_has_a_third_pod_set():
    doc = served(nodeSelector={"pool": "sandbox"}, tolerations=[{"key": "sandbox", "operator": "Exists"}])
    doc["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team"}
    objects = children(doc)
    for obj in objects.values():
        if obj["kind"] != "Workload":
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    sets = objects[("Workload", "job")]["spec"]["podSets"]
    assert [(s["name"], s["count"]) for s in sets] == [("trainer", 1), ("inference", 1), ("environment", 2)]
    env_set = sets[2]["template"]["spec"]
    assert env_set["nodeSelector"] == {"pool": "sandbox"} and env_set["runtimeClassName"] == "gvisor"
    assert env_set["containers"][0]["resources"] == SERVER["resources"]
    pdb = objects[("PodDisruptionBudget", "job-env")]["spec"]
    assert pdb["maxUnavailable"] == 1 and pdb["selector"]["matchLabels"][c.LABEL_ROLE] == "environment"


def test_own_command_runs_as_written_and_local_runs_get_their_urls_from_the_launcher():
    doc = job_doc(environment={"server": {"command": ["/srv/env"], "args": ["--x"], "port": 9000, "replicas": 2}})
    doc["metadata"]["name"] = "job"
    objects = children(doc)
    (container,) = objects[("StatefulSet", "job-env")]["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["/srv/env"] and container["args"] == ["--x"]
    # Not port + i on loopback (an inference replica's port, maybe): grpolora run gives the URLs of what it started.
    local = plan(parse_job(doc), LoopbackNetwork())
    assert contract.ENVIRONMENT_URL not in local.env_for("trainer", 0, token="t") and not local.environment_endpoints
    assert local.env_for("environment", 1, token="t") == {
        contract.ENVIRONMENT_TOKEN: environment_token("t"),
        contract.ENVIRONMENT_PORT: "9000",
    }
    environment = parse_job(served(args=["--max-episodes", "64"])).spec.environment
    assert environment is not None
    assert environment_server_command(environment, port=8001, token_file=None, python="/py") == (
        ["/py", "-m", "grpolora.workers.environments.service"],
        ["--environment", "calculator", "--port", "8001", "--max-episodes", "64"],
    )


def test_a_job_on_a_rollout_pool_keeps_its_own_server():
    pool = pool_doc()
    pool["metadata"]["namespace"] = "team-a"
    doc = served()
    doc["spec"]["model"] = pool["spec"]["model"]
    doc["spec"]["inference"] = {"poolRef": {"name": "shared"}}
    job_plan = plan(parse_job(doc), pool=RolloutPool.model_validate(pool))
    objects = by_kind(build_children(job_plan, owner_uid="u", token="t"))
    assert ("StatefulSet", "job-env") in objects and ("StatefulSet", "job-inference") not in objects
    assert ("NetworkPolicy", "job.env") in objects


def test_render_cli_prints_the_server(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(served()))
    code, out, err = run(capsys, "render", str(path))
    assert code == 0, err
    rendered = {(o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(out) if o}
    assert {("StatefulSet", "job-env"), ("Service", "job-env"), ("NetworkPolicy", "job.env")} <= rendered
