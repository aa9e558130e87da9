#!/bin/bash
# pagellm-ray-head ARGS...: the head node of a multi-node pagellm on Ray. It starts the Ray
# head, waits until the cluster holds the expected nodes, then runs `pagellm serve ARGS` (which
# should carry --distributed-executor-backend ray): rank 0 in this pod's engine core, every
# other rank a Ray actor on a node Ray places it on.
#   TENSOR_PARALLEL_SIZE, PIPELINE_PARALLEL_SIZE  the layout (KServe injects both)
#   RAY_NODE_COUNT        nodes to wait for, this one included (default: the pipeline size)
#   NODE_CPUS             CPUs each node gives Ray (default: nproc); every node gives the same
#   RAY_PORT              the head's GCS port (default 6379)
#   PAGELLM_RAY_WAIT_SECONDS  how long the other nodes may take to join (default 600)
# pagellm's ranks are CPU ranks: each asks for its share of a node's CPUs, so the ranks spread
# evenly over the nodes.
set -euo pipefail
tensor="${TENSOR_PARALLEL_SIZE:-1}"
pipeline="${PIPELINE_PARALLEL_SIZE:-1}"
nodes="${RAY_NODE_COUNT:-$pipeline}"
cpus="${NODE_CPUS:-$(nproc)}"
wait_seconds="${PAGELLM_RAY_WAIT_SECONDS:-600}"
port="${RAY_PORT:-6379}"
world=$((tensor * pipeline))
if (( world % nodes != 0 || cpus * nodes < world )); then
  echo "pagellm-ray-head: ${world} ranks do not share out over ${nodes} nodes of ${cpus} CPUs" >&2
  exit 1
fi
export PAGELLM_RAY_CPUS_PER_RANK=$((cpus * nodes / world))
export RAY_ADDRESS="127.0.0.1:${port}"

ray start --head --port="${port}" --num-cpus="${cpus}" --disable-usage-stats \
  --include-dashboard=false
joined() { ray status --address="${RAY_ADDRESS}" 2>/dev/null | grep -c ' node_' || true; }
SECONDS=0
until (( $(joined) >= nodes )); do
  if (( SECONDS >= wait_seconds )); then
    echo "pagellm-ray-head: only $(joined) of ${nodes} Ray nodes joined in ${wait_seconds} s" >&2
    exit 1
  fi
  echo "pagellm-ray-head: waiting for ${nodes} Ray nodes, $(joined) joined (${SECONDS} s)"
  sleep 5
done
echo "pagellm-ray-head: ${nodes} Ray nodes joined; ${world} ranks of" \
  "${PAGELLM_RAY_CPUS_PER_RANK} CPUs"
exec pagellm serve --host "${PAGELLM_HOST:-0.0.0.0}" "$@"
