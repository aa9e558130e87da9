#!/bin/bash
# pagellm-ray-worker HEAD:PORT: a worker node of a multi-node pagellm on Ray. It waits until
# the head's GCS answers, then joins it and blocks; the head places pagellm's ranks here.
#   NODE_CPUS  CPUs this node gives Ray (default: nproc), the same on every node
#   PAGELLM_RAY_WAIT_SECONDS  how long the head may take to come up (default 600)
set -euo pipefail
head="${1:?usage: pagellm-ray-worker HEAD:PORT}"
wait_seconds="${PAGELLM_RAY_WAIT_SECONDS:-600}"
SECONDS=0
until ray health-check --address="${head}" >/dev/null 2>&1; do
  if (( SECONDS >= wait_seconds )); then
    echo "pagellm-ray-worker: no Ray head at ${head} after ${wait_seconds} s" >&2
    exit 1
  fi
  echo "pagellm-ray-worker: waiting for the Ray head at ${head} (${SECONDS} s)"
  sleep 5
done
echo "pagellm-ray-worker: joining the Ray head at ${head}"
exec ray start --address="${head}" --num-cpus="${NODE_CPUS:-$(nproc)}" --block
