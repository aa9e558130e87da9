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
{{- range $key, $flag := dict "maxModelLen" "--max-model-len" "maxNumSeqs" "--max-num-seqs" "tensorParallelSize" "--tensor-parallel-size" -}}
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
