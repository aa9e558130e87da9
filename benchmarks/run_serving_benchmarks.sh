#!/usr/bin/env bash
set -ex
# The serving benchmarks of the closing notes, one server at a time (about 15 minutes on 2 cores).
cd "$(dirname "$0")/.."
P=benchmarks/serve_compare.py
python3 $P --name streams32 --server "--max-num-seqs 64" --bench "--backend openai-chat --dataset-name random --random-input-len 128 --random-output-len 64 --num-prompts 64 --max-concurrency 32 --ignore-eos --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99"
PR="--dataset-name prefix-repetition --prefix-repetition-prefix-len 1000 --prefix-repetition-suffix-len 32 --prefix-repetition-num-prefixes 1 --prefix-repetition-output-len 16 --num-prompts 50 --max-concurrency 4 --ignore-eos --metric-percentiles 50,99"
python3 $P --name prefix-on --server "--max-model-len 2048" --bench "$PR"
python3 $P --name prefix-off --server "--max-model-len 2048 --no-enable-prefix-caching" --bench "$PR"
KV="--dataset-name random --random-input-len 512 --random-output-len 128 --num-prompts 128 --max-concurrency 64 --ignore-eos --metric-percentiles 50,99"
python3 $P --name pressure-tier2 --server "--max-model-len 1024 --num-gpu-blocks-override 320 --kv-offloading-size 1" --bench "$KV"
python3 $P --name pressure-no-tier2 --server "--max-model-len 1024 --num-gpu-blocks-override 320" --bench "$KV"
