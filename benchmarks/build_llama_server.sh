#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` (parallel slots, continuous batching) for the peers'
# harness, from the llama.cpp sources vendored in PyPI's llama-cpp-python sdist.
# Benchmark-only: nothing of it is a dependency of pagellm or lands in the repository.
#   bash benchmarks/build_llama_server.sh          # prints the binary's path at the end
# The binary goes to $PAGELLM_CACHE_DIR/llama-server (default ~/.cache/pagellm/llama-server);
# benchmarks/peers.py finds it there, or takes --llama-server PATH.
# llama.cpp's AMX backend is turned off: on Sapphire Rapids it crashes in its first matmul
# (llama.cpp issue #20824), and the comparison must not depend on which CPU ran it. The
# GGML_AMX_* options alone do not do it: with GGML_NATIVE, -march=native turns the AMX
# instruction sets on and ggml compiles its AMX backend in (a segfault at load, seen on a
# Xeon with AMX), so the compiler is also told -mno-amx-*, which GCC honours whatever the
# -march.
set -euo pipefail
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
out="${PAGELLM_CACHE_DIR:-$HOME/.cache/pagellm}/llama-server"
work="$(mktemp -d)"
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==${version}" -d "$work"
tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
cmake --build "$work/build" --target llama-server -j "$(nproc)"
mkdir -p "$out"
install -m 755 "$work/build/bin/llama-server" "$out/llama-server"
echo "$version" > "$out/VERSION"
echo "$out/llama-server"
