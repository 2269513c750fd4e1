{{/* Names and labels shared by the templates. */}}
{{- define "loraplex.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "loraplex.labels" -}}
app.kubernetes.io/part-of: loraplex
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "loraplex.selector" -}}
app.kubernetes.io/part-of: loraplex
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "loraplex.image" -}}
{{- printf "%s/loraplex-%s:%s" .root.Values.image.repository .role (.root.Values.image.tag | default .root.Chart.AppVersion) -}}
{{- end -}}

{{/* Namespace-qualified: pools in any namespace hand it to their agents. */}}
{{- define "loraplex.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis.%s.svc:6379/0" (include "loraplex.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- required "redis.externalUrl is required when redis.enabled is false" .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{- define "loraplex.podSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "loraplex.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* RBAC rules the operator needs in each namespace it serves. */}}
{{- define "loraplex.operatorNamespacedRules" -}}
# The resources it serves: watch them, add finalizers and annotations, write their status.
- apiGroups: [loraplex.io]
  resources: [adapterpools, loradeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [loraplex.io]
  resources: [adapterpools/status, loradeployments/status]
  verbs: [get, patch]
# What a pool owns (server-side apply creates and updates through patch).
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch]
{{- if .Values.gateway.inferencePool.enabled }}
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch]
{{- end }}
# Which servers' pods are Ready: a server serves only with a Ready pod and a fresh heartbeat.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
# The HF_TOKEN of a LoRADeployment's credentialsSecretRef (read, never written).
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
# Events on every status transition.
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
{{- end }}

{{/* LORAPLEX_REDIS_PASSWORD from redis.auth.existingSecret, when set. */}}
{{- define "loraplex.redisPasswordEnv" -}}
{{- with .Values.redis.auth.existingSecret }}
- name: LORAPLEX_REDIS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ . }}, key: redis-password}
{{- end }}
{{- end -}}

{{/* The names of imagePullSecrets, comma-separated (the operator's default for pool pods). */}}
{{- define "loraplex.pullSecretNames" -}}
{{- $names := list -}}
{{- range .Values.imagePullSecrets }}{{ $names = append $names .name }}{{ end -}}
{{- join "," $names -}}
{{- end -}}
