{{/* Labels every object of the release carries. */}}
{{- define "pagellm.labels" -}}
app.kubernetes.io/name: pagellm
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The name of one modelSpec's objects: <release>-<model name>, a DNS label. */}}
{{- define "pagellm.engineName" -}}
{{- printf "%s-%s" .root.Release.Name .model.name | trunc 63 | trimSuffix "-" -}}
{{- end }}

{{/* What tells a modelSpec's objects from the release's others. */}}
{{- define "pagellm.modelLabels" -}}
app.kubernetes.io/component: engine
pagellm.dev/model: {{ .model.name }}
{{- end }}

{{/* The pod labels a modelSpec's Service selects. */}}
{{- define "pagellm.selectorLabels" -}}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{ include "pagellm.modelLabels" . }}
{{- end }}

{{/*
`pagellm serve` arguments of a modelSpec, as a YAML list. The image's entrypoint is
`pagellm serve --host 0.0.0.0`; vllmConfig keys become vLLM's flags, which pagellm shares.
*/}}
{{- define "pagellm.engineArgs" -}}
{{- $m := .model -}}
{{- $config := $m.vllmConfig | default dict -}}
{{- $args := list -}}
{{- with $m.modelURL }}{{ $args = append $args . }}{{ end -}}
{{- $args = concat $args (list "--port" (toString .root.Values.servingEngineSpec.containerPort) "--served-model-name" $m.name) -}}
{{- range $key, $flag := dict "maxModelLen" "--max-model-len" "maxNumSeqs" "--max-num-seqs" "tensorParallelSize" "--tensor-parallel-size" "pipelineParallelSize" "--pipeline-parallel-size" -}}
{{- if hasKey $config $key }}{{ $args = concat $args (list $flag (toString (int (get $config $key)))) }}{{ end -}}
{{- end -}}
{{- range $key, $flag := dict "dtype" "--dtype" "gpuMemoryUtilization" "--gpu-memory-utilization" -}}
{{- if hasKey $config $key }}{{ $args = concat $args (list $flag (toString (get $config $key))) }}{{ end -}}
{{- end -}}
{{- if hasKey $config "enablePrefixCaching" -}}
{{- $args = append $args (ternary "--enable-prefix-caching" "--no-enable-prefix-caching" $config.enablePrefixCaching) -}}
{{- end -}}
{{- with $m.lmcacheConfig }}{{ if .enabled -}}
{{- $args = concat $args (list "--kv-offloading-size" (toString .cpuOffloadingBufferSize)) -}}
{{- end }}{{ end -}}
{{- $args = concat $args ($config.extraArgs | default list) -}}
{{- toYaml $args -}}
{{- end }}

{{/* The Secret and key holding the API key, or nothing. */}}
{{- define "pagellm.apiKeyRef" -}}
{{- $key := .Values.servingEngineSpec.vllmApiKey -}}
{{- if kindIs "string" $key -}}
name: {{ printf "%s-secrets" .Release.Name }}
key: apiKey
{{- else if $key -}}
name: {{ $key.secretName }}
key: {{ $key.secretKey }}
{{- end -}}
{{- end }}

{{/* A modelSpec's volume mounts (the model PVC at /data, /dev/shm, extras), or nothing. */}}
{{- define "pagellm.volumeMounts" -}}
{{- if or .pvcStorage .shmSize .extraVolumeMounts -}}
volumeMounts:
  {{- if .pvcStorage }}
  - name: models
    mountPath: /data
  {{- end }}
  {{- if .shmSize }}
  - name: shm
    mountPath: /dev/shm
  {{- end }}
  {{- with .extraVolumeMounts }}{{ toYaml . | nindent 2 }}{{ end }}
{{- end }}
{{- end }}

{{/* The pod volumes behind pagellm.volumeMounts. */}}
{{- define "pagellm.volumes" -}}
{{- $m := .model -}}
{{- if or $m.pvcStorage $m.shmSize $m.extraVolumes -}}
volumes:
  {{- if $m.pvcStorage }}
  - name: models
    persistentVolumeClaim:
      claimName: {{ include "pagellm.engineName" . }}-storage-claim
  {{- end }}
  {{- if $m.shmSize }}
  - name: shm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $m.shmSize }}
  {{- end }}
  {{- with $m.extraVolumes }}{{ toYaml . | nindent 2 }}{{ end }}
{{- end }}
{{- end }}

{{/* Requests and limits from production-stack's requestCPU/requestMemory/requestGPU/
requestGPUType/limitCPU/limitMemory keys (a modelSpec, or raySpec.headNode). */}}
{{- define "pagellm.resources" -}}
requests:
  cpu: {{ .requestCPU | quote }}
  memory: {{ .requestMemory | quote }}
  {{- if .requestGPU }}
  {{ .requestGPUType | default "nvidia.com/gpu" }}: {{ .requestGPU | quote }}
  {{- end }}
{{- if or .limitCPU .limitMemory .requestGPU }}
limits:
  {{- with .limitCPU }}
  cpu: {{ . | quote }}
  {{- end }}
  {{- with .limitMemory }}
  memory: {{ . | quote }}
  {{- end }}
  {{- if .requestGPU }}
  {{ .requestGPUType | default "nvidia.com/gpu" }}: {{ .requestGPU | quote }}
  {{- end }}
{{- end }}
{{- end }}
