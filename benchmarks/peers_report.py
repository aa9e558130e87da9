"""benchmarks/results/NAME.md and the PNG plots from the peer sweep's result JSON
(written by benchmarks/peers.py into results/NAME/), with the machine and a roofline.
Each figure is the median over the rounds a run was repeated in."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from best_of import best_seconds
from memory_roof import read_gbps

from pagellm.kernels import int8_matmul_available
from pagellm.platform import dtype_name, resolve_dtype, resolve_dtypes

PARAMETERS = 134.5e6  # SmolLM2-135M
KV_BLOCK_BYTES = 16 * 64 * 2  # SmolLM2's keys of one kv head in a bf16 block of 16 tokens
COLUMNS = (("output tok/s", "output_throughput"), ("TTFT p50 ms", "p50_ttft_ms"),
           ("TTFT p99 ms", "p99_ttft_ms"), ("ITL p50 ms", "p50_itl_ms"),
           ("ITL p99 ms", "p99_itl_ms"))
INTRO = ("`python benchmarks/peers.py`: the SmolLM2-135M-Instruct Q4_1 GGUF for every peer, "
         "`pagellm bench serve --backend openai --endpoint /v1/completions`, random prompts "
         "(same tokenizer; each run its own seed, the same for every peer), `--ignore-eos` "
         "(llama-cpp-python's server ignores that field, so its outputs may stop early at "
         "EOS; tok/s counts real tokens). "
         "Runs `cN`: `--max-concurrency N`; the rate run: Poisson arrivals, no cap on "
         "concurrency. One server at a time on this machine. The host is shared, so its speed "
         "drifts: by about 10% between runs, and single-stream ITL by up to 2x. Compare peers "
         "within one report; `rounds` > 1 means the sweep ran that many times in turn "
         "(`--repeat`) and each figure is the median over the rounds.")
DECODE_LOG_PREFIX = "pagellm-decode-steps-"
PAGELLM_ARGS_FILE = "pagellm-args.txt"  # the --pagellm-args of the last run
RUN_FILE = "run.json"  # the command, machine and date of the last run
STARTUP_INFIX = "-startup-"  # PEER-startup-ROUND.json: seconds from each start to ready
PREFILL_PREFIX = "prefill"  # the prefill run's label: prefillN, N prompt tokens
DECODE_LINE = re.compile(r"batch=(\d+)\] decode step: ([\d.]+) ms, ([\d.]+) output tokens/s"
                         r"(?:, reads ([\d.]+) MB)?")
PLOTS = (("output_throughput", "output tok/s", "output_throughput"),
         ("p99_ttft_ms", "TTFT p99 (ms)", "ttft_p99"),
         ("p99_itl_ms", "ITL p99 (ms)", "itl_p99"))


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def engine_numerics() -> str:
    """What `--dtype auto` picks for the embedded GGUF on this CPU: how its projections
    multiply, the rest's dtype and the KV cache's."""
    int8 = int8_matmul_available()
    compute, kv = resolve_dtypes("auto", "auto", torch.device("cpu"), int8)
    return (f"{'int8 projections, ' if int8 else ''}{dtype_name(compute)} activations, "
            f"{dtype_name(kv)} KV cache")


def peak_form() -> str:
    """The form whose matmul peak is this machine's roof: the projections' (int8 where the
    activations are rounded to int8, else the engine's dtype)."""
    if int8_matmul_available():
        return "int8"
    return dtype_name(resolve_dtype("auto", torch.device("cpu")))


def machine_kind() -> str:
    """The results file's name: the CPU feature that decides pagellm's kernels and dtype."""
    flags = next((line.split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    kind = next((name for flag, name in (("amx_tile", "amx"), ("avx512_bf16", "avx512-bf16"),
                                         ("avx512f", "avx512"), ("avx2", "avx2"))
                 if flag in flags), "cpu")
    return f"cpu-{kind}"


def save_run_record(peer_dir: Path, command: str) -> None:
    """What the report names: the command, the machine and the date of the runs (not of a
    later `--report-only`, which may run elsewhere)."""
    record = {"command": command, "machine": machine(),
              "date": time.strftime("%Y-%m-%d", time.gmtime())}
    (peer_dir / RUN_FILE).write_text(json.dumps(record, indent=1))


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    isa = torch.backends.cpu.get_cpu_capability()
    flags = next((line.split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    isa += " + AMX" if "amx_tile" in flags else ""
    return (f"{cpu}, {os.cpu_count()} cores, {isa}; pagellm: {engine_numerics()}; "
            f"Python {platform.python_version()}, "
            f"torch {torch.__version__}, transformers {version('transformers')}, "
            f"llama-cpp-python {version('llama-cpp-python')}")


def matmul_peak_gflops(n: int = 2048, tries: int = 5) -> float:
    """Best-of-`tries` GFLOP/s (GOP/s in int8) of one n x n matmul in `peak_form()`, by the
    libraries torch ships: this machine's roof. In int8, the x86 quantized engine's linear
    (FBGEMM's u8 x s8 kernels), or oneDNN's `torch._int_mm` where faster; on a CPU without
    VNNI or AMX the latter is a plain loop (2 GOP/s on a 2-core AVX2 EPYC, against the
    former's 220-320), so it is not timed there."""
    form = peak_form()
    if form != "int8":
        a, b = (torch.randn(n, n, dtype=getattr(torch, form)) for _ in range(2))
        return 2 * n**3 / best_seconds(lambda: torch.matmul(a, b), tries) / 1e9
    a, b = (torch.randint(-128, 128, (n, n), dtype=torch.int8) for _ in range(2))
    with warnings.catch_warnings():  # quantized tensors are deprecated, not gone
        warnings.simplefilter("ignore")
        x = torch.quantize_per_tensor(torch.rand(n, n), 1 / 255, 0, torch.quint8)
        weight = torch.quantize_per_tensor(torch.randn(n, n), 1 / 32, 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(weight, None)
    seconds = best_seconds(lambda: torch.ops.quantized.linear(x, packed, 1.0, 0), tries)
    if torch.cpu._is_vnni_supported():  # else a minute of the plain loop, for nothing
        seconds = min(seconds, best_seconds(lambda: torch._int_mm(a, b), tries))
    return 2 * n**3 / seconds / 1e9


def decode_log_name(round_number: int) -> str:
    return f"{DECODE_LOG_PREFIX}{round_number}.log"


def load(peer_dir: Path, peer: str, run: str) -> dict[str, Any] | None:
    """One run's result: each column's median over its rounds, failures summed."""
    paths = sorted(peer_dir.glob(f"{peer}-{run}-*.json"))
    rounds = [json.loads(path.read_text()) for path in paths]
    if not rounds:
        return None
    combined = {key: statistics.median(r.get(key, float("nan")) for r in rounds)
                for _, key in COLUMNS}
    return {**combined, "num_prompts": rounds[0]["num_prompts"], "rounds": len(rounds),
            "failed": sum(r["failed"] for r in rounds)}


def table(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    head = ["peer", "run", "rounds", "prompts", *(label for label, _ in COLUMNS), "failed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for peer, runs in results.items():
        for run, result in runs.items():
            cells = [peer, run, str(result["rounds"]), str(result["num_prompts"]),
                     *(f"{result.get(key, float('nan')):.1f}" for _, key in COLUMNS),
                     str(result["failed"])]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(results: dict[str, dict[str, dict[str, Any]]], concurrency: list[int],
         out_dir: Path, name: str) -> list[str]:
    """One PNG per metric against concurrency (log-2 axis); their file names."""
    filenames = []
    for key, label, suffix in PLOTS:
        filename = f"{name}_{suffix}.png"
        filenames.append(filename)
        fig, ax = plt.subplots(figsize=(6, 4))
        for peer, runs in results.items():
            points = [(c, runs[f"c{c}"][key]) for c in concurrency if f"c{c}" in runs]
            if points:
                ax.plot(*zip(*points), marker="o", label=peer)
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrency, [str(c) for c in concurrency])
        ax.set(xlabel="max concurrency", ylabel=label, title=f"{label} vs concurrency")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / filename, dpi=120)
        plt.close(fig)
    return filenames


def save_peak(peer_dir: Path, round_number: int) -> None:
    """Measure the matmul and memory roofs on the idle machine, before the round's servers,
    for the report."""
    (peer_dir / f"matmul_peak-{round_number}.json").write_text(json.dumps(
        {"gflops": matmul_peak_gflops(), "read_gbps": read_gbps(),
         "scattered_read_gbps": read_gbps(chunk_bytes=KV_BLOCK_BYTES)}))


def decode_steps(peer_dir: Path) -> list[tuple[int, float, float, float | None]]:
    """(batch, ms per step, output tok/s, MB read per step or None) from `pagellm bench
    throughput --decode-steps`, the median step over the rounds."""
    steps: dict[int, list[float]] = {}
    reads: dict[int, float] = {}
    for path in sorted(peer_dir.glob(f"{DECODE_LOG_PREFIX}*.log")):
        for match in DECODE_LINE.finditer(path.read_text()):
            steps.setdefault(int(match[1]), []).append(float(match[2]))
            if match[4] is not None:
                reads[int(match[1])] = float(match[4])
    return [(batch, statistics.median(ms), batch * 1000 / statistics.median(ms), reads.get(batch))
            for batch, ms in sorted(steps.items())]


def roofline(peer_dir: Path, results: dict[str, dict[str, dict[str, Any]]], top: int) -> list[str]:
    saved = [json.loads(path.read_text()) for path in peer_dir.glob("matmul_peak-*.json")]
    peak = max(s["gflops"] for s in saved) if saved else matmul_peak_gflops()
    bandwidths = [s["read_gbps"] for s in saved if "read_gbps" in s]
    scattered = [s["scattered_read_gbps"] for s in saved if "scattered_read_gbps" in s]
    lines = [f"Roofline: {peak_form()} 2048x2048 matmul peak {peak:.1f} GFLOP/s (idle machine, "
             "best of 5 in each round, the form of pagellm's projections on this CPU); "
             f"achieved = 2 x {PARAMETERS / 1e6:.1f}M params x output tok/s.", ""]
    run = results.get("pagellm", {}).get(f"c{top}")
    if run is not None:
        lines.append(_roof_line(f"serving, concurrency {top} (prefill included)",
                                run["output_throughput"], peak))
    steps = decode_steps(peer_dir)
    for batch, ms, tokens, _ in steps:
        lines.append(_roof_line(f"batched decode, batch {batch} ({ms:.1f} ms per step)",
                                tokens, peak))
    read = [(batch, ms, mb) for batch, ms, _, mb in steps if mb is not None]
    if bandwidths and read:
        bandwidth = max(bandwidths)
        blocks = (f", {max(scattered):.1f} GB/s over {KV_BLOCK_BYTES} B chunks in random "
                  "order, as a long-running server's KV blocks lie" if scattered else "")
        lines += ["", f"Memory roof: {bandwidth:.1f} GB/s read in order{blocks} (512 MiB read "
                  "with vector loads, `benchmarks/memory_roof.py`, best of 5 in each round); a "
                  "decode step reads the weights in the forms it multiplies and every "
                  "request's keys and values."]
        lines += [f"- pagellm batched decode, batch {batch}: {mb:.0f} MB per step = "
                  f"{mb / ms:.1f} GB/s, {100 * mb / ms / bandwidth:.1f}% of the memory roof"
                  for batch, ms, mb in read]
    return lines


def _roof_line(label: str, tokens_per_second: float, peak: float) -> str:
    achieved = 2 * PARAMETERS * tokens_per_second / 1e9
    return (f"- pagellm {label}: {tokens_per_second:.1f} tok/s = {achieved:.1f} GFLOP/s, "
            f"{100 * achieved / peak:.1f}% of peak")


def startup_lines(peer_dir: Path, peers: list[str]) -> list[str]:
    """Each peer's median time from start to ready over every start of the sweep."""
    lines = []
    for peer in peers:
        starts = [seconds for path in sorted(peer_dir.glob(f"{peer}{STARTUP_INFIX}*.json"))
                  for seconds in json.loads(path.read_text())]
        if starts:
            lines.append(f"- {peer}: start to ready {statistics.median(starts):.1f} s "
                         f"(median of {len(starts)} starts)")
    return lines


def prefill_lines(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Prompt tokens per second of each peer's prefill run, from its median TTFT."""
    lines = []
    for peer, runs in results.items():
        for label, result in runs.items():
            if label.startswith(PREFILL_PREFIX):
                tokens = int(label.removeprefix(PREFILL_PREFIX))
                lines.append(f"- {peer}: prefill of {tokens} tokens at "
                             f"{tokens * 1000 / result['p50_ttft_ms']:.0f} tok/s")
    return lines


def write_report(peer_dir: Path, peers: list[str], concurrency: list[int], runs: list[str],
                 skipped: dict[str, str], caps: dict[str, int]) -> None:
    """Collect the saved runs, print and write NAME.md beside NAME/, draw the plots."""
    results = {peer: {run: r for run in runs if (r := load(peer_dir, peer, run))}
               for peer in peers}
    results = {peer: found for peer, found in results.items() if found}
    roof = roofline(peer_dir, results, max(concurrency))
    prefill, startup = prefill_lines(results), startup_lines(peer_dir, peers)
    pngs = plot(results, concurrency, peer_dir.parent, peer_dir.name)
    notes = [f"- `{peer}` skipped: {reason}" for peer, reason in skipped.items()]
    notes += [f"- `{peer}` capped at {n} prompts per run" for peer, n in caps.items()]
    args_file = peer_dir / PAGELLM_ARGS_FILE
    pagellm_args = args_file.read_text().strip() if args_file.exists() else ""
    if pagellm_args:
        notes.append(f"- `pagellm` started with `{pagellm_args}`")
    run = json.loads((peer_dir / RUN_FILE).read_text())
    lines = ["# Serving peers side by side", "",
             INTRO, "", f"Command: `{run['command']}`", "", f"Machine: {run['machine']}", "",
             f"Date: {run['date']}", "", *notes, "", *table(results), "", *prefill, *startup,
             "", *roof, "", *(f"![{png}]({png})" for png in pngs), ""]
    (peer_dir.parent / f"{peer_dir.name}.md").write_text("\n".join(lines))
    print("\n".join(table(results)), *prefill, *startup, *roof, sep="\n")
