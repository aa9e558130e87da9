"""A short soak: a few hundred mixed requests against a KV cache a third the size of the
load (preemption, swaps to the second tier), with clients that hang up and malformed
bodies. No valid request may fail, and the KV cache must end empty and consistent.
`benchmarks/soak.py` is the long version, with memory over time."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pagellm.benchmarks.soak import SoakConfig, run_soak
from server_utils import RemoteServer, assert_clean_shutdown


def test_short_soak(tiny_llama_dir: Path) -> None:
    remote = RemoteServer(tiny_llama_dir, "--served-model-name", "tiny",
                          "--num-gpu-blocks-override", "80", "--kv-offloading-size", "0.01")
    try:
        config = SoakConfig(num_requests=200, concurrency=16, long_prompt_words=150, seed=7,
                            max_tokens=16)
        result = asyncio.run(run_soak(remote.url, config))
        assert result.failures == []
        assert result.valid_ok + result.disconnected + result.malformed_rejected == 200
        assert result.disconnected > 5 and result.malformed_rejected > 0
        assert result.kv_cache == {"num_blocks": 80, "used_blocks": 0, "num_requests": 0,
                                   "problem": None}
        metrics = remote.metrics()
        assert metrics["vllm:num_preemptions_total"] > 0  # the small cache was felt
        assert metrics["vllm:num_requests_running"] == 0
    finally:
        output = remote.stop()
    assert_clean_shutdown(output)
    assert " ERROR " not in output  # no fault of the server's own, logged or not
