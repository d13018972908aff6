{{/*
The operator's permissions: exactly grpolora.operator.rbac.RULES (operator/rbac.py), each with its reason.
tests/chart/test_rbac.py renders the chart and compares; on a mismatch it prints the rules to paste here.

Namespaced rules: in the ClusterRole when all namespaces are watched, else in a Role in each watched namespace.
The cluster-scoped resources the operator reads are ClusterGRPOLoraRuntimes and Kueue's ResourceFlavors (with
kueue.resourceFlavors): in the ClusterRole, or in a ClusterRole of their own when namespaces are listed (Kopf runs with
CRD and namespace scanning off).
Peering rules (kopf.dev): only with peering.enabled; KopfPeering per namespace, ClusterKopfPeering cluster-wide.
*/}}

{{- define "grpo-lora-operator.rules.namespaced" -}}
# Kopf watches the jobs and keeps its handler state in annotations; the operator records the applied spec (patch), deletes finished jobs after ttlSecondsAfterFinished (delete) and reads a job before creating a child for it again, to create nothing for a job being deleted (get)
- apiGroups: ["grpolora.dev"]
  resources: ["grpolorajobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
# the job status: phase, progress, conditions
- apiGroups: ["grpolora.dev"]
  resources: ["grpolorajobs/status"]
  verbs: ["patch"]
# Kopf watches the RolloutPools and keeps its handler state in annotations (patch); a job's pass reads its pool on resyncs, and a pool's pass the pool before creating a child again (get)
- apiGroups: ["grpolora.dev"]
  resources: ["rolloutpools"]
  verbs: ["get", "list", "watch", "patch"]
# a job that names a GRPOLoraRuntime (spec.runtimeRef) reads it until it starts (then it runs on the one it recorded), so no list or watch
- apiGroups: ["grpolora.dev"]
  resources: ["grpoloraruntimes"]
  verbs: ["get"]
# the pool status: attached and waiting jobs (the jobs read their place there), replicas, adapter versions
- apiGroups: ["grpolora.dev"]
  resources: ["rolloutpools/status"]
  verbs: ["patch"]
# the children's ownerReferences set blockOwnerDeletion, which the OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift) allows only to whoever may update the owner's finalizers
- apiGroups: ["grpolora.dev"]
  resources: ["grpolorajobs/finalizers", "rolloutpools/finalizers"]
  verbs: ["update"]
# the per-job token Secret, created once; read by name to check that it is this job's (its owner's uid) and re-created if deleted; one an earlier release made gains the environment server's key (patch). A RolloutPool reads the token Secrets of the jobs it attaches (for their digest) and rewrites its attachment-list Secret as jobs attach and detach (patch). The Secrets a job names are read before its pods are created, to refuse the operator's own (its managed-by label)
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "patch"]
# the headless Services that give the trainer and inference pods DNS; followed by a watch of the operator's (re-created at once if deleted), listed once per resync (what the watch missed), read to check their owner; the operator's label put back on one that lost it (patch: the watch follows that label)
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch"]
# the per-job NetworkPolicy that admits sync and control traffic only from the job's own pods, and its environment server's; followed by a watch and listed once per resync as the Services are, read to check its owner, rewritten where it is not as the job's spec builds it (patch). A RolloutPool's admits exactly its attached jobs' trainers: rewritten as they change (patch)
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch"]
# the PodDisruptionBudget that keeps a drain from evicting every inference pod at once; followed by a watch and listed once per resync as the Services are, read to check its owner, its label put back as theirs is
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch"]
# with the kueue.x-k8s.io/queue-name label: the job's Kueue Workload (a pod set per role, so Kueue admits both pools together); its admission followed by a watch; deactivated while the job is suspended (spec.active); a Finished one deleted when the job runs again after it failed to start
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# as Kueue's job integrations do: give the quota back after an eviction, write PodsReady, mark a finished job's Workload Finished (Kueue then returns its quota)
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
# the trainer Indexed Job: follow its state (a watch of the operator's Jobs; listed once per resync), create it, delete it to restart or suspend the trainer, put the operator's label back on it if it lost it (patch)
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# the inference StatefulSet: follow its ready replicas (a watch of the operator's StatefulSets; listed once per resync), create it, patch a RolloutPool's replicas when it scales, delete it on suspend and when the job ends
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# say why a job's pods are not ready (unschedulable, image pull errors); take a trainer pod whose node never confirms its deletion out of the job's Services (patch: its job-uid label removed) before its restart
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "patch"]
# read the last lines of a failed trainer pod's log before its restart deletes it (status.lastFailedAttempt)
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
# Events on the job for each key transition; list Warning events to say why pods are never created (quota, Pod Security admission) or cannot mount their volumes (Multi-Attach)
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "list"]
# read the access modes of the model and checkpoint claims that several pods share
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get"]
{{- end }}

{{- define "grpo-lora-operator.rules.runtimes.cluster" -}}
# a job that names a ClusterGRPOLoraRuntime (cluster-scoped) reads it until it starts, as a GRPOLoraRuntime
- apiGroups: ["grpolora.dev"]
  resources: ["clustergrpoloraruntimes"]
  verbs: ["get"]
{{- end }}

{{- define "grpo-lora-operator.rules.priority.cluster" -}}
# the priority of a queued job's Kueue Workload, from the PriorityClass its pods name or the cluster's globalDefault one, as Kueue's integrations take it (cluster-scoped; listed when a Workload is made)
- apiGroups: ["scheduling.k8s.io"]
  resources: ["priorityclasses"]
  verbs: ["list"]
{{- end }}

{{- define "grpo-lora-operator.rules.kueue.cluster" -}}
# read the ResourceFlavors a Kueue admission names (cluster-scoped), to give the pods their node labels and tolerations as Kueue's own integrations do; read when the pods are created, so no list or watch
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["resourceflavors"]
  verbs: ["get"]
{{- end }}

{{- define "grpo-lora-operator.rules.peering.namespaced" -}}
# Kopf peering (leader election) with --peering: the operator creates the peering object if absent (create); Kopf keeps its peer record alive (list, watch, patch); the job monitors check that this replica is the active one (get). ClusterKopfPeering with --all-namespaces
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "create", "patch"]
{{- end }}

{{- define "grpo-lora-operator.rules.peering.cluster" -}}
# Kopf peering (leader election) with --peering: the operator creates the peering object if absent (create); Kopf keeps its peer record alive (list, watch, patch); the job monitors check that this replica is the active one (get). ClusterKopfPeering with --all-namespaces
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "create", "patch"]
{{- end }}

{{- define "grpo-lora-operator.rules.kueue.reads" -}}
# for Kueue's service account: once GRPOLoraJob is listed in Kueue's integrations.externalFrameworks, Kueue's Job, StatefulSet and Pod webhooks walk a child's owner chain and read the owning GRPOLoraJob (or RolloutPool) with Kueue's own client (jobframework FindAncestorJobManagedByKueue; Kueue's external-framework guide: add RBAC for your CRD). Kueue's ClusterRole has no rule for grpolora.dev: without this its webhooks refuse every trainer Job
- apiGroups: ["grpolora.dev"]
  resources: ["grpolorajobs", "rolloutpools"]
  verbs: ["get", "list", "watch"]
{{- end }}
