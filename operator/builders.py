"""JobPlan -> the Kubernetes objects of one job; PoolPlan -> those of one RolloutPool. Pure: no API calls, no clock, no
randomness.

`grpolora render` prints exactly these; the operator creates exactly these. A RolloutPool's servers are an inference
role like a job's own: the same functions build its StatefulSet, headless Service, PodDisruptionBudget and
NetworkPolicy, over the pool's RolePlan with the pool as owner (`Plan` is either). Choices, and why:
- Trainer: an Indexed Job. Pods get stable hostnames `<job>-trainer-<i>` under the headless Service (the
  MASTER_ADDR), and "all indexes completed" is the success signal. `backoffLimit: 0` because a rank that fails
  breaks the collective for all: the operator restarts the whole trainer group (from the latest checkpoint), up
  to spec.trainer.maxRestarts, as JobSet does. Its podFailurePolicy tells the operator why it failed (as JobSet's
  failurePolicy reads it): a disrupted pod (drain, preemption, spot reclaim) restarts the group without spending
  maxRestarts, and the trainer's "bad spec or data" exit codes fail the job at once.
- Inference pods have a PodDisruptionBudget (maxUnavailable 1), so a drain never takes every replica at once.
- Inference: a StatefulSet. Long-running servers with stable names that Kubernetes replaces when lost; the
  trainer re-forms the sync group around the replacement. `podManagementPolicy: Parallel` starts all at once.
- Headless Services with `publishNotReadyAddresses`, so rendezvous DNS exists before any pod is ready.
- The environment server (spec.environment.server): a StatefulSet too, `<job>-env`, for the same reasons: stable
  per-pod names under its headless Service (the trainer pins each episode to one pod, GRPOLORA_ENVIRONMENT_URL), a
  lost pod replaced under its name. A NetworkPolicy of its own admits only the job's trainer pods, on its port, and
  gives it only the egress its spec opens (none by default, not even DNS); the job's NetworkPolicy leaves its pods
  out, as peers and as targets, so that a sandbox that opened egress still cannot reach the trainer or the replicas.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping
from typing import Any, Final

from grpolora.api import constants as c
from grpolora.api import overlay
from grpolora.api.plan import (
    JobPlan,
    PoolPlan,
    RolePlan,
    child_names,
    token_secret_data,
)
from grpolora.api.pool import JOBS_FILE_KEY, REPLICAS_FILE_KEY, Attachments, PoolReplicas
from grpolora.api.spec import NetworkPolicySpec
from grpolora.operator import job_failure, kueue, pod_spec

K8sObject = dict[str, Any]
Plan = JobPlan | PoolPlan
"""The owner of the objects built: a job, or a RolloutPool (whose one role is its servers, role inference)."""

# Set by Kubernetes (1.21+) on every namespace: selects a namespace by name in NetworkPolicies.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def owner_reference(plan: Plan, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.POOL_KIND if isinstance(plan, PoolPlan) else c.KIND,
        "name": plan.name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _identity(plan: Plan) -> dict[str, str]:
    """The label that says whose a pod or child is: the job's (grpolora.dev/job) or the pool's."""
    return {c.LABEL_POOL: plan.name} if isinstance(plan, PoolPlan) else {c.LABEL_JOB: plan.name}


def pool_selector(pool_name: str) -> dict[str, str]:
    """The labels that select a RolloutPool's server pods (admitted by the NetworkPolicies of its jobs)."""
    return {c.LABEL_POOL: pool_name}


def labels(plan: Plan, role: str | None = None) -> dict[str, str]:
    result = {
        c.LABEL_NAME: c.APP_NAME,
        c.LABEL_INSTANCE: plan.name,
        c.LABEL_MANAGED_BY: c.OPERATOR_NAME,
        **_identity(plan),
    }
    if role:
        result[c.LABEL_COMPONENT] = role
        result[c.LABEL_ROLE] = role
    return result


def selector(plan: Plan, role: str | None = None) -> dict[str, str]:
    """The labels that select a job's (or pool's) pods (of one role): never the mutable recommended labels."""
    result = _identity(plan)
    if role:
        result[c.LABEL_ROLE] = role
    return result


JOB_UID_LABEL: Final = c.LABEL_JOB_UID
"""On every pod of a job, its uid; the job's Services select by it. A job deleted and applied again under its name
has a new uid: its old pods, Terminating, keep their DNS records (the headless Services publish not-ready
addresses) and would otherwise answer the new job's trainer."""


def _incarnation(objects: list[K8sObject], owner_uid: str) -> None:
    """Mark the job's pod templates (its workloads', and its Kueue Workload's pod sets) with its uid, and make its
    Services select it."""
    for obj in objects:
        if obj["kind"] == "Service":
            obj["spec"]["selector"][JOB_UID_LABEL] = owner_uid
        templates = [obj["spec"]["template"]] if obj["kind"] in ("Job", "StatefulSet") else []
        if obj["kind"] == "Workload":
            templates = [pod_set["template"] for pod_set in obj["spec"]["podSets"]]
        for template in templates:
            template.setdefault("metadata", {}).setdefault("labels", {})[JOB_UID_LABEL] = owner_uid


def build_children(
    plan: JobPlan,
    *,
    owner_uid: str,
    token: str,
    operator_namespace: str = c.DEFAULT_OPERATOR_NAMESPACE,
    admitted: Mapping[str, kueue.PodSetInfo] | None = None,
    priority: tuple[str, int] | None = None,
) -> list[K8sObject]:
    """Every object the operator creates for a job that is not suspended, in creation order.

    `operator_namespace`: where the operator runs; the NetworkPolicy admits its /status polls from there only.
    `admitted`: what Kueue's admission adds to the workloads' pod templates (see workloads()); the Kueue Workload
    itself always carries the templates as rendered. `priority`: (PriorityClass, its value) of the job's pods, for
    its Kueue Workload (pods_priority_class; None: no PriorityClass applies).
    """
    objects = [token_secret(plan, token), *services(plan)]
    if plan.job.spec.network_policy.enabled:
        objects.append(network_policy(plan, operator_namespace))
    if plan.environment is not None:  # its egress is closed whatever spec.networkPolicy says
        objects.append(environment_network_policy(plan))
    if plan.inference is not None:  # a job on a RolloutPool has no servers of its own
        objects.append(inference_disruption_budget(plan))
    if plan.environment is not None:
        objects.append(_disruption_budget(plan, plan.environment))
    if plan.job.queue_name is not None:
        objects.append(queue_workload(plan, priority))
    objects += workloads(plan, admitted)
    _incarnation(objects, owner_uid)
    return _owned(plan, owner_uid, objects)


def build_pool_children(
    plan: PoolPlan,
    *,
    owner_uid: str,
    attachments: Attachments,
    operator_namespace: str = c.DEFAULT_OPERATOR_NAMESPACE,
    generation: int = 1,
) -> list[K8sObject]:
    """Every object the operator creates for a RolloutPool, in creation order: the attachment-list Secret (which jobs
    the servers serve, and the pool's replicas; the operator rewrites it as jobs attach and detach and as the pool
    scales), the headless Service, the NetworkPolicy (which admits exactly the attached jobs' trainers), the
    PodDisruptionBudget and the servers' StatefulSet. `generation`: the pool's metadata.generation (1: a new pool)."""
    attached = [entry.job.partition("/")[2] for entry in attachments.jobs]
    objects = [pool_jobs_secret(plan, attachments, plan.replicas(generation)), *services(plan)]
    if plan.pool.spec.network_policy.enabled:
        objects.append(pool_network_policy(plan, attached, operator_namespace))
    objects += [inference_disruption_budget(plan), inference_statefulset(plan)]
    return _owned(plan, owner_uid, objects)


def _owned(plan: Plan, owner_uid: str, objects: list[K8sObject]) -> list[K8sObject]:
    owner = owner_reference(plan, owner_uid)
    for obj in objects:
        obj["metadata"]["ownerReferences"] = [dict(owner)]
    return objects


def workloads(plan: JobPlan, admitted: Mapping[str, kueue.PodSetInfo] | None = None) -> list[K8sObject]:
    """The objects that run pods (removed while the job is suspended). `admitted`: what Kueue's admission adds to
    each role's pod template, by pod set name (grpolora.operator.kueue; raises kueue.PodSetConflict)."""
    admitted = admitted or {}
    result = [trainer_job(plan, admitted.get(c.ROLE_TRAINER))]
    if plan.inference is not None:
        result.append(inference_statefulset(plan, admitted.get(c.ROLE_INFERENCE)))
    if plan.environment is not None:
        result.append(environment_statefulset(plan, admitted.get(c.ROLE_ENVIRONMENT)))
    return result


def _metadata(plan: Plan, name: str, role: str | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": plan.namespace, "labels": labels(plan, role)}


def token_secret(plan: JobPlan, token: str) -> K8sObject:
    """The job's token and the environment server's, derived from it (grpolora.api.plan.token_secret_data): the
    server's pods mount only theirs (they run model-driven code), the trainer and inference pods only the job's."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(plan, plan.token_secret),
        "type": "Opaque",
        "stringData": token_secret_data(token),
    }


def pool_jobs_secret(plan: PoolPlan, attachments: Attachments, replicas: PoolReplicas) -> K8sObject:
    """The pool's attachment list and its replicas (grpolora.api.pool), mounted read-only into its servers. It holds
    no job token. Written as `data` (base64), which reads back the same from a real API server (stringData is
    write-only)."""
    encoded = {key: base64.b64encode(text.encode()).decode() for key, text in (
        (JOBS_FILE_KEY, attachments.to_json()), (REPLICAS_FILE_KEY, replicas.to_json())
    )}  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(plan, plan.jobs_secret),
        "type": "Opaque",
        "data": encoded,
    }


def attachments_of(secret: Mapping[str, Any] | None) -> Attachments | None:
    """The attachment list a pool's Secret holds (None: no Secret, or not a readable list)."""
    if secret is None:
        return None
    try:
        if JOBS_FILE_KEY in (secret.get("data") or {}):
            return Attachments.from_json(base64.b64decode(secret["data"][JOBS_FILE_KEY]).decode())
        return Attachments.from_json((secret.get("stringData") or {})[JOBS_FILE_KEY])
    except (KeyError, ValueError):
        return None


def _roles(plan: Plan) -> tuple[RolePlan, ...]:
    return (plan.inference,) if isinstance(plan, PoolPlan) else plan.roles


def services(plan: Plan) -> list[K8sObject]:
    result = []
    for role_plan in _roles(plan):
        result.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": _metadata(plan, role_plan.service_name, role_plan.role),
                "spec": {
                    "clusterIP": "None",
                    # Rendezvous needs every pod's DNS record before any pod is ready.
                    "publishNotReadyAddresses": True,
                    "selector": selector(plan, role_plan.role),
                    "ports": [
                        {"name": name, "port": port, "targetPort": port, "protocol": "TCP"}
                        for name, port in role_plan.ports.items()
                    ],
                },
            }
        )
    return result


def network_policy(plan: JobPlan, operator_namespace: str = c.DEFAULT_OPERATOR_NAMESPACE) -> K8sObject:
    spec = plan.job.spec
    # gloo and NCCL open data connections on ephemeral ports, so the job's own pods get every port; so do the
    # servers of its RolloutPool, whose receivers join the job's sync group at its trainer's store (sync port).
    peers = [{"podSelector": _job_pods(plan)}]
    if plan.pool is not None:
        peers.append({"podSelector": {"matchLabels": pool_selector(plan.pool)}})
    # The operator polls trainer rank 0's /status (unauthenticated).
    return _network_policy(
        plan,
        plan.name,
        [{"from": peers}],
        operator_namespace,
        pods=_job_pods(plan),
        operator_port=spec.trainer.status_port,
        http_ports=[r.ports["http"] for r in plan.roles if r is not plan.environment],
        policy=spec.network_policy,
    )


def _job_pods(plan: JobPlan) -> dict[str, Any]:
    """The selector of the job's trainer and inference pods: with an environment server, its pods are left out (they
    run untrusted tools; environment_network_policy is theirs)."""
    if plan.environment is None:
        return {"matchLabels": selector(plan)}
    left_out = {"key": c.LABEL_ROLE, "operator": "NotIn", "values": [c.ROLE_ENVIRONMENT]}
    return {"matchLabels": selector(plan), "matchExpressions": [left_out]}


def environment_network_policy(plan: JobPlan) -> K8sObject:
    """The environment server's pods: ingress from the job's trainer pods (its environment processes and agents
    call it) on the server's port only, and egress only where spec.environment.server.egress opens it (empty: none,
    not even DNS; answers to admitted connections still flow). Not switched off by spec.networkPolicy.enabled: a
    sandbox is closed unless its own spec opens it."""
    role, server = plan.environment, plan.spec.environment_server
    assert role is not None and server is not None
    trainers = {"podSelector": {"matchLabels": selector(plan, c.ROLE_TRAINER)}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(plan, child_names(plan.name)["environmentNetworkPolicy"], role.role),
        "spec": {
            "podSelector": {"matchLabels": selector(plan, role.role)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [trainers], "ports": [{"port": role.ports["http"], "protocol": "TCP"}]}],
            "egress": copy.deepcopy(server.egress),
        },
    }


def pool_network_policy(
    plan: PoolPlan, attached: list[str], operator_namespace: str = c.DEFAULT_OPERATOR_NAMESPACE
) -> K8sObject:
    """Admits exactly the trainer pods of the attached jobs (names in the pool's namespace), on every port: they call
    the servers' HTTP API, and gloo pairs connect on ephemeral ports. With none attached the rule is left out (a rule
    with an empty `from` would admit everyone). The operator reads the servers' GET /v1/adapter on the HTTP port."""
    http = plan.inference.ports["http"]
    trainers = [
        {"podSelector": {"matchLabels": {c.LABEL_JOB: job, c.LABEL_ROLE: c.ROLE_TRAINER}}} for job in sorted(attached)
    ]
    return _network_policy(
        plan,
        plan.inference.workload_name,
        [{"from": trainers}] if trainers else [],
        operator_namespace,
        pods={"matchLabels": selector(plan)},
        operator_port=http,
        http_ports=[http],
        policy=plan.pool.spec.network_policy,
    )


def _network_policy(
    plan: Plan,
    name: str,
    ingress: list[dict[str, Any]],
    operator_namespace: str,
    *,
    pods: dict[str, Any],
    operator_port: int,
    http_ports: list[int],
    policy: NetworkPolicySpec,
) -> K8sObject:
    """The NetworkPolicy `name` of the pods `pods` selects: `ingress`, the operator's pods on `operator_port`, and
    spec.networkPolicy.metricsFrom on the HTTP ports."""
    ingress = [
        *ingress,
        # From the operator's pods in its own namespace only, not from any pod elsewhere that copies its label.
        {
            "from": [
                {
                    "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: operator_namespace}},
                    "podSelector": {"matchLabels": {c.LABEL_NAME: c.OPERATOR_NAME}},
                }
            ],
            "ports": [{"port": operator_port, "protocol": "TCP"}],
        },
    ]
    if policy.metrics_from:
        ingress.append(
            {
                "from": [copy.deepcopy(peer) for peer in policy.metrics_from],
                "ports": [{"port": port, "protocol": "TCP"} for port in sorted(set(http_ports))],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(plan, name),
        "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def pods_priority_class(plan: JobPlan) -> str | None:
    """The PriorityClass the job's pods name (spec.scheduling.priorityClassName, or a role's podTemplate): the one
    its Kueue Workload ranks with, as Kueue's integrations take it from their pod templates (jobframework
    PrepareWorkloadPriority). The trainer's first, as Kueue takes the first pod set's."""
    for workload in workloads(plan):
        name = workload["spec"]["template"]["spec"].get("priorityClassName")
        if name:
            return str(name)
    return None


def queue_workload(plan: JobPlan, priority: tuple[str, int] | None = None) -> K8sObject:
    """One Kueue Workload for the whole job, a pod set per role with the pod templates rendered here: Kueue admits
    all pod sets or none, so inference never holds its GPUs while the trainer's do not fit (or the reverse). The
    operator creates the trainer Job and inference StatefulSet only while it is admitted (grpolora.operator.reconcile)
    and marks it Finished when the job ends, which returns the quota. A suspended job's Workload is inactive."""
    # A job on a RolloutPool has only its trainer: the pool's servers are not the job's to queue.
    pod_sets = [
        {"name": role.role, "count": role.replicas, "template": workload["spec"]["template"]}
        for role, workload in zip(plan.roles, workloads(plan), strict=True)
    ]
    workload = {
        "apiVersion": c.KUEUE_API_VERSION,
        "kind": "Workload",
        "metadata": _metadata(plan, plan.name),
        "spec": {"queueName": plan.job.queue_name, "podSets": pod_sets},
    }
    if priority is not None:
        # Kueue's scheduler orders a queue and preempts by spec.priority; its validation wants it with the class
        # (workload_webhook.go: priority is required when priorityClassName is set).
        workload["spec"].update(
            priorityClassName=priority[0], priority=priority[1], priorityClassSource=PRIORITY_CLASS_SOURCE
        )
    if plan.job.spec.suspend:
        # Created inactive, so that Kueue never reserves quota for a suspended job (reactivated when it resumes).
        workload["metadata"]["annotations"] = {kueue.DEACTIVATED_FOR_SUSPEND: "true"}
        workload["spec"]["active"] = False
    return workload


PRIORITY_CLASS_SOURCE = "scheduling.k8s.io/priorityclass"
"""A Workload's priorityClassSource for a pods' PriorityClass (Kueue's constants.PodPriorityClassSource)."""


def inference_disruption_budget(plan: Plan) -> K8sObject:
    """At most one inference pod evicted at a time: the trainer re-forms the sync group around the rest, and a
    drain waits for the replacement to be ready before it evicts the next (one replica is not protected)."""
    return _disruption_budget(plan, plan.inference)


def _disruption_budget(plan: Plan, role: RolePlan | None) -> K8sObject:
    """At most one of a role's pods evicted at a time (the inference servers', the environment server's: a drain
    that took every environment pod at once would end every episode in flight)."""
    assert role is not None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(plan, role.workload_name, role.role),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(plan, role.role)}},
    }


def trainer_job(plan: JobPlan, admitted: kueue.PodSetInfo | None = None) -> K8sObject:
    role = plan.trainer
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(plan, role.workload_name, role.role),
        "spec": {
            "completionMode": "Indexed",
            "completions": role.replicas,
            "parallelism": role.replicas,
            "backoffLimit": 0,
            "podFailurePolicy": job_failure.trainer_failure_policy(),
            "template": _pod_template(
                plan,
                role,
                pod_spec.build_pod_spec(plan, role, restart_policy="Never", subdomain=role.service_name),
                admitted,
            ),
        },
    }


def inference_statefulset(plan: Plan, admitted: kueue.PodSetInfo | None = None) -> K8sObject:
    role = plan.inference
    assert role is not None, "a job on a RolloutPool has no inference StatefulSet of its own"
    return _statefulset(plan, role, pod_spec.build_pod_spec(plan, role, restart_policy="Always"), admitted)


def environment_statefulset(plan: JobPlan, admitted: kueue.PodSetInfo | None = None) -> K8sObject:
    """spec.environment.server's pods: a StatefulSet as the inference servers' (stable per-pod names under its
    headless Service, a lost pod replaced under its name), started in parallel."""
    role = plan.environment
    assert role is not None, "the job has no spec.environment.server"
    return _statefulset(plan, role, pod_spec.environment_pod_spec(plan, role), admitted)


def _statefulset(plan: Plan, role: RolePlan, spec: K8sObject, admitted: kueue.PodSetInfo | None) -> K8sObject:
    """A role's servers: stable per-pod names under its headless Service, all started at once (Parallel)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(plan, role.workload_name, role.role),
        "spec": {
            "serviceName": role.service_name,
            "replicas": role.replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector(plan, role.role)},
            "template": _pod_template(plan, role, spec, admitted),
        },
    }


def _pod_template(
    plan: Plan, role: RolePlan, spec: dict[str, Any], admitted: kueue.PodSetInfo | None = None
) -> dict[str, Any]:
    """The role's pod template with spec.<role>.podTemplate merged over it (grpolora.api.overlay; the spec's
    validation has refused any overlay that would replace what is built here; the environment server has none),
    then what Kueue's admission adds."""
    built = {"metadata": {"labels": labels(plan, role.role)}, "spec": spec}
    template = built
    if role.role != c.ROLE_ENVIRONMENT:
        template = overlay.merge(built, pod_spec.role_spec(plan, role).pod_template)
    if admitted is None:
        return template
    holder = f"the {role.role} pod template (spec.{role.role}.nodeSelector, spec.{role.role}.podTemplate)"
    if role.role == c.ROLE_ENVIRONMENT:
        holder = "the environment server's pod template (spec.environment.server.nodeSelector)"
    return kueue.apply(template, admitted, holder=holder)
