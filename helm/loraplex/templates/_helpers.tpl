{{/*
The loraplex CLI and HTTP contract the chart relies on: subcommands, routes and the
environment variables the roles read. A rename in loraplex is one edit here.
*/}}
{{- define "loraplex.contract" -}}
commands:
  gateway: gateway
  worker: worker
  serve: serve
  migrate: migrate
routes:
  liveness: /health
  readiness: /ready
  metrics: /metrics
env:
  adminToken: LORAPLEX_ADMIN_TOKEN
  internalToken: LORAPLEX_INTERNAL_TOKEN
  databaseUrl: LORAPLEX_DATABASE_URL
  dataDir: LORAPLEX_DATA_DIR
  cacheDir: LORAPLEX_CACHE_DIR
{{- end }}

{{- define "loraplex.c" -}}
{{- include "loraplex.contract" . | fromYaml | toJson -}}
{{- end }}

{{- define "loraplex.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loraplex.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Object names, one place each (the 15-character margin leaves room for suffixes). */}}
{{- define "loraplex.gatewayName" -}}{{ include "loraplex.fullname" . | trunc 48 | trimSuffix "-" }}-gateway{{- end }}
{{- define "loraplex.workerName" -}}{{ include "loraplex.fullname" . | trunc 48 | trimSuffix "-" }}-worker{{- end }}
{{- define "loraplex.workerHeadlessName" -}}{{ include "loraplex.fullname" . | trunc 48 | trimSuffix "-" }}-workers{{- end }}
{{- define "loraplex.migrateName" -}}{{ include "loraplex.fullname" . | trunc 48 | trimSuffix "-" }}-migrate{{- end }}
{{- define "loraplex.postgresqlName" -}}{{ include "loraplex.fullname" . | trunc 48 | trimSuffix "-" }}-postgresql{{- end }}

{{- define "loraplex.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "loraplex.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "loraplex.secretName" -}}
{{- default (include "loraplex.fullname" .) .Values.secrets.existingSecret }}
{{- end }}

{{/* The workers' headless Service as the gateway's --workers-dns NAME:PORT. */}}
{{- define "loraplex.workersDns" -}}
{{- printf "%s.%s.svc.%s:%d" (include "loraplex.workerHeadlessName" .) .Release.Namespace .Values.clusterDomain (int .Values.worker.port) }}
{{- end }}

{{- define "loraplex.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "loraplex.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: loraplex
{{- end }}

{{- define "loraplex.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels and selector labels of one component: (dict "ctx" $ "component" "gateway"). */}}
{{- define "loraplex.componentLabels" -}}
{{ include "loraplex.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "loraplex.componentSelector" -}}
{{ include "loraplex.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "loraplex.cpuImage" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.cpuTag }}
{{- end }}

{{- define "loraplex.workerImage" -}}
{{- if .Values.cpuOnly }}
{{- include "loraplex.cpuImage" . }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository .Values.image.cudaTag }}
{{- end }}
{{- end }}

{{- define "loraplex.workerDevice" -}}
{{- if .Values.cpuOnly }}cpu{{ else }}{{ .Values.worker.device }}{{ end }}
{{- end }}

{{/*
Generated secrets: a value given in values wins, else the one already in the release's
Secret (kept across upgrades), else a new random one. Memoised in the render so the
Secret, the migration hook's Secret and the built-in PostgreSQL see the same value.
(dict "ctx" $ "key" "admin-token" "value" "<from values>")
*/}}
{{- define "loraplex.generated" -}}
{{- $ctx := .ctx }}
{{- $memo := $ctx.Values._generated | default dict }}
{{- if not (hasKey $memo .key) }}
{{- $v := .value }}
{{- if not $v }}
{{- $existing := lookup "v1" "Secret" $ctx.Release.Namespace (include "loraplex.fullname" $ctx) }}
{{- if and $existing (hasKey ($existing.data | default dict) .key) }}
{{- $v = index $existing.data .key | b64dec }}
{{- else }}
{{- $v = randAlphaNum 40 }}
{{- end }}
{{- end }}
{{- $_ := set $memo .key $v }}
{{- $_ := set $ctx.Values "_generated" $memo }}
{{- end }}
{{- index $memo .key }}
{{- end }}

{{- define "loraplex.databaseUrl" -}}
{{- if .Values.database.url }}
{{- .Values.database.url }}
{{- else if include "loraplex.builtinPostgres" . }}
{{- $pw := include "loraplex.generated" (dict "ctx" . "key" "postgres-password" "value" .Values.postgresql.auth.password) }}
{{- printf "postgresql+psycopg://%s:%s@%s.%s.svc.%s:5432/%s" .Values.postgresql.auth.username (urlquery $pw) (include "loraplex.postgresqlName" .) .Release.Namespace .Values.clusterDomain .Values.postgresql.auth.database }}
{{- else }}
{{- fail "loraplex needs a database: set database.url (an external PostgreSQL), secrets.existingSecret, or postgresql.enabled=true" }}
{{- end }}
{{- end }}

{{/* "true" when the chart runs its own PostgreSQL (no external URL, no existing Secret). */}}
{{- define "loraplex.builtinPostgres" -}}
{{- if and .Values.postgresql.enabled (not .Values.database.url) (not .Values.secrets.existingSecret) -}}
true
{{- end }}
{{- end }}

{{/* The migration runs before install when the database exists already, after it otherwise. */}}
{{- define "loraplex.migrationHook" -}}
{{- if include "loraplex.builtinPostgres" . -}}
post-install,pre-upgrade
{{- else -}}
pre-install,pre-upgrade
{{- end }}
{{- end }}

{{/* The env every loraplex role shares: secrets by reference, the S3 store's settings. */}}
{{- define "loraplex.commonEnv" -}}
{{- $c := include "loraplex.c" . | fromJson }}
- name: {{ $c.env.databaseUrl }}
  valueFrom:
    secretKeyRef:
      name: {{ include "loraplex.secretName" . }}
      key: {{ .Values.secrets.keys.databaseUrl }}
{{- /* Nothing is fetched from a model hub at run time, whatever a library would try. */}}
- name: HF_HUB_OFFLINE
  value: "1"
- name: TRANSFORMERS_OFFLINE
  value: "1"
{{- if eq .Values.adapterStore.type "s3" }}
{{- with .Values.adapterStore.s3.endpointUrl }}
- name: AWS_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with .Values.adapterStore.s3.region }}
- name: AWS_DEFAULT_REGION
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{- define "loraplex.s3EnvFrom" -}}
{{- if and (eq .Values.adapterStore.type "s3") .Values.adapterStore.s3.existingSecret }}
- secretRef:
    name: {{ .Values.adapterStore.s3.existingSecret }}
{{- end }}
{{- end }}

{{- define "loraplex.adapterStoreUrl" -}}
{{- if not .Values.adapterStore.s3.bucket }}
{{- fail "adapterStore.type=s3 needs adapterStore.s3.bucket" }}
{{- end }}
{{- printf "s3://%s/%s" .Values.adapterStore.s3.bucket (trimPrefix "/" .Values.adapterStore.s3.prefix) | trimSuffix "/" }}
{{- end }}

{{/* `loraplex gateway ...` arguments. */}}
{{- define "loraplex.gatewayArgs" -}}
{{- $c := include "loraplex.c" . | fromJson }}
- {{ $c.commands.gateway }}
- --workers-dns
- {{ include "loraplex.workersDns" . }}
- --host
- 0.0.0.0
- --port
- {{ .Values.gateway.port | quote }}
- --data-dir
- /var/lib/loraplex
{{- /* The gateway's own default is loopback:9464, which no scraper outside the pod reaches:
      a metrics port listens on every address, and none means /metrics on the main port. */}}
{{- if .Values.gateway.metricsPort }}
- --metrics-host
- 0.0.0.0
- --metrics-port
- {{ .Values.gateway.metricsPort | quote }}
{{- else }}
- --metrics-port
- "0"
{{- end }}
{{- include "loraplex.forwardedAllowIpsArgs" . }}
{{- if eq .Values.adapterStore.type "s3" }}
- --adapter-store
- {{ include "loraplex.adapterStoreUrl" . }}
{{- end }}
{{- /* Browsers reach the admin UI over the Ingress's TLS: the cookie is marked Secure
      outright, whether or not the gateway trusts the controller's X-Forwarded-Proto. */}}
{{- if and .Values.gateway.ingress.enabled .Values.gateway.ingress.tls }}
- --secure-cookies
{{- end }}
- --usage-drain-timeout
- {{ .Values.gateway.usageDrainSeconds | quote }}
{{- include "loraplex.observabilityArgs" . }}
{{- range .Values.gateway.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* The proxies trusted for X-Forwarded-For (comma-separated; empty: none). null is
     automatic: the private ranges where a proxy stands in front (the Ingress, or the
     inference gateway of topology=pool), none where clients connect directly. */}}
{{- define "loraplex.forwardedAllowIps" -}}
{{- $ips := .Values.gateway.forwardedAllowIps }}
{{- if kindIs "invalid" $ips }}
{{- $ips = list }}
{{- if or .Values.gateway.ingress.enabled (include "loraplex.isPool" .) }}
{{- $ips = list "10.0.0.0/8" "172.16.0.0/12" "192.168.0.0/16" }}
{{- end }}
{{- end }}
{{- join "," $ips }}
{{- end }}

{{/* --forwarded-allow-ips for every pod that takes client traffic through a proxy: the
     client address (throttling, per-address caps) is the one the proxy saw. */}}
{{- define "loraplex.forwardedAllowIpsArgs" -}}
{{- with include "loraplex.forwardedAllowIps" . }}
- --forwarded-allow-ips
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* --log-format and --otlp-endpoint: the same on gateways and workers, so one request's
     lines read alike on both sides of the hop. */}}
{{- define "loraplex.observabilityArgs" -}}
{{- with .Values.observability }}
- --log-format
- {{ .logFormat | quote }}
{{- with .otlpEndpoint }}
- --otlp-endpoint
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* A Kubernetes quantity (123, 500M, 1.5Gi) as a number of bytes; empty for any other
     form (an exponent, milli), which the callers then leave unchecked. */}}
{{- define "loraplex.quantityBytes" -}}
{{- $q := toString . | trim }}
{{- $re := "^([0-9]+(?:\\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$" }}
{{- if regexMatch $re $q }}
{{- $units := dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "P" 1000000000000000 }}
{{- mulf (regexReplaceAll $re $q "${1}" | float64) (index $units (regexReplaceAll $re $q "${2}")) }}
{{- end }}
{{- end }}

{{/* The worker's --adapter-cache-size: below the cache volume's size, which also holds
     compiled kernels, or the kubelet evicts a worker whose adapters filled it. */}}
{{- define "loraplex.workerAdapterCacheSize" -}}
{{- $w := .Values.worker }}
{{- $_ := required "worker.adapterCacheSize is required: unbounded, fetched adapters would fill the cache volume" $w.adapterCacheSize }}
{{- $adapters := include "loraplex.quantityBytes" $w.adapterCacheSize }}
{{- $volume := include "loraplex.quantityBytes" $w.cacheSize }}
{{- if and $adapters $volume (ge (float64 $adapters) (float64 $volume)) }}
{{- fail (printf "worker.adapterCacheSize (%v) must be below worker.cacheSize (%v): the cache volume also holds compiled kernels, and a worker that fills it is evicted" $w.adapterCacheSize $w.cacheSize) }}
{{- end }}
{{- $w.adapterCacheSize }}
{{- end }}

{{/* `loraplex worker ...` arguments. */}}
{{- define "loraplex.workerArgs" -}}
{{- $c := include "loraplex.c" . | fromJson }}
- {{ $c.commands.worker }}
- --host
- 0.0.0.0
- --port
- {{ .Values.worker.port | quote }}
{{- /* The worker's own default is /metrics on --port; a metrics port listens on every
      address, behind the internal token like the internal API. */}}
{{- with .Values.worker.metricsPort }}
{{- if eq (int .) (int $.Values.worker.port) }}
{{- fail (printf "worker.metricsPort (%v) must differ from worker.port" .) }}
{{- end }}
- --metrics-host
- 0.0.0.0
- --metrics-port
- {{ . | quote }}
{{- end }}
- --model
- {{ .Values.model.path | quote }}
- --device
- {{ include "loraplex.workerDevice" . }}
{{- /* The database URL (and its password) reaches the worker as $LORAPLEX_DATABASE_URL only:
      an argument would show in `ps` and /proc/PID/cmdline. */}}
{{- if eq .Values.adapterStore.type "s3" }}
- --adapter-store
- {{ include "loraplex.adapterStoreUrl" . }}
{{- end }}
- --adapter-cache-size
- {{ include "loraplex.workerAdapterCacheSize" . | quote }}
{{- include "loraplex.engineArgs" . }}
{{- include "loraplex.observabilityArgs" . }}
{{- range .Values.worker.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{- define "loraplex.httpProbe" -}}
httpGet:
  path: {{ .path }}
  port: http
{{- with .probe }}
{{- toYaml . | nindent 0 }}
{{- end }}
{{- end }}
