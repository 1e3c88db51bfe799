{{/* The engine's knobs (worker.engine), the same for a fleet's workers and a pool's
     `serve` replicas; a null knob leaves the engine's default. */}}
{{- define "loraplex.engineArgs" -}}
{{- $e := .Values.worker.engine }}
{{- with $e.dtype }}
- --dtype
- {{ . }}
{{- end }}
{{- range $flag, $v := dict "--threads" $e.threads "--max-num-seqs" $e.maxNumSeqs "--max-num-batched-tokens" $e.maxNumBatchedTokens "--max-model-len" $e.maxModelLen "--max-loras" $e.maxLoras "--max-lora-rank" $e.maxLoraRank }}
{{- if not (kindIs "invalid" $v) }}
- {{ $flag }}
- {{ $v | quote }}
{{- end }}
{{- end }}
{{- with $e.speculativeConfig }}
- --speculative-config
- {{ toJson . | quote }}
{{- end }}
{{- if and (not $.Values.cpuOnly) (ne (include "loraplex.workerDevice" $) "cpu") (not (kindIs "invalid" $e.gpuMemoryUtilization)) }}
- --gpu-memory-utilization
- {{ $e.gpuMemoryUtilization | quote }}
{{- end }}
{{- end }}

{{- define "loraplex.poolName" -}}{{ include "loraplex.fullname" . | trunc 48 | trimSuffix "-" }}-pool{{- end }}

{{/* "true" in the pool topology (serve replicas behind an InferencePool). */}}
{{- define "loraplex.isPool" -}}
{{- if eq .Values.topology "pool" }}true{{ end }}
{{- end }}

{{/* `loraplex serve ...` arguments of a pool member: the OpenAI API, the admin API and
     /metrics all on one port (the InferencePool's target port, which the endpoint picker
     scrapes), the database from the environment, no demo tenant. */}}
{{- define "loraplex.poolArgs" -}}
{{- $c := include "loraplex.c" . | fromJson }}
{{- $p := .Values.pool }}
- {{ $c.commands.serve }}
- --host
- 0.0.0.0
- --port
- {{ $p.port | quote }}
- --metrics-port
- "0"
{{- include "loraplex.forwardedAllowIpsArgs" . }}
- --model
- {{ .Values.model.path | quote }}
{{- with $p.servedModelName }}
- --served-model-name
- {{ . | quote }}
{{- end }}
- --device
- {{ include "loraplex.workerDevice" . }}
- --no-demo
- --data-dir
- /var/cache/loraplex/data
{{- if eq .Values.adapterStore.type "s3" }}
- --adapter-store
- {{ include "loraplex.adapterStoreUrl" . }}
{{- end }}
- --adapter-cache-size
- {{ include "loraplex.workerAdapterCacheSize" . | quote }}
{{- include "loraplex.engineArgs" . }}
{{- include "loraplex.observabilityArgs" . }}
{{- range $p.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
