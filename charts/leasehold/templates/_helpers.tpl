{{/* The release's base name: "leasehold" for a release called leasehold. */}}
{{- define "leasehold.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "leasehold.operator" -}}{{ include "leasehold.fullname" . }}-operator{{- end -}}
{{- define "leasehold.webhookService" -}}{{ include "leasehold.fullname" . }}-webhook{{- end -}}
{{- define "leasehold.webhookSecret" -}}{{ include "leasehold.fullname" . }}-webhook-tls{{- end -}}
{{- define "leasehold.webhookConfiguration" -}}{{ include "leasehold.fullname" . }}{{- end -}}
{{- define "leasehold.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{- define "leasehold.labels" -}}
app.kubernetes.io/name: leasehold-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: leasehold
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "leasehold.selector" -}}
app.kubernetes.io/name: leasehold-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The same labels as a label selector's text. */}}
{{- define "leasehold.selectorText" -}}
app.kubernetes.io/name=leasehold-operator,app.kubernetes.io/instance={{ .Release.Name }}
{{- end -}}

{{/*
What the operator does to the locks themselves: cluster-wide always. A watched namespace being
deleted loses its RoleBinding in the same sweep as its locks, and the operator must still
remove its finalizer from each, or the namespace stays Terminating.
*/}}
{{- define "leasehold.lockRules" -}}
- apiGroups: ["leasehold.dev"]
  resources: ["distributedlocks"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["leasehold.dev"]
  resources: ["distributedlocks/status"]
  verbs: ["patch"]
{{- end }}

{{/*
What the operator does beside the locks of the namespaces it reconciles: cluster-wide by
default, in each of operator.watchNamespaces when they are set.
*/}}
{{- define "leasehold.namespacedRules" -}}
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "list", "watch", "create", "update", "delete"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["authorization.k8s.io"]
  resources: ["localsubjectaccessreviews"]
  verbs: ["create"]
{{- end }}

{{/* The uninstall hook's rules and hook annotations (templates/uninstall-hook.yaml). */}}
{{- define "leasehold.uninstallRules" }}
rules:
  - apiGroups: ["leasehold.dev"]
    resources: ["distributedlocks"]
    verbs: ["list", "patch"]
  - apiGroups: ["coordination.k8s.io"]
    resources: ["leases"]
    verbs: ["get", "update"]
{{- end }}
{{- define "leasehold.uninstallHookAnnotations" }}
  annotations:
    helm.sh/hook: pre-delete
    helm.sh/hook-weight: "-5"
    helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
{{- end }}
{{- /*
Where the operator's pods run: the Deployment's (called with dict "root" .) and the uninstall Job's (with "job" true: of operator.affinity only its nodeAffinity, since a
required anti-affinity against the operator's replicas would hold the Job Pending on a cluster
whose every node runs one, and the Job is what stops them). The image runs on
image.architectures only, so they get a required node affinity for those unless
operator.affinity brings a nodeAffinity of its own or operator.nodeSelector names an
architecture.
*/ -}}
{{- define "leasehold.operatorScheduling" }}
{{- $v := .root.Values }}
{{- with $v.operator.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.operator.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $affinity := deepCopy ($v.operator.affinity | default dict) }}
{{- if .job }}
{{- $affinity = pick $affinity "nodeAffinity" }}
{{- end }}
{{- $archSelected := hasKey ($v.operator.nodeSelector | default dict) "kubernetes.io/arch" }}
{{- if and $v.image.architectures (not $affinity.nodeAffinity) (not $archSelected) }}
{{- $arch := dict "key" "kubernetes.io/arch" "operator" "In" "values" $v.image.architectures }}
{{- $terms := list (dict "matchExpressions" (list $arch)) }}
{{- $_ := set $affinity "nodeAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (dict "nodeSelectorTerms" $terms)) }}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- define "leasehold.operatorSecurityContext" }}
securityContext:
  runAsNonRoot: true
  {{- with .Values.operator.runAsUser }}
  runAsUser: {{ int64 . }}
  runAsGroup: {{ int64 . }}
  {{- end }}
  seccompProfile:
    type: RuntimeDefault
{{- end }}
