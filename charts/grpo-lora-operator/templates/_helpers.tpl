{{/*
The app name. Fixed on purpose: every job's NetworkPolicy admits the operator to the trainer's status port by the
pod label app.kubernetes.io/name=grpo-lora-operator (grpolora.api.constants.OPERATOR_NAME).
*/}}
{{- define "grpo-lora-operator.name" -}}
grpo-lora-operator
{{- end }}

{{/*
Prefix of every object name: fullnameOverride; else the release name when it contains the chart name, or the chart
name when it starts with the release name (`helm install grpo-lora ...` gives grpo-lora-operator); else both joined.
*/}}
{{- define "grpo-lora-operator.fullname" -}}
{{- $name := include "grpo-lora-operator.name" . }}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else if hasPrefix .Release.Name $name }}
{{- $name }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
Names of cluster-scoped objects also carry the release namespace, so two releases in two namespaces never collide.
*/}}
{{- define "grpo-lora-operator.clusterName" -}}
{{- printf "%s-%s" .Release.Namespace (include "grpo-lora-operator.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "grpo-lora-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "grpo-lora-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "grpo-lora-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "grpo-lora-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: grpo-lora
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "grpo-lora-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "grpo-lora-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "grpo-lora-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* "true" when the operator serves every namespace (a ClusterRole), "" when it serves the listed ones. */}}
{{- define "grpo-lora-operator.allNamespaces" -}}
{{- if not .Values.watch.namespaces }}true{{ end }}
{{- end }}

{{/* Checks that the schema cannot express. */}}
{{- define "grpo-lora-operator.validate" -}}
{{- if eq (int .Values.metrics.port) (int .Values.health.port) }}
{{- fail (printf "metrics.port and health.port must differ (both are %v)" .Values.metrics.port) }}
{{- end }}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.peering.enabled) }}
{{- fail (printf "replicaCount=%v needs peering.enabled=true: without Kopf peering every replica would act on every job at once (with it, one acts and the others stand by)" .Values.replicaCount) }}
{{- end }}
{{- end }}
