{{/*
The operator's permissions: exactly grpolora.operator.rbac.RULES (operator/rbac.py), each with its reason.
tests/chart/test_rbac.py renders the chart and compares; on a mismatch it prints the rules to paste here.

Namespaced rules: in the ClusterRole when all namespaces are watched, else in a Role in each watched namespace.
Cluster-scoped rules: always in a ClusterRole (a Role cannot grant them).
Peering rules (kopf.dev): only with peering.enabled; KopfPeering per namespace, ClusterKopfPeering cluster-wide.
*/}}

{{- define "grpo-lora-operator.rules.namespaced" -}}
# Kopf watches GRPOLoraJobs and patches its finalizer and progress annotations on them; delete implements ttlSecondsAfterFinished.
- apiGroups: ["grpolora.dev"]
  resources: ["grpolorajobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
# The operator writes phase, step, syncRound, conditions and the rest of a job's status.
- apiGroups: ["grpolora.dev"]
  resources: ["grpolorajobs/status"]
  verbs: ["get", "patch"]
# Events on a job for each handler outcome and key transition.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# The per-job token Secret: created once, read back to authenticate to trainer rank 0's /status.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
# The headless per-role Services that give rendezvous DNS names.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create"]
# The per-job NetworkPolicy admitting sync and control ports only from the job's own pods.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create"]
# The trainer Indexed Job: created, watched for completion, deleted to restart from a checkpoint or on suspend.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "delete"]
# The inference StatefulSet: created, watched for ready replicas, scaled, deleted on suspend.
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Worker pods are read to count ready replicas and say why a job is stuck (Pending, image pull, OOMKilled).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
{{- end }}

{{- define "grpo-lora-operator.rules.cluster" -}}
# Kopf watches CustomResourceDefinitions to notice the GRPOLoraJob CRD being (re)installed without a restart.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end }}

{{- define "grpo-lora-operator.rules.peering.namespaced" -}}
# Kopf peering in namespaced mode: operators announce themselves in the KopfPeering of each served namespace.
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}

{{- define "grpo-lora-operator.rules.peering.cluster" -}}
# Kopf peering in cluster-wide mode: operators announce themselves in the ClusterKopfPeering.
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
