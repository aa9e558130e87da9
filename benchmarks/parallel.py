"""Tokens per second of one engine laid out over processes: `pagellm serve` with each layout
(`tp1`: one process with all the cores' threads; `tpN` / `ppN`: N gloo ranks, each pinned to
its own cores; `dpN`: N whole engine cores behind one API server, each on its own cores;
`dpN@node`: the same engine cores on a `--headless` node of this machine, reached over TCP
on loopback instead of pipes, the head only the API server), measured with `pagellm bench
serve` at each concurrency.

On a machine of 2 cores this is the honest cost of the communication: two ranks of one core
each against one process of two threads. The embedded SmolLM2-135M has 9 query heads, so
its tensor parallel sizes are 1, 3 and 9 (`tp3`); pass `--model` for another.

`overlap` is the share of an engine's batches launched while another was in flight: under
pipeline parallelism, how often the stages computed at once (`-` without a batch queue).

    python benchmarks/parallel.py --layouts tp1,tp3,pp2,dp2,dp2@node --concurrency 1,64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from server_utils import cli_env, free_port  # noqa: E402

from server_health import wait_healthy  # noqa: E402

METRICS = ("output_throughput", "median_ttft_ms", "median_itl_ms")
_BATCH_COUNTERS = ("pagellm:pipeline_batches_total", "pagellm:pipeline_overlapped_batches_total")


def layout_flags(layout: str) -> list[str]:
    """`tp2` -> ["-tp", "2"], `pp2` -> ["-pp", "2"], `dp2` -> ["-dp", "2"], `tp2pp2` -> both."""
    flags: list[str] = []
    rest = layout
    while rest:
        kind, rest = rest[:2], rest[2:]
        digits = len(rest) - len(rest.lstrip("0123456789"))
        if kind not in ("tp", "pp", "dp") or not digits:
            raise SystemExit(f"bad layout {layout!r}: use e.g. tp1, tp3, pp2, dp2, tp3pp2")
        flags += [f"-{kind}", rest[:digits]]
        rest = rest[digits:]
    return flags


def _serve(args: argparse.Namespace, layout: str) -> tuple[list[subprocess.Popen], str]:
    """The server (first) and, for `@node`, the headless node that runs its engines."""
    name, _, where = layout.partition("@")
    if where not in ("", "node") or (where and not name.startswith("dp")):
        raise SystemExit(f"bad layout {layout!r}: only dpN takes @node, e.g. dp2@node")
    flags, port = layout_flags(name), free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve",
             *([args.model] if args.model else [])]
    processes = []
    if where:
        rpc = ["-dpp", str(free_port())]
        processes.append(_start([*serve, "--headless", *flags, *rpc]))
        flags += ["-dpl", "0", *rpc]
    processes.insert(0, _start([*serve, "--port", str(port), "--disable-log-requests",
                                "--uvicorn-log-level", "warning", *flags]))
    try:
        wait_healthy(processes[0], url, timeout=args.startup_timeout, poll_seconds=0.2)
    except BaseException:
        for process in processes:
            process.kill()
        raise
    return processes, url


def _start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)


def _bench(url: str, concurrency: int, args: argparse.Namespace, folder: Path) -> dict:
    name = f"{len(list(folder.iterdir()))}.json"
    command = [sys.executable, "-m", "pagellm.entrypoints.cli", "bench", "serve",
               "--base-url", url, "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len),
               "--num-prompts", str(max(8, args.prompts_per_stream * concurrency)),
               "--max-concurrency", str(concurrency), "--ignore-eos", "--disable-tqdm",
               "--save-result", "--result-dir", str(folder), "--result-filename", name]
    subprocess.run(command, cwd=REPO, env=cli_env(), check=True, stdout=subprocess.DEVNULL)
    return json.loads((folder / name).read_text())


def _batch_counts(url: str) -> tuple[float, float]:
    """The engine cores' (batches, batches launched while another was in flight) so far:
    under pipeline parallelism their ratio is the share of batches the stages overlapped."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    totals = {name: 0.0 for name in _BATCH_COUNTERS}
    for line in text.splitlines():
        name = line.partition("{")[0].partition(" ")[0]
        if name in totals:
            totals[name] += float(line.rpartition(" ")[2])
    return totals[_BATCH_COUNTERS[0]], totals[_BATCH_COUNTERS[1]]


def _overlap(before: tuple[float, float], after: tuple[float, float]) -> str:
    batches = after[0] - before[0]
    return f"{(after[1] - before[1]) / batches:.2f}" if batches else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--layouts", default="tp1,tp3,pp2")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--prompts-per-stream", type=int, default=2,
                        help="requests per concurrent stream (at least 8 in all)")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--startup-timeout", type=float, default=300)
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    print(f"parallel layouts on {args.model or 'the embedded model'}: {args.input_len} in / "
          f"{args.output_len} out, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at start")
    print(f"{'layout':>8} {'streams':>7} " + " ".join(f"{m:>18}" for m in METRICS)
          + f" {'overlap':>8}")
    with tempfile.TemporaryDirectory() as folder:
        for layout in args.layouts.split(","):
            processes, url = _serve(args, layout)
            try:
                for concurrency in concurrencies:
                    before = _batch_counts(url)
                    result = _bench(url, concurrency, args, Path(folder))
                    overlap = _overlap(before, _batch_counts(url))
                    print(f"{layout:>8} {concurrency:>7} " +
                          " ".join(f"{result[m]:>18.2f}" for m in METRICS) +
                          f" {overlap:>8}", flush=True)
            finally:
                for process in processes:  # the server first: it stops the node's engines
                    process.terminate()
                    process.wait(timeout=30)


if __name__ == "__main__":
    main()
