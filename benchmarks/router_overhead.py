"""What `pagellm router` adds to a request: TTFT and ITL through it vs to the backend directly.

The backend is the fake OpenAI-compatible server of the tests (tests/fake_openai_server.py)
in its own process, streaming one token every `--chunk-delay-s`, so the backend itself costs
the same on both paths and the difference is the router's: parsing, the privacy scan,
choosing a replica (with a `/tokenize` round trip under the prefix policy), the upstream
connection and relaying each chunk. Each path is measured with `pagellm bench serve`:

    python benchmarks/router_overhead.py --concurrency 1,64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from server_utils import cli_env, free_port  # noqa: E402

from server_health import wait_healthy  # noqa: E402

METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start(command: list[str], url: str) -> subprocess.Popen:
    process = subprocess.Popen(command, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    wait_healthy(process, url, timeout=120, poll_seconds=0.2)
    return process


def _bench(url: str, concurrency: int, args: argparse.Namespace, folder: Path) -> dict:
    name = f"{len(list(folder.iterdir()))}.json"
    command = [sys.executable, "-m", "pagellm.entrypoints.cli", "bench", "serve",
               "--backend", "openai-chat", "--base-url", url, "--model", "fake-model",
               "--random-input-len", str(args.input_len), "--random-output-len",
               str(args.output_len), "--num-prompts",
               str(max(16, args.prompts_per_stream * concurrency)),
               "--max-concurrency", str(concurrency), "--metric-percentiles", "50,99",
               "--ignore-eos", "--disable-tqdm", "--save-result", "--result-dir", str(folder),
               "--result-filename", name]
    subprocess.run(command, cwd=REPO, env=cli_env(), check=True, stdout=subprocess.DEVNULL)
    return json.loads((folder / name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--prompts-per-stream", type=int, default=4,
                        help="requests per concurrent stream (at least 16 in all)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--chunk-delay-s", type=float, default=0.02)
    parser.add_argument("--routing-logic", default="prefix")
    args = parser.parse_args()
    backend_port, router_port = free_port(), free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    router_url = f"http://127.0.0.1:{router_port}"
    processes = [_start([sys.executable, "tests/fake_openai_server.py", "--port",
                         str(backend_port), "--chunk-delay-s", str(args.chunk_delay_s)],
                        backend_url)]
    try:
        processes.append(_start([sys.executable, "-m", "pagellm.entrypoints.cli", "router",
                                 "--backend", backend_url, "--served-model-name", "fake-model",
                                 "--routing-logic", args.routing_logic,
                                 "--port", str(router_port)], router_url))
        with tempfile.TemporaryDirectory() as folder:
            _report(args, backend_url, router_url, Path(folder), processes[1].pid)
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=20)


def _report(args: argparse.Namespace, backend_url: str, router_url: str, folder: Path,
            router_pid: int) -> None:
    print(f"router overhead: fake backend at {args.chunk_delay_s * 1000:.0f} ms/token, "
          f"{args.input_len} in / {args.output_len} out, {args.prompts_per_stream} requests "
          f"per stream, "
          f"routing {args.routing_logic}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at start")
    print(f"{'streams':>7} {'path':>7} " + " ".join(f"{m:>15}" for m in METRICS) +
          f" {'router CPU ms/request':>22}")
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        direct = _bench(backend_url, concurrency, args, folder)
        cpu_before = cpu_seconds(router_pid)
        routed = _bench(router_url, concurrency, args, folder)
        cpu_ms = (cpu_seconds(router_pid) - cpu_before) * 1000 / routed["completed"]
        for label, result in (("direct", direct), ("router", routed)):
            print(f"{concurrency:>7} {label:>7} " +
                  " ".join(f"{result[m]:>15.2f}" for m in METRICS) +
                  (f" {cpu_ms:>22.2f}" if result is routed else ""))
        print(f"{concurrency:>7} {'added':>7} " +
              " ".join(f"{routed[m] - direct[m]:>15.2f}" for m in METRICS))


if __name__ == "__main__":
    main()
