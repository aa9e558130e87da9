"""Side-by-side serving benchmark of pagellm against its peers on this machine.

One server at a time: start a peer, wait for it, run the same `pagellm bench serve` sweep
(completions endpoint, identical random prompts tokenized with the GGUF's tokenizer: one
run per `--concurrency` with num-prompts = max(8, 2 x concurrency), then one
`--request-rate` run), stop it, move on. For pagellm, then also time batched decode steps
offline (`pagellm bench throughput --decode-steps`). The matmul peak, in the dtype
pagellm picks on this CPU, is measured first, on the idle machine. Then write
benchmarks/results/NAME.md and plots, NAME being this machine's kind (`cpu-amx`,
`cpu-avx512-bf16`, `cpu-avx2`): the latest results for each kind of machine, which a new
run replaces (git keeps the old ones).

Peers: `pagellm` (the embedded SmolLM2-135M Q4_1 GGUF), `llama-server` (llama.cpp's own
server on the same GGUF, restarted for each run with as many parallel slots as clients,
`-np N -c N x slot context -t 2`; build it once with `bash benchmarks/build_llama_server.sh`,
skipped when absent), `llamacpp` (llama-cpp-python's OpenAI server, one sequence at a time;
skipped when not installed) and `naive` (transformers + FastAPI, one generate() at a time:
benchmarks/naive_server.py). The peers are benchmark-only: `pip install -e ".[bench]"`
(llama-cpp-python compiles ~8 min). On a CPU with AMX (Sapphire Rapids and later), that
build's AMX backend crashes in its first matmul (segfault in ggml_backend_amx_mul_mat,
llama.cpp issue #20824); build it with every other instruction set of the CPU instead
(the llama-server script does so), for example:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \
      -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" \
      pip install --force-reinstall --no-deps "llama-cpp-python[server]==0.3.36"

Besides the concurrency sweep, each peer gets a prefill run (`--prefill-len` tokens in, one
out, one client: prefill tok/s = prompt length / TTFT), and the time from its start to
ready is recorded for every start.

The naive server runs requests one after another, so at concurrency 64 the default 128
prompts would take most of an hour: cap a peer's num-prompts with `--max-prompts
naive=16` (the cap applies to every run of that peer, the rate run included).

The host's speed can drift by 10-50% over minutes, so `--repeat N` runs the whole peer
loop N times in rounds (pagellm, llamacpp, naive, then again), and the report gives each
figure's median over the rounds; `--name` keeps an experiment's files apart from the
machine's results:

    python benchmarks/peers.py --repeat 3 --concurrency 1 64 --request-rate 0 \
        --max-prompts naive=16 --max-prompts llamacpp=32   # the figures docs/benchmarks.md quotes
    python benchmarks/peers.py --report-only        # redo NAME.md and the plots
    python benchmarks/peers.py --name kv-bf16 --repeat 3 --concurrency 1 64 \
        --request-rate 0 --max-prompts naive=16 --pagellm-args "--kv-cache-dtype bfloat16"
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from peers_report import (PAGELLM_ARGS_FILE, STARTUP_INFIX, decode_log_name, machine_kind,
                          save_peak, save_run_record, write_report)
from serve_compare import RESULTS, bench, free_port, serving

from pagellm.model.paths import default_model_path

NAIVE_SERVER = Path(__file__).parent / "naive_server.py"


LLAMA_SERVER = (Path(os.environ.get("PAGELLM_CACHE_DIR", Path.home() / ".cache" / "pagellm"))
                / "llama-server" / "llama-server")  # where build_llama_server.sh puts it


@dataclass(frozen=True)
class ServerShape:
    """What a server is started for: its port, the GGUF, and (for servers with a fixed
    number of slots) how many clients of how many tokens each it must hold."""

    port: int
    gguf: Path
    slots: int
    slot_context: int


def pagellm_argv(shape: ServerShape) -> list[str]:
    return [sys.executable, "-m", "pagellm.entrypoints.cli", "serve",
            "--port", str(shape.port), "--disable-log-requests"]  # no model: the same GGUF


def llama_server_argv(shape: ServerShape) -> list[str]:
    return [str(LLAMA_SERVER), "--model", str(shape.gguf), "--host", "127.0.0.1",
            "--port", str(shape.port), "--threads", "2", "--parallel", str(shape.slots),
            "--ctx-size", str(shape.slots * shape.slot_context), "--no-webui"]


def llamacpp_argv(shape: ServerShape) -> list[str]:
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(shape.gguf),
            "--n_threads", "2", "--interrupt_requests", "False", "--port", str(shape.port),
            "--n_ctx", "8192"]


def naive_argv(shape: ServerShape) -> list[str]:
    return [sys.executable, str(NAIVE_SERVER), "--port", str(shape.port)]  # the same GGUF


def module_missing(module: str) -> Callable[[], str | None]:
    def missing() -> str | None:
        if importlib.util.find_spec(module) is None:
            return f"`{module}` is not installed (pip install -e '.[bench]')"
        return None
    return missing


def llama_server_missing() -> str | None:
    if not LLAMA_SERVER.exists():
        return f"{LLAMA_SERVER} is not built (bash benchmarks/build_llama_server.sh)"
    return None


@dataclass(frozen=True)
class Peer:
    name: str
    argv: Callable[[ServerShape], list[str]]  # the server command
    missing: Callable[[], str | None]  # why this peer cannot run here, or None
    ready_path: str
    slots_per_run: bool = False  # restarted for each run, sized to its clients


PEERS = {peer.name: peer for peer in (
    Peer("pagellm", pagellm_argv, module_missing("pagellm"), "/health"),
    Peer("llama-server", llama_server_argv, llama_server_missing, "/health",
         slots_per_run=True),
    Peer("llamacpp", llamacpp_argv, module_missing("llama_cpp"), "/v1/models"),  # no /health
    Peer("naive", naive_argv, module_missing("transformers"), "/health"),
)}


def result_name(peer: str, run: str, round_number: int) -> str:
    return f"{peer}-{run}-{round_number}.json"


@dataclass(frozen=True)
class Run:
    label: str
    flags: list[str]  # for pagellm bench serve, after the common ones
    clients: int  # the most requests in flight at once
    tokens_per_client: int


def sweep(args: argparse.Namespace, cap: int | None) -> list[Run]:
    """Every run of one peer."""
    def prompts(n: int) -> list[str]:
        return ["--num-prompts", str(min(n, cap) if cap else n)]
    tokens = args.input_len + args.output_len + 64
    runs = [Run(f"c{c}", ["--max-concurrency", str(c), *prompts(max(8, 2 * c))], c, tokens)
            for c in args.concurrency]
    if args.request_rate > 0:
        runs.append(Run(rate_run(args), ["--request-rate", str(args.request_rate),
                                         *prompts(args.rate_prompts)],
                        max(args.concurrency), tokens))
    if args.prefill_len > 0:
        runs.append(Run(prefill_run(args), ["--max-concurrency", "1", "--random-input-len",
                                            str(args.prefill_len), "--random-output-len", "1",
                                            *prompts(4)], 1, args.prefill_len + 64))
    # Each run draws its own prompts: with one seed, runs of as many prompts (c1 and c4) sent
    # the same ones, and a server that keeps its prefix cache across the sweep answered the
    # second run from it, where a peer restarted per run computed it again.
    return [replace(run, flags=[*run.flags, "--seed", str(index)])
            for index, run in enumerate(runs)]


def rate_run(args: argparse.Namespace) -> str:
    return f"rate{args.request_rate:g}"


def prefill_run(args: argparse.Namespace) -> str:
    return f"prefill{args.prefill_len}"


def run_labels(args: argparse.Namespace) -> list[str]:
    return [run.label for run in sweep(args, None)]


def run_peer(peer: Peer, args: argparse.Namespace, gguf: Path, cap: int | None,
             peer_dir: Path, round_number: int) -> None:
    common = ["--backend", "openai", "--endpoint", "/v1/completions", "--tokenizer", str(gguf),
              "--dataset-name", "random", "--random-input-len", str(args.input_len),
              "--random-output-len", str(args.output_len), "--ignore-eos",
              "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    runs = sweep(args, cap)
    # one server for the whole sweep, sized for its largest run, unless it has fixed slots
    groups = [[run] for run in runs] if peer.slots_per_run else [runs]
    for group in groups:
        shape = ServerShape(free_port(), gguf, max(r.clients for r in group),
                            max(r.tokens_per_client for r in group))
        extra = shlex.split(args.pagellm_args) if peer.name == "pagellm" else []
        start = time.perf_counter()
        with serving([*peer.argv(shape), *extra], shape.port,
                     peer_dir / f"{peer.name}.server.log", peer.ready_path) as url:
            record_startup(peer_dir, peer.name, round_number, time.perf_counter() - start)
            for run in group:
                print(f"[{peer.name}] round {round_number} {run.label}: {' '.join(run.flags)}",
                      flush=True)
                bench(url, peer_dir, result_name(peer.name, run.label, round_number),
                      [*common, *run.flags])


def record_startup(peer_dir: Path, peer: str, round_number: int, seconds: float) -> None:
    """Seconds from a start to ready, appended to the round's list for this peer."""
    path = peer_dir / f"{peer}{STARTUP_INFIX}{round_number}.json"
    starts = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps([*starts, seconds]))


def run_decode_steps(args: argparse.Namespace, peer_dir: Path, round_number: int) -> None:
    """pagellm's batched decode alone (offline, no server): the roofline's decode figures."""
    batch_sizes = args.decode_batch_sizes
    argv = [sys.executable, "-m", "pagellm.entrypoints.cli", "bench", "throughput",
            "--input-len", "128", "--output-len", "8", "--batch-sizes", batch_sizes,
            "--decode-steps", "10", *shlex.split(args.pagellm_args)]
    print(f"[pagellm] decode steps at batch {batch_sizes}", flush=True)
    with open(peer_dir / decode_log_name(round_number), "w") as log:
        subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=True)


def parse_caps(values: list[str]) -> dict[str, int]:
    caps: dict[str, int] = {}
    for value in values:
        name, _, number = value.partition("=")
        if name not in PEERS or not number.isdigit():
            raise SystemExit(f"--max-prompts wants PEER=N with PEER in {sorted(PEERS)}: {value}")
        caps[name] = int(number)
    return caps


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", nargs="+", choices=sorted(PEERS), default=list(PEERS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--request-rate", type=float, default=2.0)
    parser.add_argument("--rate-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefill-len", type=int, default=2000,
                        help="prompt tokens of the prefill run (0: no prefill run)")
    parser.add_argument("--max-prompts", action="append", default=[], metavar="PEER=N",
                        help="cap one peer's num-prompts per run (repeatable), "
                             "e.g. naive=16: the naive server serves one request at a time")
    parser.add_argument("--decode-batch-sizes", default="64,256",
                        help="batch sizes of pagellm's decode-step roofline run (empty: no run)")
    parser.add_argument("--pagellm-args", default="",
                        help="engine flags for pagellm's server and decode run, e.g. "
                             "'--kv-cache-dtype bfloat16' (named in the report)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run every peer's sweep N times, in rounds; report medians")
    parser.add_argument("--name", default=machine_kind(),
                        help="results/NAME.md, results/NAME/ and results/NAME_*.png (default: "
                             "this machine's kind, e.g. cpu-amx: one set per kind, the latest)")
    parser.add_argument("--report-only", action="store_true",
                        help="skip the runs; rebuild NAME.md and the plots from saved JSON")
    return parser.parse_args()


def clear_results(peer_dir: Path) -> None:
    """A run replaces the last one's files: the report takes the median over every round's
    file it finds, so a file left from an earlier run with more rounds, or of a peer this run
    skips, would be reported as this run's."""
    for stale in peer_dir.iterdir():
        if stale.is_file():
            stale.unlink()


def main() -> None:
    args = parse_args()
    caps = parse_caps(args.max_prompts)
    peer_dir = RESULTS / args.name
    peer_dir.mkdir(parents=True, exist_ok=True)
    gguf = default_model_path()
    skipped = {name: reason for name in args.peers if (reason := PEERS[name].missing())}
    for name, reason in skipped.items():
        print(f"[{name}] skipped: {reason}", flush=True)
    if not args.report_only:
        clear_results(peer_dir)
        (peer_dir / PAGELLM_ARGS_FILE).write_text(args.pagellm_args)
        save_run_record(peer_dir, shlex.join(["python", "benchmarks/peers.py", *sys.argv[1:]]))
    for round_number in [] if args.report_only else range(1, args.repeat + 1):
        save_peak(peer_dir, round_number)
        for name in (name for name in args.peers if name not in skipped):
            run_peer(PEERS[name], args, gguf, caps.get(name), peer_dir, round_number)
            if name == "pagellm" and args.decode_batch_sizes:
                run_decode_steps(args, peer_dir, round_number)
    runs = run_labels(args)
    write_report(peer_dir, args.peers, args.concurrency, runs, skipped, caps)


if __name__ == "__main__":
    main()
