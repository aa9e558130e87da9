"""A decode step of a mixture-of-experts model against a dense model of as many active
parameters.

Both models are random, of one small realistic shape (Qwen3-MoE's, scaled down): the MoE
has `--experts` experts of `--moe-intermediate` a layer, `--top-k` a token; the dense model
has one MLP of top-k x moe-intermediate, so a token multiplies as many weights in both (the
router's experts x hidden a layer aside). For each batch, every request is prefilled to
`--context` tokens, then `--steps` decode steps of one token a request are timed through the
model's forward and output head over the paged KV cache (the engine's scheduling and
sampling left out); the table gives the median step, tokens per second, and the experts a
MoE layer ran in a step (a small batch reads few experts' weights, a large one nearly all).

    python benchmarks/moe_step.py
    python benchmarks/moe_step.py --batches 1 16 64 --dtype bfloat16 --context 128
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_models import PagedCache  # noqa: E402

from pagellm.model.arch import ArchConfig  # noqa: E402
from pagellm.model.layers import GatedMLP  # noqa: E402
from pagellm.model.llama import LlamaForCausalLM  # noqa: E402
from pagellm.model.loader import instantiate, pack_if_supported  # noqa: E402
from pagellm.model.moe import SparseMoE  # noqa: E402
from pagellm.model.quantized import Linear  # noqa: E402

CPU = torch.device("cpu")


def arch_of(args: argparse.Namespace, moe: bool) -> ArchConfig:
    dense = ArchConfig(
        model_type="qwen3_moe" if moe else "qwen3", vocab_size=args.vocab,
        hidden_size=args.hidden, intermediate_size=args.top_k * args.moe_intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None, max_position_embeddings=4096,
        tie_word_embeddings=False, attention_bias=False, o_proj_bias=False, qk_norm=True,
        bos_token_id=None, eos_token_id=None)
    if not moe:
        return dense
    return dataclasses.replace(dense, num_experts=args.experts, num_experts_per_tok=args.top_k,
                               moe_intermediate_size=args.moe_intermediate, norm_topk_prob=True,
                               dense_layers=[])


def random_model(arch: ArchConfig, dtype: torch.dtype) -> LlamaForCausalLM:
    """Weights N(0, 0.02), norms 1, in oneDNN's packed layout where the CPU has it."""
    net = instantiate(arch, dtype, CPU)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in net.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    pack_if_supported(net, dtype, CPU)
    return net


def experts_per_layer(net: LlamaForCausalLM, step: Callable[[], object]) -> float:
    """The mean number of experts a MoE layer runs in `step` (0 for a dense model)."""
    layers = [layer.mlp for layer in net.model.layers if isinstance(layer.mlp, SparseMoE)]
    if not layers:
        return 0.0
    calls: list[int] = []
    forward = GatedMLP.forward
    GatedMLP.forward = lambda self, x: calls.append(1) or forward(self, x)  # type: ignore
    try:
        step()
    finally:
        GatedMLP.forward = forward  # type: ignore[method-assign]
    return len(calls) / len(layers)


def time_decode(net: LlamaForCausalLM, arch: ArchConfig, dtype: torch.dtype, batch: int,
                args: argparse.Namespace) -> tuple[float, float]:
    """-> (median seconds of a decode step of `batch` requests, experts a MoE layer ran)."""
    block_size = 16
    per_request = -(-(args.context + args.steps + 2) // block_size)
    cache = PagedCache(arch, dtype, num_blocks=batch * per_request, block_size=block_size)
    generator = torch.Generator().manual_seed(batch)
    for request in range(batch):  # one prefill at a time: a batch of 64 x context is large
        prompt = torch.randint(arch.vocab_size, (args.context,), generator=generator).tolist()
        cache.step(net, [(request, prompt)])
    tokens = [[int(t)] for t in torch.randint(arch.vocab_size, (batch,), generator=generator)]
    step = lambda: cache.step(net, [(r, tokens[r]) for r in range(batch)])  # noqa: E731
    experts = experts_per_layer(net, step)
    seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), experts


def params(net: LlamaForCausalLM, arch: ArchConfig) -> tuple[int, int]:
    """-> (the projections' weights, those a token multiplies: all but the idle experts')."""
    total = sum(m.in_features * m.out_features for m in net.modules() if isinstance(m, Linear))
    per_expert = 3 * arch.hidden_size * (arch.moe_intermediate_size or 0)
    idle = (arch.num_experts - arch.num_experts_per_tok) * per_expert * arch.num_hidden_layers
    return total, total - idle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=128, help="tokens a request holds")
    parser.add_argument("--steps", type=int, default=10, help="decode steps timed")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--moe-intermediate", type=int, default=512)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_grad_enabled(False)
    print(f"{args.dtype}, {torch.get_num_threads()} threads, context {args.context}, "
          f"median of {args.steps} steps")
    print("| model | matmul weights (M) | active (M) | batch | ms / step | tokens / s "
          "| experts run |\n| --- | --- | --- | --- | --- | --- | --- |")
    for moe in (True, False):
        arch = arch_of(args, moe)
        net = random_model(arch, dtype)
        total, active = params(net, arch)
        name = f"MoE {args.experts}x top-{args.top_k}" if moe else "dense"
        for batch in args.batches:
            seconds, experts = time_decode(net, arch, dtype, batch, args)
            run = f"{experts:.1f} / {args.experts}" if moe else "-"
            print(f"| {name} | {total / 1e6:.1f} | {active / 1e6:.1f} | {batch} | "
                  f"{seconds * 1e3:.2f} | {batch / seconds:.0f} | {run} |", flush=True)
        del net


if __name__ == "__main__":
    main()
