#!/bin/sh
# The image's entrypoint: `pagellm serve` with the arguments given to the container, exactly
# as vLLM's image runs `vllm serve` with them, e.g.
#   docker run -p 8000:8000 pagellm:cpu --served-model-name ministral --max-model-len 4096
# In a container the server must listen on every interface, not pagellm's default 127.0.0.1;
# a --host among the arguments still wins (argparse keeps the last one).
set -eu
exec pagellm serve --host "${PAGELLM_HOST:-0.0.0.0}" "$@"
