"""The operator's least-privilege RBAC, one rule per (API group, resources) with the reason for each verb.

The single source of truth: the Helm chart's ClusterRole is checked against RULES, and the operator tests record
every (verb, group, resource) the operator sends to the API emulator and check that RULES covers it.
Not needed, on purpose: `list`/`update` on Secrets (the token is created with its Secret; `get` reads Secrets by
name only: the job's own to check its owner, the ones a job names to check they are not the operator's), `list`/`watch`
on namespaces and CRDs (Kopf runs with scanning disabled, see grpolora.operator.main.build_settings), and anything
on pods but `list` and `patch` (workers are never touched directly, their workloads are, except that a pod taken as
lost on a node that never confirms its end loses the label the job's Services select it by:
job_course._leaving_trainer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from grpolora.api import constants as c


@dataclass(frozen=True)
class Rule:
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    reason: str

    def allows(self, verb: str, group: str, resource: str) -> bool:
        return group in self.api_groups and resource in self.resources and verb in self.verbs


RULES: Final[tuple[Rule, ...]] = (
    Rule(
        (c.GROUP,),
        (c.PLURAL,),
        ("get", "list", "watch", "patch", "delete"),
        "Kopf watches the jobs and keeps its handler state in annotations; the operator records the applied spec "
        "(patch), deletes finished jobs after ttlSecondsAfterFinished (delete) and reads a job before creating a "
        "child for it again, to create nothing for a job being deleted (get)",
    ),
    Rule((c.GROUP,), (f"{c.PLURAL}/status",), ("patch",), "the job status: phase, progress, conditions"),
    Rule(
        (c.GROUP,),
        (c.POOL_PLURAL,),
        ("get", "list", "watch", "patch"),
        "Kopf watches the RolloutPools and keeps its handler state in annotations (patch); a job's pass reads its "
        "pool on resyncs, and a pool's pass the pool before creating a child again (get)",
    ),
    Rule(
        (c.GROUP,),
        (c.RUNTIME_PLURAL,),
        ("get",),
        "a job that names a GRPOLoraRuntime (spec.runtimeRef) reads it until it starts (then it runs on the one it "
        "recorded), so no list or watch",
    ),
    Rule(
        (c.GROUP,),
        (c.CLUSTER_RUNTIME_PLURAL,),
        ("get",),
        "a job that names a ClusterGRPOLoraRuntime (cluster-scoped) reads it until it starts, as a GRPOLoraRuntime",
    ),
    Rule(
        (c.GROUP,),
        (f"{c.POOL_PLURAL}/status",),
        ("patch",),
        "the pool status: attached and waiting jobs (the jobs read their place there), replicas, adapter versions",
    ),
    Rule(
        (c.GROUP,),
        (f"{c.PLURAL}/finalizers", f"{c.POOL_PLURAL}/finalizers"),
        ("update",),
        "the children's ownerReferences set blockOwnerDeletion, which the OwnerReferencesPermissionEnforcement "
        "admission plugin (on in OpenShift) allows only to whoever may update the owner's finalizers",
    ),
    Rule(
        ("",),
        ("secrets",),
        ("get", "create", "patch"),
        "the per-job token Secret, created once; read by name to check that it is this job's (its owner's uid) and "
        "re-created if deleted; one an earlier release made gains the environment server's key (patch). A "
        "RolloutPool reads the token Secrets of the jobs it attaches (for their digest) and rewrites its "
        "attachment-list Secret as jobs attach and detach (patch). The Secrets a job names are read before its pods "
        "are created, to refuse the operator's own (its managed-by label)",
    ),
    Rule(
        ("",),
        ("services",),
        ("get", "list", "watch", "create", "patch"),
        "the headless Services that give the trainer and inference pods DNS; followed by a watch of the operator's "
        "(re-created at once if deleted), listed once per resync (what the watch missed), read to check their owner; "
        "the operator's label put back on one that lost it (patch: the watch follows that label)",
    ),
    Rule(
        ("networking.k8s.io",),
        ("networkpolicies",),
        ("get", "list", "watch", "create", "patch"),
        "the per-job NetworkPolicy that admits sync and control traffic only from the job's own pods, and its "
        "environment server's; followed by a watch and listed once per resync as the Services are, read to check its "
        "owner, rewritten where it is not as the job's spec builds it (patch). A RolloutPool's admits exactly its "
        "attached jobs' trainers: rewritten as they change (patch)",
    ),
    Rule(
        ("policy",),
        ("poddisruptionbudgets",),
        ("get", "list", "watch", "create", "patch"),
        "the PodDisruptionBudget that keeps a drain from evicting every inference pod at once; followed by a watch "
        "and listed once per resync as the Services are, read to check its owner, its label put back as theirs is",
    ),
    Rule(
        ("kueue.x-k8s.io",),
        ("workloads",),
        ("get", "list", "watch", "create", "patch", "delete"),
        "with the kueue.x-k8s.io/queue-name label: the job's Kueue Workload (a pod set per role, so Kueue admits both "
        "pools together); its admission followed by a watch; deactivated while the job is suspended (spec.active); "
        "a Finished one deleted when the job runs again after it failed to start",
    ),
    Rule(
        ("kueue.x-k8s.io",),
        ("resourceflavors",),
        ("get",),
        "read the ResourceFlavors a Kueue admission names (cluster-scoped), to give the pods their node labels and "
        "tolerations as Kueue's own integrations do; read when the pods are created, so no list or watch",
    ),
    Rule(
        ("scheduling.k8s.io",),
        ("priorityclasses",),
        ("list",),
        "the priority of a queued job's Kueue Workload, from the PriorityClass its pods name or the cluster's "
        "globalDefault one, as Kueue's integrations take it (cluster-scoped; listed when a Workload is made)",
    ),
    Rule(
        ("kueue.x-k8s.io",),
        ("workloads/status",),
        ("patch",),
        "as Kueue's job integrations do: give the quota back after an eviction, write PodsReady, mark a finished "
        "job's Workload Finished (Kueue then returns its quota)",
    ),
    Rule(
        ("batch",),
        ("jobs",),
        ("get", "list", "watch", "create", "patch", "delete"),
        "the trainer Indexed Job: follow its state (a watch of the operator's Jobs; listed once per resync), create "
        "it, delete it to restart or suspend the trainer, put the operator's label back on it if it lost it (patch)",
    ),
    Rule(
        ("apps",),
        ("statefulsets",),
        ("get", "list", "watch", "create", "patch", "delete"),
        "the inference StatefulSet: follow its ready replicas (a watch of the operator's StatefulSets; listed once "
        "per resync), create it, patch a RolloutPool's replicas when it scales, delete it on suspend and when the "
        "job ends",
    ),
    Rule(
        ("",),
        ("pods",),
        ("list", "patch"),
        "say why a job's pods are not ready (unschedulable, image pull errors); take a trainer pod whose node never "
        "confirms its deletion out of the job's Services (patch: its job-uid label removed) before its restart",
    ),
    Rule(
        ("",),
        ("pods/log",),
        ("get",),
        "read the last lines of a failed trainer pod's log before its restart deletes it (status.lastFailedAttempt)",
    ),
    Rule(
        ("",),
        ("events",),
        ("create", "list"),
        "Events on the job for each key transition; list Warning events to say why pods are never created (quota, "
        "Pod Security admission) or cannot mount their volumes (Multi-Attach)",
    ),
    Rule(
        ("",),
        ("persistentvolumeclaims",),
        ("get",),
        "read the access modes of the model and checkpoint claims that several pods share",
    ),
    Rule(
        ("kopf.dev",),
        ("kopfpeerings", "clusterkopfpeerings"),
        ("get", "list", "watch", "create", "patch"),
        "Kopf peering (leader election) with --peering: the operator creates the peering object if absent (create); "
        "Kopf keeps its peer record alive (list, watch, patch); the job monitors check that this replica is the "
        "active one (get). ClusterKopfPeering with --all-namespaces",
    ),
)


def allowed(verb: str, group: str, resource: str) -> bool:
    return any(rule.allows(verb, group, resource) for rule in RULES)


KUEUE_READS: Final[tuple[Rule, ...]] = (
    Rule(
        (c.GROUP,),
        (c.PLURAL, c.POOL_PLURAL),
        ("get", "list", "watch"),
        "for Kueue's service account: once GRPOLoraJob is listed in Kueue's integrations.externalFrameworks, Kueue's "
        "Job, StatefulSet and Pod webhooks walk a child's owner chain and read the owning GRPOLoraJob (or RolloutPool) "
        "with Kueue's own client (jobframework FindAncestorJobManagedByKueue; Kueue's external-framework guide: add "
        "RBAC for your CRD). Kueue's ClusterRole has no rule for grpolora.dev: without this its webhooks refuse every "
        "trainer Job",
    ),
)
"""What the chart grants Kueue's service account (kueue.readJobs in values.yaml): not the operator's own RBAC."""


def kueue_reads(verb: str, group: str, resource: str) -> bool:
    return any(rule.allows(verb, group, resource) for rule in KUEUE_READS)
