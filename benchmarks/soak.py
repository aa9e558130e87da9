"""The long soak: `pagellm serve` (the embedded SmolLM2 unless --model) with a KV cache a
third the size of the load and a small second tier, then `pagellm.benchmarks.soak`'s mix
(streams and not, n=1-2, stop strings, short and long prompts, 10% hang-ups, 1% malformed).

Prints failed valid requests, the KV cache report at the end (used blocks and the block
pool's integrity check), the resident memory of the server and engine core processes over
time, and any ERROR or Traceback in the server's log.

    PYTHONPATH=$PWD python3 benchmarks/soak.py --num-requests 10000 --max-minutes 30
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from pagellm.benchmarks.soak import SoakConfig, SoakResult, run_soak  # noqa: E402
from pagellm.model.paths import default_model_path  # noqa: E402
from server_utils import RemoteServer, engine_core_pid  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def finished_requests(remote: RemoteServer) -> int:
    """Engine requests finished so far, every reason (vllm:request_success)."""
    text = httpx.get(f"{remote.url}/metrics", timeout=30).text
    return int(sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total")))


async def soak_with_memory(remote: RemoteServer, config: SoakConfig,
                           every: float) -> tuple[SoakResult, list[tuple[float, int, float, float]]]:
    """The soak, and (seconds, requests done, server RSS, core RSS) every `every` seconds."""
    core = engine_core_pid(remote.process.pid)
    samples: list[tuple[float, int, float, float]] = []
    task = asyncio.ensure_future(run_soak(remote.url, config))
    start = time.perf_counter()
    while not task.done():
        samples.append((time.perf_counter() - start, finished_requests(remote),
                        rss_mib(remote.process.pid), rss_mib(core)))
        print("sample (seconds, finished engine requests, server RSS MiB, core RSS MiB): "
              + ", ".join(f"{value:.0f}" for value in samples[-1]), flush=True)
        await asyncio.wait({task}, timeout=every)
    return task.result(), samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=140,
                        help="KV blocks of 16 tokens: about a third of the load at 32 clients")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="stop sending new requests after this long")
    parser.add_argument("--long-prompt-words", type=int, default=250)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--sample-seconds", type=float, default=30.0)
    args = parser.parse_args()
    model = Path(args.model) if args.model else default_model_path()
    remote = RemoteServer(model, "--served-model-name", "soak", "--max-model-len", "2048",
                          "--num-gpu-blocks-override", str(args.num_blocks),
                          "--kv-offloading-size", "0.25", startup_timeout=600)
    config = SoakConfig(num_requests=args.num_requests, concurrency=args.concurrency,
                        long_prompt_words=args.long_prompt_words, max_tokens=args.max_tokens,
                        max_seconds=args.max_minutes * 60 if args.max_minutes else None)
    try:
        result, samples = asyncio.run(soak_with_memory(remote, config, args.sample_seconds))
        metrics = remote.metrics()
    finally:
        log = remote.stop()
    print(f"requests sent: {result.done} of {args.num_requests} in {result.seconds:.0f} s "
          f"({args.concurrency} clients, {args.num_blocks} KV blocks)")
    print(f"valid ok: {result.valid_ok}, failed valid: {len(result.failures)}, hung up: "
          f"{result.disconnected}, malformed rejected (4xx): {result.malformed_rejected}")
    for failure in result.failures[:10]:
        print("  failure:", failure)
    print(f"preemptions: {metrics.get('vllm:num_preemptions_total', 0):.0f}")
    print(f"KV cache at the end: {result.kv_cache}")
    print("seconds  finished-requests  server-RSS-MiB  core-RSS-MiB")
    for seconds, done, server_rss, core_rss in samples:
        print(f"{seconds:7.0f}  {done:17d}  {server_rss:14.0f}  {core_rss:12.0f}")
    bad = [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]
    print(f"ERROR/Traceback lines in the server log: {len(bad)}")
    for line in bad[:10]:
        print("  ", line)


if __name__ == "__main__":
    main()
