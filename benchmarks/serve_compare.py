"""Start `pagellm serve` with given flags, run `pagellm bench serve` against it, stop it.

One server at a time on this machine; each named run writes its result JSON under
benchmarks/results/ and a one-line summary of its Prometheus counters. Example:

    python benchmarks/serve_compare.py --name prefix-on --server "--max-model-len 2048" \\
        --bench "--dataset-name prefix-repetition --num-prompts 50"
"""

from __future__ import annotations

import argparse
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from server_health import wait_healthy

RESULTS = Path(__file__).parent / "results"
COUNTERS = ("vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:num_preemptions_swap", "vllm:num_preemptions_recompute",
            "vllm:kv_offload_store_bytes", "vllm:kv_offload_load_bytes")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            base = sample.name.removesuffix("_total")
            if base in COUNTERS and sample.name.endswith("_total"):
                values[base] = values.get(base, 0.0) + sample.value
    return values


@contextmanager
def serving(argv: Sequence[str], port: int, log_path: Path,
            ready_path: str = "/health") -> Iterator[str]:
    """Start the server command `argv` (listening on `port`), yield its URL once ready,
    stop it on exit. Its output goes to `log_path`."""
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        server = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(server, url, timeout=300, path=ready_path)
            yield url
        finally:
            server.terminate()
            server.wait(timeout=60)


def bench(url: str, result_dir: Path, filename: str, flags: Sequence[str]) -> None:
    """Run `pagellm bench serve` against `url`, saving its result JSON."""
    subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "bench", "serve",
                    "--base-url", url, "--save-result", "--result-dir", str(result_dir),
                    "--result-filename", filename, "--disable-tqdm", *flags], check=True)


def run(name: str, server_flags: str, bench_flags: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    port = free_port()
    argv = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--port", str(port),
            "--disable-log-requests", *shlex.split(server_flags)]
    with serving(argv, port, RESULTS / f"{name}.server.log") as url:
        bench(url, RESULTS, f"{name}.json", shlex.split(bench_flags))
        print(f"[{name}] counters: {counters(url)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--server", default="", help="flags for pagellm serve")
    parser.add_argument("--bench", default="", help="flags for pagellm bench serve")
    args = parser.parse_args()
    run(args.name, args.server, args.bench)


if __name__ == "__main__":
    main()
