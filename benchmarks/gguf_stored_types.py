"""Memory and decode speed of a GGUF whose matrices of `--types` (default Q5_0, Q5_1 and
Q6_K) are kept as stored, against the same file with those matrices dequantized to float at
load (what pagellm did before it read them; Gemma 3 270M Q4_K_M holds 81 Q5_0 tensors, most
of its projections, and 9 Q6_K ones, ffn_down of 9 layers).

Each configuration loads in its own process (its own resident memory, its own empty cache of
prepared weights), as the engine loads a GGUF by default (batch-invariant, int8
activations), then times decode steps of `--batch` requests over a 32-token prompt each.

    python benchmarks/gguf_stored_types.py [--model gemma-3-270m] [--types Q6_K]
                                           [--batch 1 8] [--steps 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_models import PagedCache  # noqa: E402

from pagellm.model import gguf_weights  # noqa: E402
from pagellm.model.loader import load_model  # noqa: E402

_DEFAULT_TYPES = ["Q5_0", "Q5_1", "Q6_K"]


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(model: str, mode: str, types: list[str], batches: list[int], steps: int,
            dtype: str) -> dict:
    if mode == "dequantized":
        for kind in types:
            gguf_weights._GROUP_READERS.pop(gguf.GGMLQuantizationType[kind])
    loaded = load_model(model, getattr(torch, dtype), torch.device("cpu"),
                        gguf_quantized_max_tokens=None, gguf_int8_activations=True,
                        batch_invariant=True)
    result = {"mode": mode, "weights_mib": loaded.model.weight_bytes() / 2**20,
              "rss_after_load_mib": resident_mib(), "ms_per_step": {}}
    for batch in batches:
        cache = PagedCache(loaded.arch, getattr(torch, dtype), num_blocks=8 * batch + 8,
                           block_size=16)
        logits = cache.step(loaded.model, [(i, list(range(100 + i, 132 + i)))
                                           for i in range(batch)])
        tokens = logits.argmax(-1).tolist()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            logits = cache.step(loaded.model, [(i, [t]) for i, t in enumerate(tokens)])
            times.append(time.perf_counter() - start)
            tokens = logits.argmax(-1).tolist()
        result["ms_per_step"][batch] = 1000 * statistics.median(times)
    result["rss_after_decode_mib"] = resident_mib()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--types", nargs="+", default=_DEFAULT_TYPES,
                        choices=["Q5_0", "Q5_1", "Q6_K", "Q8_K"],
                        help="the types dequantized in the 'dequantized' row")
    parser.add_argument("--mode", choices=["stored", "dequantized"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:  # one configuration, in this process
        print(json.dumps(measure(args.model, args.mode, args.types, args.batch, args.steps,
                                 args.dtype)))
        return
    rows = []
    for mode in ("dequantized", "stored"):
        with tempfile.TemporaryDirectory() as cache:
            command = [sys.executable, __file__, "--mode", mode, "--model", args.model,
                       "--steps", str(args.steps), "--dtype", args.dtype,
                       "--types", *args.types,
                       "--batch", *map(str, args.batch)]
            env = {**os.environ, "PAGELLM_CACHE_DIR": cache}
            out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.model}, {args.dtype}, median decode step over {args.steps} steps")
    print(f"{'/'.join(args.types):<12} {'weights MiB':>12} {'RSS load MiB':>13} "
          f"{'RSS end MiB':>12}  "
          + "  ".join(f"{f'ms/step b={b}':>13}" for b in args.batch))
    for row in rows:
        print(f"{row['mode']:<12} {row['weights_mib']:>12.1f} {row['rss_after_load_mib']:>13.0f} "
              f"{row['rss_after_decode_mib']:>12.0f}  "
              + "  ".join(f"{row['ms_per_step'][str(b)]:>13.2f}" for b in args.batch))


if __name__ == "__main__":
    main()
