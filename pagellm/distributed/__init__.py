"""Tensor and pipeline parallelism over torch.distributed (gloo on CPU, NCCL on CUDA), its
ranks started as processes on this machine or as Ray actors across a cluster.

The engine core stays one process with one scheduler; `start_executor` gives it the ranks
that run the model with it, or None for the single-process engine (the uni executor, vLLM's
choice for a world size of 1), which then runs exactly as before. A world of one rank asked
to run on `mp` or `ray` gets that executor with no workers: the same process group and
preflight, as in vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagellm.config import CacheConfig
from pagellm.distributed.config import ParallelConfig

if TYPE_CHECKING:
    import torch

    from pagellm.distributed.executor import MultiprocExecutor


def start_executor(parallel: ParallelConfig | None, cache: CacheConfig,
                   device: "torch.device") -> "MultiprocExecutor | None":
    if parallel is None or parallel.distributed_executor_backend == "uni":
        return None
    if cache.offload_bytes:
        raise ValueError("KV offloading with tensor or pipeline parallelism is not supported "
                         "by pagellm yet.")
    if parallel.distributed_executor_backend == "ray":
        from pagellm.distributed.ray_executor import RayExecutor

        return RayExecutor(parallel, device)
    from pagellm.distributed.executor import MultiprocExecutor  # torch.distributed: only here

    return MultiprocExecutor(parallel, device)
