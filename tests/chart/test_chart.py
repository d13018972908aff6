"""The Helm chart, rendered by a real helm: lint, Kubernetes schemas, the operator pod, metrics, values, the CRD."""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from grpolora.api import constants as c
from grpolora.api.crd import CRD_FILES
from grpolora.api.load import parse_job
from grpolora.api.plan import plan
from grpolora.operator.builders import build_children
from tests.chart.chart import CHART, NAMESPACE, VALUE_SETS, HelmFailed, find, kinds
from tests.helpers import ROOT, example

SHIPPED_CRD = ROOT / "crds" / "grpolorajobs.grpolora.dev.yaml"
CHART_CRD_COPY = CHART / "files" / "grpolorajobs.grpolora.dev.yaml"
FULLNAME = "grpo-lora-operator"  # what `helm install grpo-lora` names things
PROMETHEUS_OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor"}
KOPF_KINDS = {"KopfPeering", "ClusterKopfPeering"}


def all_value_sets():
    return pytest.mark.parametrize("values", list(VALUE_SETS.values()), ids=list(VALUE_SETS))


def deployment(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return find(objects, "Deployment", FULLNAME, NAMESPACE)


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = deployment(objects)["spec"]["template"]["spec"]["containers"]
    return container


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels + Exists/In matchExpressions) against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        if expr["operator"] == "Exists" and expr["key"] not in labels:
            return False
        if expr["operator"] == "In" and labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def example_children(name: str = "quickstart.yaml") -> list[dict[str, Any]]:
    job = parse_job(example(name))
    return build_children(plan(job), owner_uid="uid", token="token")


# --- lint and schemas ---------------------------------------------------------------------------------------------


@all_value_sets()
def test_helm_lint_strict_passes(chart, values):
    assert "0 chart(s) failed" in chart.lint(values)


@all_value_sets()
def test_every_rendered_object_validates_against_the_kubernetes_1_28_and_1_33_schemas(chart, values):
    """1.28: the chart's kubeVersion minimum (a CI gate pinned to it checks these schemas); 1.33: the emulator's."""
    for obj in chart.render(values):
        ident = f"{obj['kind']} {obj['metadata'].get('namespace', '')}/{obj['metadata']['name']}"
        if obj["kind"] in PROMETHEUS_OPERATOR_KINDS:
            continue  # no schema offline; test_service_monitor_* and test_worker_pod_monitor_* check them
        for version in ("1.28.0", "1.33.0"):
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{ident} at {version}: {str(exc).splitlines()[0]} at {list(exc.path)}")


def test_default_release_renders_exactly_these_objects(chart):
    objects = chart.render()
    assert kinds(objects) == sorted(
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterRole",  # Kueue's service account may read GRPOLoraJobs and RolloutPools (kueue.readJobs)
            "ClusterRoleBinding",
            "CustomResourceDefinition",  # GRPOLoraJob (the Kopf peering CRDs only with peering.enabled)
            "CustomResourceDefinition",  # RolloutPool
            "CustomResourceDefinition",  # GRPOLoraRuntime
            "CustomResourceDefinition",  # ClusterGRPOLoraRuntime
            "Deployment",
            "Service",
            "ServiceAccount",
        ]
    )
    for obj in objects:
        if obj["kind"] != "CustomResourceDefinition":
            assert FULLNAME in obj["metadata"]["name"], obj["metadata"]["name"]


@pytest.mark.parametrize(
    ("release", "override", "expected"),
    [("grpo-lora", "", "grpo-lora-operator"), ("prod", "", "prod-grpo-lora-operator"), ("x", "rl-op", "rl-op")],
)
def test_object_names(chart, release, override, expected):
    text = chart.run("template", release, str(CHART), "--namespace", NAMESPACE, values={"fullnameOverride": override})
    names = {d["metadata"]["name"] for d in yaml.safe_load_all(text) if d and d["kind"] == "Deployment"}
    assert names == {expected}


def test_chart_refuses_a_kubernetes_older_than_1_28(chart):
    with pytest.raises(HelmFailed, match="kubeVersion"):
        chart.run("template", "grpo-lora", str(CHART), "--kube-version", "1.27.0")
    chart.run("template", "grpo-lora", str(CHART), "--kube-version", "1.28.0")


# --- the operator pod ---------------------------------------------------------------------------------------------


def test_operator_pod_is_locked_down_and_probed_on_healthz(chart):
    objects = chart.render()
    dep = deployment(objects)
    pod = dep["spec"]["template"]["spec"]
    container = operator_container(objects)
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    assert pod["automountServiceAccountToken"] is True
    assert pod["serviceAccountName"] == FULLNAME
    assert find(objects, "ServiceAccount", FULLNAME)["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    # No fixed uid by default: OpenShift's restricted-v2 SCC refuses one outside the namespace's range.
    assert "runAsUser" not in pod["securityContext"] and "runAsGroup" not in pod["securityContext"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 9090, "health": 8081}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    assert container["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}}
    assert container["image"] == "ghcr.io/grpo-lora-operator/operator:0.1.0"


def test_operator_pod_ids_are_settable_in_values(chart):
    pod = deployment(chart.render({"podSecurity": {"runAsUser": 1000, "runAsGroup": 1000}}))["spec"]["template"]
    assert pod["spec"]["securityContext"]["runAsUser"] == 1000 and pod["spec"]["securityContext"]["runAsGroup"] == 1000


def test_operator_pod_is_admitted_by_every_jobs_network_policy(chart):
    """Each job's NetworkPolicy lets the operator reach the trainer's status port by the operator pod's labels."""
    pod_labels = deployment(chart.render())["spec"]["template"]["metadata"]["labels"]
    assert pod_labels[c.LABEL_NAME] == c.OPERATOR_NAME
    policy = next(o for o in example_children() if o["kind"] == "NetworkPolicy")
    operator_peers = [
        peer for rule in policy["spec"]["ingress"] for peer in rule["from"] if "namespaceSelector" in peer
    ]
    assert operator_peers, "the job NetworkPolicy has no rule for the operator"
    assert all(matches(peer["podSelector"], pod_labels) for peer in operator_peers)
    # Only from the operator's own namespace (the unauthenticated /status must not be open to any pod that copies the
    # operator's label elsewhere): the chart tells the operator its namespace, which the policy selects by name.
    env = {e["name"]: e for e in operator_container(chart.render())["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    for peer in operator_peers:
        assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}


def test_a_fullname_override_keeps_the_label_network_policies_select(chart):
    dep = find(chart.render({"fullnameOverride": "rl-op"}), "Deployment", "rl-op", NAMESPACE)
    assert dep["spec"]["template"]["metadata"]["labels"][c.LABEL_NAME] == c.OPERATOR_NAME


def test_operator_args_all_namespaces_standalone(chart):
    assert operator_container(chart.render())["args"] == [
        "operator",
        "--all-namespaces",
        "--metrics-port",
        "9090",
        "--health-port",
        "8081",
        "--standalone",
        "--log-level",
        "info",
    ]


def test_operator_args_listed_namespaces_with_peering(chart):
    values = {
        "watch": {"namespaces": ["team-a", "team-b"]},
        "peering": {"enabled": True, "name": "rl"},
        "metrics": {"port": 9100},
        "health": {"port": 8088},
        "logLevel": "debug",
    }
    container = operator_container(chart.render(values))
    assert container["args"] == [
        "operator",
        "--namespace",
        "team-a",
        "--namespace",
        "team-b",
        "--metrics-port",
        "9100",
        "--health-port",
        "8088",
        "--peering",
        "rl",
        "--log-level",
        "debug",
    ]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": 9100, "health": 8088}


def test_placement_and_image_values_reach_the_pod(chart):
    values = VALUE_SETS["no-crd-and-placement"]
    objects = chart.render(values)
    pod = deployment(objects)["spec"]["template"]["spec"]
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "imagePullSecrets"):
        assert pod[key] == values[key], key
    assert operator_container(objects)["image"] == "ghcr.io/grpo-lora-operator/operator@sha256:" + "a" * 64
    assert find(objects, "ServiceAccount")["metadata"]["annotations"] == {"example.com/role": "operator"}


# --- the operator's pace -----------------------------------------------------------------------------------------

PACE = {  # value path -> (operator flag, parsed attribute, a value to set)
    "statusInterval": ("--status-interval", "status_interval", 2.5),
    "resyncInterval": ("--resync-interval", "resync_interval", 300),
    "apiClient.qps": ("--api-qps", "api_qps", 20),
    "apiClient.burst": ("--api-burst", "api_burst", 40),
}


def nested(path: str, value: Any) -> dict[str, Any]:
    head, _, rest = path.partition(".")
    return {head: nested(rest, value) if rest else value}


@pytest.mark.parametrize("path", list(PACE))
def test_a_pace_value_reaches_the_operators_flag(chart, path):
    from grpolora.cli import build_parser

    flag, attribute, value = PACE[path]
    args = operator_container(chart.render(nested(path, value)))["args"]
    assert args[args.index(flag) + 1] == str(value)
    assert getattr(build_parser().parse_args(args), attribute) == value


def test_pace_values_left_unset_leave_the_operators_defaults():
    """Unset (null) passes no flag, so the operator's own default holds; values.yaml names it, and must name it
    right."""
    from grpolora.cli import build_parser

    defaults = build_parser().parse_args(["operator", "--all-namespaces"])
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    for path, (flag, attribute, _) in PACE.items():
        node: Any = values
        for key in path.split("."):
            node = node[key]
        assert node is None, path
        key = path.rsplit(".", 1)[-1]
        (said,) = re.findall(rf"^\s*{key}: null\s+# .*\(operator default ([0-9.]+)\)", text, re.MULTILINE)
        assert float(said) == getattr(defaults, attribute), (path, flag)


def test_default_args_carry_no_pace_flags(chart):
    args = operator_container(chart.render())["args"]
    assert not {flag for flag, _, _ in PACE.values()} & set(args)


# --- cluster-wide worker defaults ---------------------------------------------------------------------------------


def test_worker_defaults_in_values_reach_the_operator_and_make_its_defaults(chart):
    from grpolora.api.plan import WorkerDefaults
    from grpolora.cli import build_parser
    from grpolora.operator.main import OperatorOptions

    gpu = "registry.example.com/grpo/worker-gpu@sha256:" + "c" * 64
    values = {
        "workers": {
            "images": {"gpu": gpu, "cpu": "registry.example.com/grpo/worker-cpu:0.1.0"},
            "imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}],
        }
    }
    args = build_parser().parse_args(operator_container(chart.render(values))["args"])
    options = OperatorOptions(
        all_namespaces=args.all_namespaces,
        worker_image_gpu=args.worker_image_gpu,
        worker_image_cpu=args.worker_image_cpu,
        worker_image_pull_secrets=tuple(args.worker_image_pull_secrets),
    )
    assert options.worker_defaults() == WorkerDefaults(
        image_gpu=gpu, image_cpu="registry.example.com/grpo/worker-cpu:0.1.0", image_pull_secrets=("regcred", "mirror")
    )
    # Unset: no flags, the project's images (grpolora.api.constants) and no pull secrets.
    assert not any(a.startswith("--worker-") for a in operator_container(chart.render())["args"])


# --- peering ------------------------------------------------------------------------------------------------------


KOPF_CRD_NAMES = {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}


def kopf_crds(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] == "CustomResourceDefinition" and o["metadata"]["name"] in KOPF_CRD_NAMES]


def test_peering_off_installs_no_peering_crds_and_no_peering_objects(chart):
    objects = chart.render()
    assert not KOPF_KINDS & set(kinds(objects))
    assert kopf_crds(objects) == [], "the Kopf peering CRDs are installed only with peering.enabled"
    assert not (CHART / "crds").exists(), "Helm's crds/ folder installs unconditionally"


@pytest.mark.parametrize("namespaces", [[], ["a", "b"]])
def test_peering_on_installs_the_peering_crds_kept_and_the_operator_makes_its_peering_object(chart, namespaces):
    objects = chart.render({"peering": {"enabled": True, "name": "rl"}, "watch": {"namespaces": namespaces}})
    crds = kopf_crds(objects)
    assert {crd["metadata"]["name"] for crd in crds} == KOPF_CRD_NAMES
    for crd in crds:  # deleting a CRD deletes every object of it, also another Kopf operator's
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    # Not in the chart: Helm cannot create an object of a CRD it installs in the same release ("no matches for
    # kind"); the operator creates its peering object at start (tests/operator/test_rbac.py).
    assert not KOPF_KINDS & set(kinds(objects))


def test_peering_crds_can_be_left_to_someone_else(chart):
    objects = chart.render({"peering": {"enabled": True, "installCRDs": False}})
    assert kopf_crds(objects) == []


def test_kopf_peering_crds_are_valid(chart):
    crds = kopf_crds(chart.render({"peering": {"enabled": True}}))
    for crd in crds:
        kubernetes_validate.validate(crd, "1.33.0", strict=True)
    assert {(d["spec"]["names"]["kind"], d["spec"]["scope"], d["spec"]["group"]) for d in crds} == {
        ("ClusterKopfPeering", "Cluster", "kopf.dev"),
        ("KopfPeering", "Namespaced", "kopf.dev"),
    }


# --- replicas: active/standby through peering ---------------------------------------------------------------------


def test_one_replica_recreates_and_has_no_disruption_budget(chart):
    for values in ({}, {"peering": {"enabled": True}}):
        objects = chart.render(values)
        dep = deployment(objects)
        assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
        assert "PodDisruptionBudget" not in kinds(objects)


@pytest.mark.parametrize("replicas", [2, 3])
def test_replicas_run_active_standby_with_peering_rolling_updates_and_a_disruption_budget(chart, replicas):
    objects = chart.render({"replicaCount": replicas, "peering": {"enabled": True}})
    dep = deployment(objects)
    assert dep["spec"]["replicas"] == replicas
    # Peering pauses all but the replica of the highest priority, so a surge pod overlapping the old ones is safe;
    # none is taken down before its replacement is up.
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    args = operator_container(objects)["args"]
    assert "--peering" in args and "--standalone" not in args
    # One pod template for every replica: a --priority here would give them all the same one, and Kopf pauses every
    # replica on a tie. Without it each operator draws its own (test_each_operator_draws_its_own_priority).
    assert not any(a.startswith("--priority") for a in args)
    pdb = find(objects, "PodDisruptionBudget", FULLNAME, NAMESPACE)
    assert pdb["spec"]["maxUnavailable"] == 1
    assert matches(pdb["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
    assert pdb["spec"]["selector"] == dep["spec"]["selector"]
    # Replicas on one node would all go with it: spread them, softly (a one-node cluster still schedules them).
    (spread,) = dep["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread["labelSelector"] == dep["spec"]["selector"]


def test_replicas_without_peering_fail_the_render_saying_why(chart):
    with pytest.raises(HelmFailed, match=r"replicaCount=2 needs peering\.enabled=true"):
        chart.render({"replicaCount": 2})


def test_each_operator_draws_its_own_priority():
    """Kopf runs the live peer of the highest priority and pauses the rest (and all of them on a tie): replicas of
    one pod template must not share a priority, so the chart sets none and each operator draws one."""
    from grpolora.cli import build_parser
    from grpolora.operator.main import peering_priority

    args = build_parser().parse_args(["operator", "--all-namespaces", "--peering", "x"])
    assert args.priority is None
    assert peering_priority(7) == 7
    drawn = {peering_priority(None) for _ in range(100)}
    assert len(drawn) == 100 and all(1 <= p < 2**31 for p in drawn)


# --- the operator's NetworkPolicy ---------------------------------------------------------------------------------


def operator_policy(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return find(objects, "NetworkPolicy", FULLNAME, NAMESPACE)


def pool_children() -> list[dict[str, Any]]:
    from grpolora.api.load import parse_pool
    from grpolora.api.plan import plan_pool
    from grpolora.api.pool import Attachments
    from grpolora.operator.builders import build_pool_children

    rollout_pool = parse_pool(yaml.safe_load((ROOT / "examples" / "pool" / "qwen3-shared-pool.yaml").read_text()))
    return build_pool_children(plan_pool(rollout_pool), owner_uid="uid", attachments=Attachments(pool="p", jobs=[]))


def admitted(rule: dict[str, Any], labels: dict[str, str], namespace: str, port: int) -> bool:
    """Whether an egress rule lets the operator reach a pod with these labels in this namespace on this port."""
    ports = rule.get("ports")
    if ports and not any(p["port"] == port and p.get("protocol", "TCP") == "TCP" for p in ports):
        return False
    namespace_labels = {"kubernetes.io/metadata.name": namespace}
    return any(
        "podSelector" in peer
        and matches(peer["podSelector"], labels)
        and matches(peer.get("namespaceSelector", {"matchLabels": namespace_labels}), namespace_labels)
        for peer in rule["to"]
    )


def test_operator_network_policy_is_off_by_default(chart):
    assert "NetworkPolicy" not in kinds(chart.render())


def test_operator_network_policy_admits_only_the_configured_sources_to_metrics_and_health(chart):
    values = VALUE_SETS["network-policy-namespaces"]["networkPolicy"]
    objects = chart.render(VALUE_SETS["network-policy-namespaces"])
    policy = operator_policy(objects)
    assert matches(policy["spec"]["podSelector"], deployment(objects)["spec"]["template"]["metadata"]["labels"])
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert policy["spec"]["ingress"] == [
        {"from": values["metricsFrom"], "ports": [{"port": 9090, "protocol": "TCP"}]},
        {"from": values["healthFrom"], "ports": [{"port": 8081, "protocol": "TCP"}]},
    ]
    # No sources given: no rule at all (a rule with an empty `from` would admit every source). The kubelet's probes
    # need none: traffic from a pod's own node is always allowed.
    policy = operator_policy(chart.render(VALUE_SETS["network-policy"]))
    assert policy["spec"]["ingress"] == []
    assert all(rule.get("from") for rule in policy["spec"]["ingress"])


@pytest.mark.parametrize("scope", ["network-policy", "network-policy-namespaces"])
def test_operator_network_policy_lets_the_operator_reach_the_api_server_dns_and_the_worker_pods(chart, scope):
    values = VALUE_SETS[scope]
    egress = operator_policy(chart.render(values))["spec"]["egress"]
    assert all(rule.get("to") for rule in egress), "an egress rule without `to` would admit every destination"
    api_server = values["networkPolicy"].get("apiServer", {})
    cidrs = api_server.get("cidrs") or ["0.0.0.0/0", "::/0"]
    ports = api_server.get("ports") or [443, 6443]
    (api_rule,) = [r for r in egress if any("ipBlock" in peer for peer in r["to"])]
    assert [peer["ipBlock"]["cidr"] for peer in api_rule["to"]] == cidrs
    assert api_rule["ports"] == [{"port": p, "protocol": "TCP"} for p in ports]
    dns = {"k8s-app": "kube-dns"}
    assert admitted(next(r for r in egress if r.get("ports", [{}])[0].get("port") == 53), dns, "kube-system", 53)
    # What the operator polls: each trainer's /status (the job's trainer.statusPort) and each RolloutPool server's
    # /v1/adapter (the pool's port). Both ports are the user's, per job or pool, so the rule admits the pods by label.
    namespaces = values.get("watch", {}).get("namespaces") or ["anywhere"]
    job = [o for o in example_children() if o["kind"] in ("Job", "StatefulSet")]
    pool = [o for o in pool_children() if o["kind"] == "StatefulSet"]
    assert len(job) == 2 and len(pool) == 1
    for workload in job + pool:
        template = workload["spec"]["template"]
        for port in (p["containerPort"] for p in template["spec"]["containers"][0]["ports"]):
            for namespace in namespaces:
                assert any(admitted(r, template["metadata"]["labels"], namespace, port) for r in egress), port
    if namespaces != ["anywhere"]:  # only the watched namespaces
        labels = job[0]["spec"]["template"]["metadata"]["labels"]
        assert not any(admitted(r, labels, "elsewhere", 8080) for r in egress)
    # Nothing else: no pod outside the jobs and pools, on no port.
    assert not any(admitted(r, {"app": "other"}, namespaces[0], 8080) for r in egress)


# --- metrics ------------------------------------------------------------------------------------------------------


def test_metrics_service_reaches_the_operator_metrics_port(chart):
    objects = chart.render()
    service = find(objects, "Service", f"{FULLNAME}-metrics", NAMESPACE)
    pod_labels = deployment(objects)["spec"]["template"]["metadata"]["labels"]
    assert matches({"matchLabels": service["spec"]["selector"]}, pod_labels)
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "metrics" and port["port"] == 9090
    assert "metrics" in {p["name"] for p in operator_container(objects)["ports"]}


def test_service_monitor_scrapes_the_metrics_service_and_keeps_job_labels(chart):
    objects = chart.render(VALUE_SETS["monitoring"])
    monitor = find(objects, "ServiceMonitor", FULLNAME, NAMESPACE)
    service = find(objects, "Service", f"{FULLNAME}-metrics")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert matches(monitor["spec"]["selector"], service["metadata"]["labels"])
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    assert endpoint["path"] == "/metrics" and endpoint["honorLabels"] is True
    assert "ServiceMonitor" not in kinds(chart.render())


@pytest.mark.parametrize(("values", "namespaces"), [("monitoring", None), ("namespaces-monitoring", ["team-a"])])
def test_worker_pod_monitor_selects_trainer_and_inference_pods(chart, values, namespaces):
    monitor = find(chart.render(VALUE_SETS[values]), "PodMonitor", f"{FULLNAME}-workers", NAMESPACE)
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == ({"any": True} if namespaces is None else {"matchNames": namespaces})
    assert spec["jobLabel"] == c.LABEL_JOB and spec["podTargetLabels"] == [c.LABEL_ROLE]
    (endpoint,) = spec["podMetricsEndpoints"]
    workloads = [o for o in example_children() if o["kind"] in ("Job", "StatefulSet")]
    assert len(workloads) == 2
    for workload in workloads:
        template = workload["spec"]["template"]
        assert matches(spec["selector"], template["metadata"]["labels"]), workload["kind"]
        port_names = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
        assert endpoint["port"] in port_names, workload["kind"]


@pytest.mark.parametrize(("values", "namespaces"), [("monitoring", None), ("namespaces-monitoring", ["team-a"])])
def test_pool_pod_monitor_selects_a_rollout_pools_servers(chart, values, namespaces):
    """A shared pool's servers are no job's pods (no grpolora.dev/job label): without a monitor of their own their
    vLLM and adapter series were never scraped. Their `job` label is the pool's name."""
    monitor = find(chart.render(VALUE_SETS[values]), "PodMonitor", f"{FULLNAME}-pools", NAMESPACE)
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == ({"any": True} if namespaces is None else {"matchNames": namespaces})
    assert spec["jobLabel"] == c.LABEL_POOL
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    [servers] = [o for o in pool_children() if o["kind"] == "StatefulSet"]
    template = servers["spec"]["template"]
    assert matches(spec["selector"], template["metadata"]["labels"])
    assert endpoint["port"] in {p["name"] for p in template["spec"]["containers"][0]["ports"]}
    # The job monitor does not also select them (each series scraped once).
    workers = find(chart.render(VALUE_SETS[values]), "PodMonitor", f"{FULLNAME}-workers", NAMESPACE)
    assert not matches(workers["spec"]["selector"], template["metadata"]["labels"])


def test_worker_pod_monitor_skips_trainer_ranks_that_serve_no_metrics(chart):
    # Only trainer rank 0 serves /metrics; ranks > 0 would be down targets. Indexed Job pods carry their index in the
    # label batch.kubernetes.io/job-completion-index, which Prometheus sees as the meta label below.
    monitor = find(chart.render(VALUE_SETS["monitoring"]), "PodMonitor", f"{FULLNAME}-workers", NAMESPACE)
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    drops = [r for r in endpoint.get("relabelings", []) if r.get("action") == "drop"]
    assert len(drops) == 1
    (drop,) = drops
    meta = "__meta_kubernetes_pod_label_"
    assert drop["sourceLabels"] == [f"{meta}grpolora_dev_role", f"{meta}batch_kubernetes_io_job_completion_index"]
    separator = drop.get("separator", ";")

    def dropped(role: str, index: str) -> bool:
        return re.fullmatch(drop["regex"], f"{role}{separator}{index}") is not None  # Prometheus anchors regexes

    assert not dropped("trainer", "0") and not dropped("inference", "")
    assert dropped("trainer", "1") and dropped("trainer", "12")


def test_dashboard_configmap_carries_the_dashboard_json(chart):
    objects = chart.render(VALUE_SETS["monitoring"])
    config_map = find(objects, "ConfigMap", f"{FULLNAME}-dashboard", "monitoring")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "grpo-lora.json").read_text())
    assert json.loads(config_map["data"]["grpo-lora.json"]) == shipped
    assert "ConfigMap" not in kinds(chart.render())


# --- values -------------------------------------------------------------------------------------------------------

BAD_VALUES = {
    "unknown top-level key": ({"watchNamespaces": ["a"]}, "watchNamespaces"),
    "namespace not a DNS label": ({"watch": {"namespaces": ["Team_A"]}}, "namespaces"),
    "namespace glob": ({"watch": {"namespaces": ["team-*"]}}, "namespaces"),
    "duplicate namespace": ({"watch": {"namespaces": ["a", "a"]}}, "namespaces"),
    "log level": ({"logLevel": "verbose"}, "logLevel"),
    "metrics port out of range": ({"metrics": {"port": 80}}, "port"),
    "metrics port as text": ({"metrics": {"port": "9090"}}, "port"),
    "peering flag as text": ({"peering": {"enabled": "yes"}}, "enabled"),
    "pull policy": ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    "digest": ({"image": {"digest": "latest"}}, "digest"),
    "typo in a nested key": ({"metrics": {"serviceMonitor": {"enable": True}}}, "enable"),
    "scrape interval": ({"metrics": {"serviceMonitor": {"enabled": True, "interval": "often"}}}, "interval"),
    "resources not a map": ({"resources": {"requests": "lots"}}, "requests"),
    "no replicas": ({"replicaCount": 0}, "replicaCount"),
    "replicas as text": ({"replicaCount": "2"}, "replicaCount"),
    "policy source not a peer": ({"networkPolicy": {"enabled": True, "metricsFrom": ["prometheus"]}}, "metricsFrom"),
    "api server cidr": ({"networkPolicy": {"enabled": True, "apiServer": {"cidrs": ["10.0.0.1"]}}}, "cidrs"),
    "api server port": ({"networkPolicy": {"enabled": True, "apiServer": {"ports": [0]}}}, "ports"),
    "status interval zero": ({"statusInterval": 0}, "statusInterval"),
    "status interval as text": ({"statusInterval": "10s"}, "statusInterval"),
    "resync interval too short": ({"resyncInterval": 1}, "resyncInterval"),
    "api qps zero": ({"apiClient": {"qps": 0}}, "qps"),
    "api burst fractional": ({"apiClient": {"burst": 1.5}}, "burst"),
    "worker image without tag or digest": ({"workers": {"images": {"gpu": "registry.example.com/x"}}}, "gpu"),
    "worker pull secret as text": ({"workers": {"imagePullSecrets": ["regcred"]}}, "imagePullSecrets"),
    "too many replicas": ({"replicaCount": 6, "peering": {"enabled": True}}, "replicaCount"),
}


@pytest.mark.parametrize(("values", "mentions"), list(BAD_VALUES.values()), ids=list(BAD_VALUES))
def test_values_schema_rejects_bad_values(chart, values, mentions):
    with pytest.raises(HelmFailed) as failure:
        chart.render(values)
    assert mentions in str(failure.value)


def test_metrics_and_health_ports_must_differ(chart):
    with pytest.raises(HelmFailed, match="must differ"):
        chart.render({"metrics": {"port": 8081}})


def test_service_account_name_is_required_when_not_created(chart):
    with pytest.raises(HelmFailed, match=r"serviceAccount\.name is required"):
        chart.render({"serviceAccount": {"create": False}})
    objects = chart.render({"serviceAccount": {"create": False, "name": "existing"}})
    assert "ServiceAccount" not in kinds(objects)
    assert deployment(objects)["spec"]["template"]["spec"]["serviceAccountName"] == "existing"


def test_default_values_file_validates_against_its_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load((CHART / "values.yaml").read_text()))


def test_chart_app_version_is_the_package_version_and_the_worker_image_tag():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart_meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart_meta["appVersion"] == version
    assert c.DEFAULT_WORKER_IMAGE_CPU.endswith(f":{version}") and c.DEFAULT_WORKER_IMAGE_GPU.endswith(f":{version}")


# --- NOTES --------------------------------------------------------------------------------------------------------


def test_notes_tell_the_user_what_to_do_next(chart):
    notes = chart.notes()
    assert f"rollout status deployment/{FULLNAME}" in notes
    assert "kubectl get glj --all-namespaces" in notes
    assert "grpolora.dev/pool=trainer" in notes and "docs/operations.md" in notes
    # The command removes every CRD the chart installs and keeps (jobs and pools alike), and only those.
    text = chart.template_text(None, "--show-only", "templates/crd.yaml")
    crds = [d["metadata"]["name"] for d in yaml.safe_load_all(text) if d]
    assert len(crds) == 4
    (command,) = re.findall(r"kubectl delete crd [^\n]*", notes)
    assert command.split()[3:] == crds


def test_notes_for_listed_namespaces_name_them(chart):
    notes = chart.notes({"watch": {"namespaces": ["team-a", "team-b"]}})
    assert "only in: team-a, team-b" in notes
    assert "kubectl get glj -n team-a --watch" in notes


# --- the CRD ------------------------------------------------------------------------------------------------------


def test_the_charts_crd_copy_is_the_shipped_crd():
    assert CHART_CRD_COPY.read_text() == SHIPPED_CRD.read_text(), "run `make crd` (it refreshes both copies)"


@pytest.mark.parametrize(
    "name", ["rolloutpools.grpolora.dev", "grpoloraruntimes.grpolora.dev", "clustergrpoloraruntimes.grpolora.dev"]
)
def test_the_chart_ships_the_other_crds_too_with_the_keep_policy(chart, name):
    shipped = (ROOT / "crds" / f"{name}.yaml").read_text()
    assert (CHART / "files" / f"{name}.yaml").read_text() == shipped, "run `make crd` (it refreshes both copies)"
    text = chart.template_text(None, "--show-only", "templates/crd.yaml")
    crds = {d["metadata"]["name"]: d for d in yaml.safe_load_all(text) if d}
    assert sorted(crds) == sorted(f.removesuffix(".yaml") for f in CRD_FILES.values())
    assert crds[name]["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    del crds[name]["metadata"]["annotations"]
    assert crds[name] == yaml.safe_load(shipped)


def test_rendered_crd_is_the_shipped_crd_verbatim_plus_the_keep_policy(chart):
    text = chart.template_text(None, "--show-only", "templates/crd.yaml")
    # Each CRD after "---" and "# Source: ...", in the order of their files' names; this one by its name.
    documents = [d.split("\n", 1)[1] for d in ("\n" + text).split("\n---\n") if d.strip()]
    body = next(d for d in documents if "name: grpolorajobs.grpolora.dev\n" in d)
    shipped = SHIPPED_CRD.read_text()
    keep = "metadata:\n  annotations:\n    helm.sh/resource-policy: keep\n  name: grpolorajobs.grpolora.dev\n"
    assert body.strip() == shipped.replace("metadata:\n  name: grpolorajobs.grpolora.dev\n", keep).strip()
    crd = yaml.safe_load(body)
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    del crd["metadata"]["annotations"]
    assert crd == yaml.safe_load(shipped)


def test_crd_can_be_left_to_someone_else(chart):
    objects = chart.render({"crds": {"install": False}}, include_crds=False)
    assert "CustomResourceDefinition" not in kinds(objects)


# --- docs ---------------------------------------------------------------------------------------------------------

DOCS_WITH_VALUES = [
    ROOT / "README.md",
    ROOT / "docs" / "operations.md",
    CHART / "README.md",
    ROOT / "tests" / "e2e" / "kind" / "run.sh",
    ROOT / "tests" / "e2e" / "kind" / "gpu.sh",
]


def value_paths(values: Any, prefix: str = "") -> set[str]:
    paths = {prefix} if prefix else set()
    if isinstance(values, dict):
        for key, child in values.items():
            paths |= value_paths(child, f"{prefix}.{key}" if prefix else key)
    return paths


@pytest.mark.parametrize("path", DOCS_WITH_VALUES, ids=lambda p: p.name)
def test_every_value_the_docs_and_scripts_set_exists(path):
    known = value_paths(yaml.safe_load((CHART / "values.yaml").read_text()))
    named = re.findall(r"--set ['\"]?([A-Za-z][\w.]*)=", path.read_text())
    assert named, f"{path.name} sets no chart value any more: drop it from DOCS_WITH_VALUES"
    for key in named:
        # Maps whose keys are the user's (labels, annotations) accept any sub-key.
        assert key in known or any(key.startswith(f"{k}.") and k.endswith("labels") for k in known), key
