"""The chart grants the operator exactly what grpolora.operator.rbac.RULES lists, scoped by the watched namespaces.

RULES (operator/rbac.py) is the single source: each rule is (api_groups, resources, verbs, reason). The chart
writes the same rules by hand in templates/_rbac.tpl, each under its reason as a comment; this test renders the
chart in every scope and compares (group, resource, verb) triples. How the chart places them:
- all namespaces: one ClusterRole with every rule;
- listed namespaces: namespaced rules in a Role in each namespace, cluster-scoped ones (ClusterGRPOLoraRuntimes, and
  Kueue's ResourceFlavors unless kueue.resourceFlavors is false) in a small ClusterRole;
- Kopf peering rules (api group kopf.dev) only with peering on: kopfpeerings in the namespaced scope,
  clusterkopfpeerings in the cluster-wide one (Kopf picks the kind by scope).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from tests.chart.chart import CHART, NAMESPACE, VALUE_SETS, find

Triple = tuple[str, str, str]

# Resources that a Role cannot grant (cluster-scoped), among those an operator could plausibly need.
CLUSTER_SCOPED = {
    ("apiextensions.k8s.io", "customresourcedefinitions"),
    ("", "namespaces"),
    ("", "nodes"),
    ("kopf.dev", "clusterkopfpeerings"),
    ("grpolora.dev", "clustergrpoloraruntimes"),
    ("kueue.x-k8s.io", "resourceflavors"),
    ("scheduling.k8s.io", "priorityclasses"),
}
PEERING_GROUP = "kopf.dev"
ESCALATING_VERBS = {"bind", "escalate", "impersonate", "*"}
SCOPES = {
    "all namespaces": {},
    "all namespaces, no ResourceFlavors": {"kueue": {"resourceFlavors": False}},
    "listed namespaces, no ResourceFlavors": {"watch": {"namespaces": ["team-a"]}, "kueue": {"resourceFlavors": False}},
    "all namespaces, peering": {"peering": {"enabled": True}},
    "listed namespaces": {"watch": {"namespaces": ["team-a", "team-b"]}},
    "listed namespaces, peering": {"watch": {"namespaces": ["team-a", "team-b"]}, "peering": {"enabled": True}},
}


def triples(rules: Iterable[Any]) -> set[Triple]:
    """(group, resource, verb) for rules given as RBAC dicts or as grpolora.operator.rbac.Rule objects."""
    result = set()
    for rule in rules:
        if isinstance(rule, dict):
            groups, resources, verbs = rule["apiGroups"], rule["resources"], rule["verbs"]
        else:
            groups, resources, verbs = rule.api_groups, rule.resources, rule.verbs
        result |= {(g, r, v) for g in groups for r in resources for v in verbs}
    return result


def is_cluster_scoped(triple: Triple) -> bool:
    return (triple[0], triple[1].split("/")[0]) in CLUSTER_SCOPED


def expected_grant(rules: set[Triple], *, all_namespaces: bool, peering: bool, flavors: bool = True) -> set[Triple]:
    """What the chart should grant in a scope, given the operator's full rule set."""
    unused_peering = "kopfpeerings" if all_namespaces else "clusterkopfpeerings"
    return {
        t
        for t in rules
        if (t[0] != PEERING_GROUP or (peering and t[1].split("/")[0] != unused_peering))
        and (flavors or t[1] != "resourceflavors")
    }


KUEUE_GRANT = "-kueue-reads"
"""The suffix of the ClusterRole and binding that let Kueue read our kinds (not the operator's own RBAC)."""


def kueue_grant(objects: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], set[Triple]] | None:
    """(the binding's subjects, the triples it grants) of the chart's grant to Kueue's service account, if any."""
    bindings = [o for o in objects if o["kind"] == "ClusterRoleBinding" and o["metadata"]["name"].endswith(KUEUE_GRANT)]
    if not bindings:
        return None
    (binding,) = bindings
    role = find(objects, "ClusterRole", binding["roleRef"]["name"])
    return binding["subjects"], triples(role["rules"])


def rbac(objects: list[dict[str, Any]]) -> tuple[set[Triple], dict[str, set[Triple]]]:
    """The ClusterRole's triples and each namespace's Role triples, following the bindings to the operator's SA."""
    objects = [o for o in objects if not o["metadata"]["name"].endswith(KUEUE_GRANT)]
    dep = find(objects, "Deployment", namespace=NAMESPACE)
    account = dep["spec"]["template"]["spec"]["serviceAccountName"]
    subject = {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    cluster: set[Triple] = set()
    namespaced: dict[str, set[Triple]] = {}
    for binding in objects:
        if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        assert binding["subjects"] == [subject], binding["metadata"]["name"]
        ref = binding["roleRef"]
        assert ref["apiGroup"] == "rbac.authorization.k8s.io"
        if binding["kind"] == "ClusterRoleBinding":
            assert ref["kind"] == "ClusterRole"
            cluster |= triples(find(objects, "ClusterRole", ref["name"])["rules"])
        else:
            assert ref["kind"] == "Role", "a RoleBinding to a ClusterRole would hide what is granted where"
            ns = binding["metadata"]["namespace"]
            namespaced.setdefault(ns, set()).update(triples(find(objects, "Role", ref["name"], ns)["rules"]))
    roles = {(o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects if o["kind"] == "Role"}
    cluster_roles = [o for o in objects if o["kind"] == "ClusterRole"]
    cluster_bindings = [o for o in objects if o["kind"] == "ClusterRoleBinding"]
    # A ClusterRole exists only where something is granted cluster-wide (every namespace watched).
    assert len(cluster_roles) == len(cluster_bindings) <= 1, "a cluster role without a binding (or two)"
    assert len(roles) == len(namespaced), "a role without a binding (or two)"
    return cluster, namespaced


def compare(granted: set[Triple], wanted: set[Triple]) -> str:
    """An empty string when equal, else what is missing and what is extra."""
    missing, extra = sorted(wanted - granted), sorted(granted - wanted)
    out = []
    if missing:
        out.append("missing (the operator needs these): " + ", ".join(map(str, missing)))
    if extra:
        out.append("extra (not in RULES): " + ", ".join(map(str, extra)))
    return "\n".join(out)


def rules_yaml(rules: Iterable[Any]) -> str:
    """RULES as the template lines to paste into templates/_rbac.tpl."""
    lines = []
    for rule in rules:
        quoted = [", ".join(f'"{x}"' for x in xs) for xs in (rule.api_groups, rule.resources, rule.verbs)]
        lines += [f"# {rule.reason}", f"- apiGroups: [{quoted[0]}]", f"  resources: [{quoted[1]}]"]
        lines.append(f"  verbs: [{quoted[2]}]")
    return "\n".join(lines)


# --- always: the chart's own shape --------------------------------------------------------------------------------


@pytest.mark.parametrize("values", list(SCOPES.values()), ids=list(SCOPES))
def test_rbac_is_scoped_by_the_watched_namespaces(chart, values):
    objects = chart.render(values)
    cluster, namespaced = rbac(objects)
    listed = values.get("watch", {}).get("namespaces", [])
    assert sorted(namespaced) == sorted(listed)
    if listed:
        assert all(is_cluster_scoped(t) for t in cluster), "namespaced rules belong in the Roles"
        roles = list(namespaced.values())
        assert all(r == roles[0] for r in roles), "every watched namespace gets the same Role"
        assert not any(is_cluster_scoped(t) for t in roles[0])
    peering = values.get("peering", {}).get("enabled", False)
    granted = cluster | set().union(*namespaced.values())
    peering_resources = {t[1] for t in granted if t[0] == PEERING_GROUP}
    if not peering:
        assert not peering_resources
    else:
        assert peering_resources == ({"kopfpeerings"} if listed else {"clusterkopfpeerings"})


@pytest.mark.parametrize("values", list(VALUE_SETS.values()), ids=list(VALUE_SETS))
def test_rbac_never_grants_wildcards_escalation_or_secret_listing(chart, values):
    cluster, namespaced = rbac(chart.render(values))
    for group, resource, verb in cluster | set().union(*namespaced.values()):
        assert "*" not in (group, resource) and verb not in ESCALATING_VERBS, (group, resource, verb)
        if resource == "secrets":
            # The operator reads its own token Secret by name; listing would expose every Secret in the namespace.
            # patch: a RolloutPool's attachment list is rewritten as jobs come and go (by name, never listed).
            assert verb in ("get", "create", "patch"), verb


@pytest.mark.parametrize("values", list(SCOPES.values()), ids=list(SCOPES))
def test_every_rule_comes_with_its_reason(chart, values):
    text = chart.template_text(values, "--show-only", "templates/rbac.yaml")
    lines = text.splitlines()
    rule_lines = [i for i, line in enumerate(lines) if line.strip().startswith("- apiGroups:")]
    assert rule_lines
    for i in rule_lines:
        assert lines[i - 1].strip().startswith("# "), f"rule without a reason comment: {lines[i]}"


def test_the_comparison_names_what_is_missing_and_what_is_extra():
    granted = {("", "pods", "get"), ("", "pods", "list"), ("batch", "jobs", "create")}
    assert compare(granted, set(granted)) == ""
    report = compare(granted - {("", "pods", "list")} | {("", "secrets", "list")}, granted)
    assert "missing (the operator needs these): ('', 'pods', 'list')" in report
    assert "extra (not in RULES): ('', 'secrets', 'list')" in report


def test_expected_grant_keeps_peering_rules_for_their_scope_only():
    rules = {("kopf.dev", "kopfpeerings", "patch"), ("kopf.dev", "clusterkopfpeerings", "patch"), ("", "pods", "get")}
    assert expected_grant(rules, all_namespaces=True, peering=False) == {("", "pods", "get")}
    assert expected_grant(rules, all_namespaces=True, peering=True) == {
        ("kopf.dev", "clusterkopfpeerings", "patch"),
        ("", "pods", "get"),
    }
    assert expected_grant(rules, all_namespaces=False, peering=True) == {
        ("kopf.dev", "kopfpeerings", "patch"),
        ("", "pods", "get"),
    }


# --- against the operator's declared needs ------------------------------------------------------------------------


@pytest.mark.parametrize("values", list(SCOPES.values()), ids=list(SCOPES))
def test_chart_grants_exactly_the_operators_rules(chart, values):
    rbac_module = pytest.importorskip(
        "grpolora.operator.rbac",
        reason="operator/rbac.py (RULES, from the operator issue) is not in this tree yet; this must pass once it is",
    )
    wanted = expected_grant(
        triples(rbac_module.RULES),
        all_namespaces=not values.get("watch", {}).get("namespaces"),
        peering=values.get("peering", {}).get("enabled", False),
        flavors=values.get("kueue", {}).get("resourceFlavors", True),
    )
    cluster, namespaced = rbac(chart.render(values))
    problems = compare(cluster | set().union(*namespaced.values()), wanted)
    text = chart.template_text(values, "--show-only", "templates/rbac.yaml")
    reasons = [r.reason for r in rbac_module.RULES if f"# {r.reason}" not in text and triples([r]) & wanted]
    if reasons:
        problems += "\nreasons not written as comments: " + "; ".join(reasons)
    assert not problems, (
        f"{problems}\n\nRULES as template lines for templates/_rbac.tpl:\n{rules_yaml(rbac_module.RULES)}"
    )


@pytest.mark.parametrize("values", list(SCOPES.values()), ids=list(SCOPES))
def test_chart_grants_update_on_the_jobs_finalizers_for_owner_reference_enforcement(chart, values):
    # OpenShift (and any cluster with OwnerReferencesPermissionEnforcement) refuses children whose ownerReferences
    # set blockOwnerDeletion unless their creator may update the owner's finalizers.
    cluster, namespaced = rbac(chart.render(values))
    granted = cluster | set().union(*namespaced.values())
    assert ("grpolora.dev", "grpolorajobs/finalizers", "update") in granted


def test_the_docs_promise_no_cluster_role_that_listed_namespaces_do_not_get(chart):
    # With listed namespaces, the ClusterRole holds the cluster-scoped reads only: ClusterGRPOLoraRuntimes,
    # PriorityClasses, and Kueue's ResourceFlavors when readable (the default).
    runtimes = {("grpolora.dev", "clustergrpoloraruntimes", "get"), ("scheduling.k8s.io", "priorityclasses", "list")}
    objects = chart.render({"watch": {"namespaces": ["team-a"]}, "kueue": {"resourceFlavors": False}})
    (role,) = [o for o in objects if o["kind"] == "ClusterRole" and not o["metadata"]["name"].endswith(KUEUE_GRANT)]
    assert triples(role["rules"]) == runtimes
    objects = chart.render({"watch": {"namespaces": ["team-a"]}})
    (role,) = [o for o in objects if o["kind"] == "ClusterRole" and not o["metadata"]["name"].endswith(KUEUE_GRANT)]
    assert triples(role["rules"]) == runtimes | {("kueue.x-k8s.io", "resourceflavors", "get")}
    for path in (CHART / "values.yaml", CHART / "README.md"):
        text = " ".join(path.read_text().split())
        assert "ClusterRole remains" not in text, path


# --- what Kueue's own service account needs of our kinds ------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "account"),
    [
        ({}, {"kind": "ServiceAccount", "name": "kueue-controller-manager", "namespace": "kueue-system"}),
        ({"watch": {"namespaces": ["team-a"]}},
         {"kind": "ServiceAccount", "name": "kueue-controller-manager", "namespace": "kueue-system"}),
        ({"kueue": {"readJobs": {"serviceAccount": {"name": "kueue", "namespace": "platform"}}}},
         {"kind": "ServiceAccount", "name": "kueue", "namespace": "platform"}),
        ({"kueue": {"readJobs": {"enabled": False}}}, None),
    ],
)  # fmt: skip
def test_kueue_may_read_the_jobs_it_finds_as_owners(chart, values, account):
    """Kueue's webhooks read the GRPOLoraJob that owns a trainer Job with Kueue's own client once the kind is in its
    integrations.externalFrameworks (jobframework FindAncestorJobManagedByKueue); the chart binds exactly
    grpolora.operator.rbac.KUEUE_READS to Kueue's account (tests/operator/kueue_double.py reads with those rights),
    cluster-wide whatever namespaces the operator watches (Kueue's own ClusterRole is cluster-wide)."""
    from grpolora.operator import rbac as rbac_module

    grant = kueue_grant(chart.render(values))
    if account is None:
        assert grant is None
        return
    assert grant is not None
    subjects, granted = grant
    assert subjects == [account]
    assert granted == triples(rbac_module.KUEUE_READS)
    text = chart.template_text(values, "--show-only", "templates/rbac.yaml")
    assert all(f"# {rule.reason}" in text for rule in rbac_module.KUEUE_READS)
