"""Seconds from `pagellm serve` to a healthy `/health`: a first start on a fresh machine
(empty kernel and pagellm caches: the kernels compile and the GGUF is prepared) and
restarts (both caches warm).

    python benchmarks/startup.py                   # first start, then 3 restarts
    python benchmarks/startup.py --kernels-built   # first start after scripts/setup.sh
    python benchmarks/startup.py --restarts 5 -- --kv-cache-dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import subprocess
import sys
import tempfile

from server_health import wait_healthy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_to_health(env: dict[str, str], serve_args: list[str], timeout: float = 900) -> str:
    """Seconds from `pagellm serve` to a healthy /health, and the CPU seconds its processes
    (API server, engine core, compilers) took until they exited, a shutdown's few included:
    on two cores, a start's wall time follows its CPU time, which varies less."""
    port = free_port()
    cpu_before = _children_cpu_seconds()
    server = subprocess.Popen([sys.executable, "-m", "pagellm.entrypoints.cli", "serve",
                               "--port", str(port), *serve_args], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        seconds = wait_healthy(server, f"http://127.0.0.1:{port}", timeout)
    finally:
        server.terminate()
        server.wait(timeout=60)
    return f"{seconds:.1f} s ({_children_cpu_seconds() - cpu_before:.1f} s of CPU)"


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--no-first-start", action="store_true",
                        help="only restarts, with the caches as they are")
    parser.add_argument("--kernels-built", action="store_true",
                        help="the first start keeps the kernels this machine has built (as "
                             "scripts/setup.sh builds them at install); only pagellm's cache "
                             "starts empty")
    parser.add_argument("serve_args", nargs="*", help="after --: flags for pagellm serve")
    args = parser.parse_args()
    env = dict(os.environ)
    if not args.no_first_start:
        fresh = tempfile.mkdtemp(prefix="pagellm-startup-")
        env["PAGELLM_CACHE_DIR"] = os.path.join(fresh, "pagellm")
        if not args.kernels_built:
            env["TORCH_EXTENSIONS_DIR"] = os.path.join(fresh, "torch_extensions")
        what = "GGUF prepared" if args.kernels_built else "kernels compiled, GGUF prepared"
        print(f"first start ({what}): {start_to_health(env, args.serve_args)}", flush=True)
    for i in range(args.restarts):
        print(f"restart {i + 1}: {start_to_health(env, args.serve_args)}", flush=True)


if __name__ == "__main__":
    main()
