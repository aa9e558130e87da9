"""Two one-core replicas behind `pagellm router` against one two-thread replica, and prefix-aware
routing against round-robin on a multi-turn chat workload.

Every replica is a real `pagellm serve` of the model (the embedded SmolLM2 by default) whose
processes may run on its own cores only (CPU affinity, inherited by the engine core) with
that many torch threads (OMP_NUM_THREADS): two replicas of one core and one thread each, or
one replica of both cores and two threads. The router and this client are not pinned: they
share the two cores with the replicas, as a router on the replicas' machine would.

1. Throughput at `--clients` streams (`pagellm bench serve`'s random dataset and client):
   output tok/s, TTFT and ITL p50/p99, through the router (each of `--policies`) to the two
   one-core replicas, and directly to the two-thread replica.
2. Multi-turn chat (pagellm/benchmarks/multi_turn.py): a few long system prompts, many users
   each continuing a conversation, every turn carrying its whole history. The prefix-cache
   hit rate is the replicas' own (`vllm:prefix_cache_hits` / `queries`, deltas over the run);
   every policy gets its own salt, so no run finds the previous run's prompts cached.

    python benchmarks/router_replicas.py

prints a Markdown report (command, machine, date, one table per part). `--fake-replicas`
runs the same plumbing against tests/fake_openai_server.py (no figures worth keeping).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from server_utils import cli_env, engine_core_pid, free_port  # noqa: E402

from router_overhead import cpu_seconds  # noqa: E402
from server_health import wait_healthy  # noqa: E402

from pagellm.benchmarks import serve  # noqa: E402
from pagellm.benchmarks.multi_turn import (ChatWorkload, build_conversations,  # noqa: E402
                                           run_conversations)
from pagellm.benchmarks.serve_client import Endpoint, ServerTokenizer, fetch_model_id  # noqa: E402
from pagellm.benchmarks.serve_metrics import compute_metrics  # noqa: E402

PERCENTILES = (50.0, 99.0)
CLI = [sys.executable, "-m", "pagellm.entrypoints.cli"]


@dataclass
class Process:
    """A server this script started: its process, URL and log."""

    process: subprocess.Popen
    url: str
    log: Any
    files: list[Any] = field(default_factory=list)   # temporary files it reads

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for handle in (self.log, *self.files):
            handle.close()


def _launch(command: list[str], port: int, cores: set[int] | None = None,
            env: dict[str, str] | None = None) -> Process:
    log = tempfile.NamedTemporaryFile("w+", prefix="router-replicas-", suffix=".log")
    process = subprocess.Popen(
        command, cwd=REPO, env={**cli_env(), **(env or {})}, stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
    return Process(process, f"http://127.0.0.1:{port}", log)


def wait_ready(servers: list[Process], args: argparse.Namespace) -> list[Process]:
    """Wait for every server's /health; on a failure, print its log and stop them all."""
    for server in servers:
        try:
            wait_healthy(server.process, server.url, timeout=args.startup_timeout,
                         poll_seconds=0.2)
        except RuntimeError:
            server.log.seek(0)
            print(server.log.read()[-4000:], file=sys.stderr)
            for other in servers:
                other.stop()
            raise
    return servers


def launch_replica(args: argparse.Namespace, cores: set[int]) -> Process:
    """A replica confined to `cores`, with one torch thread per core (not yet ready)."""
    port = free_port()
    if args.fake_replicas:
        command = [sys.executable, "tests/fake_openai_server.py", "--port", str(port),
                   "--chunk-delay-s", "0.001"]
    else:
        command = [*CLI, "serve", args.model, "--port", str(port), "--max-model-len",
                   str(args.max_model_len), "--disable-log-requests", "--uvicorn-log-level",
                   "warning", *shlex.split(args.serve_args)]
    threads = str(len(cores))
    return _launch(command, port, cores,
                   {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
                    "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)})


def start_router(args: argparse.Namespace, replicas: list[Process], model: str,
                 policy: str) -> Process:
    """A router whose one group, named after the model, holds the replicas."""
    port = free_port()
    group = {"local": True, "balancing": policy, "load_penalty": args.load_penalty,
             "backends": [replica.url for replica in replicas]}
    config = tempfile.NamedTemporaryFile("w", prefix="router-replicas-", suffix=".yaml")
    yaml.safe_dump({"groups": {model: group}, "port": port, "probe_interval_s": 0.5}, config)
    config.flush()
    router = _launch([*CLI, "router", "--config", config.name], port)
    router.files.append(config)
    return wait_ready([router], args)[0]


def report_pinning(args: argparse.Namespace, replicas: list[Process]) -> None:
    """The CPUs each replica's engine core (the process that runs the model) may use."""
    if not args.fake_replicas:
        cpus = [sorted(os.sched_getaffinity(engine_core_pid(r.process.pid))) for r in replicas]
        print(f"Engine cores started, on CPUs {' and '.join(map(str, cpus))}.\n", flush=True)


def model_name(replica: Process) -> str:
    with httpx.Client(base_url=replica.url, timeout=30) as client:
        return fetch_model_id(client)


def scrape(url: str) -> dict[str, float]:
    """Every sample of a Prometheus text page, summed over its labels, by name."""
    totals: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            key = name.split("{")[0]
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def backend_responses(router_url: str) -> list[float]:
    """Successful answers per backend, from the router's own counter."""
    counts: dict[str, float] = {}
    for line in httpx.get(f"{router_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("pagellm_router_responses_total{") and 'status="200"' in line:
            backend = line.split('backend="', 1)[1].split('"', 1)[0]
            counts[backend] = counts.get(backend, 0.0) + float(line.rpartition(" ")[2])
    return [counts[name] for name in sorted(counts)]


def throughput(url: str, model: str, args: argparse.Namespace, num_prompts: int,
               concurrency: int, output_len: int | None = None) -> dict[str, Any]:
    """One `pagellm bench serve` run (random prompts, every request to its max tokens)."""
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    bench_args = parser.parse_args([
        "--backend", "openai-chat", "--base-url", url, "--model", model,
        "--random-input-len", str(args.input_len),
        "--random-output-len", str(output_len or args.output_len),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
        "--metric-percentiles", "50,99", "--ignore-eos", "--disable-tqdm",
        "--seed", str(args.seed)])
    with contextlib.redirect_stdout(io.StringIO()):
        return serve.run(bench_args)


def chat(url: str, model: str, args: argparse.Namespace, salt: str,
         replicas: list[Process]) -> dict[str, Any]:
    """The multi-turn workload through `url`; TTFT and the replicas' prefix-cache hit rate."""
    workload = ChatWorkload(args.system_prompts, args.system_len, args.conversations,
                            args.turns, args.user_len, args.reply_len, args.seed, salt)
    with httpx.Client(base_url=replicas[0].url, timeout=60) as client:
        conversations = build_conversations(workload, ServerTokenizer(client, model))
    endpoint = Endpoint(f"{url}/v1/chat/completions", "openai-chat", model, ignore_eos=True)
    before = [scrape(replica.url) for replica in replicas]
    run = asyncio.run(run_conversations(endpoint, conversations, args.chat_clients))
    after = [scrape(replica.url) for replica in replicas]
    lens = [output.usage_tokens or 0 for output in run.outputs]
    metrics = compute_metrics(run.outputs, lens, run.duration, PERCENTILES)

    def delta(name: str) -> float:
        return sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before))

    queries = delta("vllm:prefix_cache_queries_total")
    return {"metrics": metrics,
            "hit_rate": delta("vllm:prefix_cache_hits_total") / queries if queries else None}


def machine_line() -> str:
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown CPU")
    return (f"{model}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start; "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def _ms(value: float) -> str:
    return f"{value:.1f}"


def throughput_row(label: str, result: dict[str, Any], router_ms: str) -> str:
    cells = [label, f"{result['output_throughput']:.1f}",
             *(_ms(result[key]) for key in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
                                            "p99_itl_ms")),
             str(result["failed"]), router_ms]
    return "| " + " | ".join(cells) + " |"


def chat_row(policy: str, result: dict[str, Any], split: list[float], router_ms: str) -> str:
    metrics = result["metrics"]
    ttft = metrics.stats["ttft"]
    rate = "n/a" if result["hit_rate"] is None else f"{100 * result['hit_rate']:.1f}%"
    cells = [policy, rate, _ms(ttft.percentiles[50.0]), _ms(ttft.percentiles[99.0]),
             f"{metrics.output_throughput:.1f}", " / ".join(f"{n:.0f}" for n in split),
             str(metrics.failed), router_ms]
    return "| " + " | ".join(cells) + " |"


def warm_up(url: str, model: str, args: argparse.Namespace) -> None:
    """Batches of the measured shape, not in any figure: first steps pay one-off costs."""
    throughput(url, model, args, min(args.clients, 16), min(args.clients, 16), output_len=4)


def routed(args: argparse.Namespace, replicas: list[Process], model: str, policy: str,
           measure: Any) -> tuple[Any, list[float], str]:
    """`measure(router_url)` through a fresh router (empty prefix index, no in-flight counts);
    returns its result, the answers per replica and the router's CPU ms per request."""
    router = start_router(args, replicas, model, policy)
    try:
        cpu_before = cpu_seconds(router.process.pid)
        result = measure(router.url)
        split = backend_responses(router.url)
        cpu_ms = (cpu_seconds(router.process.pid) - cpu_before) * 1000 / max(sum(split), 1)
    finally:
        router.stop()
    return result, split, f"{cpu_ms:.2f}"


def two_replica_parts(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Everything measured on the two one-core replicas: throughput rows, chat rows."""
    replicas = wait_ready([launch_replica(args, {core}) for core in (0, 1)], args)
    throughput_rows, chat_rows = [], []
    try:
        report_pinning(args, replicas)
        model = args.served_model or model_name(replicas[0])
        for replica in replicas:
            warm_up(replica.url, model, args)
        if "throughput" in args.parts:
            for policy in args.policies:
                result, _, cpu_ms = routed(args, replicas, model, policy, lambda url: throughput(
                    url, model, args, args.clients * args.prompts_per_client, args.clients))
                throughput_rows.append(throughput_row(f"2 x 1-core replicas, router {policy}",
                                                      result, cpu_ms))
        if "chat" in args.parts:
            for index, policy in enumerate(args.chat_policies):
                result, split, cpu_ms = routed(args, replicas, model, policy, lambda url: chat(
                    url, model, args, f"Run {index}. ", replicas))
                chat_rows.append(chat_row(policy, result, split, cpu_ms))
    finally:
        for replica in replicas:
            replica.stop()
    return throughput_rows, chat_rows


def one_replica_row(args: argparse.Namespace) -> str:
    replica = wait_ready([launch_replica(args, {0, 1})], args)[0]
    try:
        report_pinning(args, [replica])
        model = args.served_model or model_name(replica)
        warm_up(replica.url, model, args)
        result = throughput(replica.url, model, args, args.clients * args.prompts_per_client,
                            args.clients)
    finally:
        replica.stop()
    return throughput_row("1 x 2-thread replica, direct", result, "-")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--served-model", default=None, help="default: the replicas' first")
    parser.add_argument("--serve-args", default="", help="more `pagellm serve` flags")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="per replica")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--parts", default="throughput,chat", help="throughput, chat or both")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--prompts-per-client", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--policies", default="least_loaded,prefix")
    parser.add_argument("--chat-policies", default="prefix,round_robin")
    parser.add_argument("--load-penalty", type=float, default=4.0,
                        help="the prefix policy's blocks per request on a replica")
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=700)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--user-len", type=int, default=40)
    parser.add_argument("--reply-len", type=int, default=32)
    parser.add_argument("--chat-clients", type=int, default=16,
                        help="conversations in progress at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fake-replicas", action="store_true",
                        help="tests/fake_openai_server.py instead of `pagellm serve` (a check "
                             "of the plumbing: no prefix cache, no figures)")
    args = parser.parse_args()
    args.parts = set(args.parts.split(","))
    args.policies = args.policies.split(",")
    args.chat_policies = args.chat_policies.split(",")
    if args.model is None and not args.fake_replicas:
        from pagellm.model.paths import default_model_path

        args.model = str(default_model_path())
    return args


def print_tables(args: argparse.Namespace, throughput_rows: list[str],
                 chat_rows: list[str]) -> None:
    if throughput_rows:
        print(f"### Throughput at {args.clients} clients ({args.input_len} tokens in, "
              f"{args.output_len} out, {args.clients * args.prompts_per_client} requests)\n")
        print("| setup | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
              "| failed | router CPU ms/request |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        print("\n".join(throughput_rows) + "\n")
    if chat_rows:
        print(f"### Multi-turn chat ({args.system_prompts} system prompts of {args.system_len} "
              f"tokens, {args.conversations} conversations of {args.turns} turns of "
              f"{args.user_len} tokens with {args.reply_len}-token replies, "
              f"{args.chat_clients} at a time, two 1-core replicas)\n")
        print("| routing | prefix-cache hit rate | TTFT p50 ms | TTFT p99 ms | output tok/s "
              "| answers per replica | failed | router CPU ms/request |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        print("\n".join(chat_rows))


def main() -> None:
    if not {0, 1} <= os.sched_getaffinity(0):
        raise SystemExit("this benchmark pins replicas to CPUs 0 and 1, which it may not use")
    args = parse_args()
    print(f"Command: `python benchmarks/router_replicas.py {shlex.join(sys.argv[1:])}`\n")
    print(f"Machine: {machine_line()}\n")
    replica = ("tests/fake_openai_server.py (plumbing check: no figures)" if args.fake_replicas
               else shlex.join(["pagellm", "serve", args.model, "--max-model-len",
                                str(args.max_model_len), *shlex.split(args.serve_args)]) +
               f", {args.kv_cache_gib} GiB KV cache each")
    print(f"Replicas: `{replica}`. Each row through the router starts a fresh `pagellm "
          f"router` (probes every 0.5 s, prefix load penalty {args.load_penalty} blocks); "
          f"the router and this client are not pinned.\n", flush=True)
    throughput_rows, chat_rows = two_replica_parts(args)
    if "throughput" in args.parts:
        throughput_rows.append(one_replica_row(args))
    print_tables(args, throughput_rows, chat_rows)


if __name__ == "__main__":
    main()
