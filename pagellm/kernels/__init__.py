"""Hand-written CPU kernels, compiled once per machine with its C++ compiler.

They are built on first use through `torch.utils.cpp_extension` into torch's
extension cache, under a name that changes with any source or flag, and register
themselves as `torch.ops.pagellm.*`; a later start loads that library directly.
Without a compiler, or with `PAGELLM_CPU_KERNELS=0`, the engine falls back to plain
torch ops: same results, slower. `python -m pagellm.kernels` builds them ahead of
time.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from pagellm.logger import init_logger

logger = init_logger(__name__)

_HERE = Path(__file__).parent
# Compiled as two translation units side by side, each including its kernel files: torch's
# headers take about 4 s of each unit's compile, paid once per unit instead of once per
# file, and the two units build at once on two cores. Every file keeps its internals in a
# namespace of its own (pagellm::kernels::<file> or pagellm::quantized::<kind>) so that they
# can share one. The default serving path's kernels are one library, built at a first start;
# those only some configurations call are another, built when one first needs them
# (_ON_DEMAND_UNITS). The units split the default library's compile about evenly: 11.3 and
# 11.9 s each alone (-O3, a 2-core Xeon with AMX), 15 s side by side beside the server's own
# start. Each template instantiation costs a first start seconds: the kernels instantiate
# only what this CPU runs (the int8 kernel's instructions of one instruction set) and what
# changes their arithmetic (attention computes float32 queries; the wrappers widen others).
_DEFAULT_UNITS = (
    ("decode_attention_invariant.cpp", "prefill_attention.cpp", "write_kv.cpp",
     "rotary_embedding.cpp", "activation.cpp", "argmax.cpp", "rms_norm.cpp", "token_mask.cpp",
     "decoder_layer.cpp"),
    ("quantized_linear_int8.cpp", "sampling_noise.cpp", "quantized_linear_amx.cpp"),
)
# The decode attention of --no-batch-invariant (paged_attention), the quantized matmul with
# float activations (--no-gguf-int8-activations, --dtype float32), AMX's bf16 tiles (bf16
# models) and the cache eviction that timing the quantized forms needs (a projection that
# measures its forms, off the batch-invariant path): about 13 s of compiler time that no
# default path needs.
_ON_DEMAND_UNITS = (
    ("paged_attention.cpp",),
    ("quantized_linear.cpp", "quantized_linear_bf16_amx.cpp", "cache_eviction.cpp"),
)
_SOURCES = [_HERE / name for unit in (*_DEFAULT_UNITS, *_ON_DEMAND_UNITS) for name in unit]
_HEADERS = [_HERE / name for name in ("vectorizable.h", "float_vectors.h", "float_transpose.h",
                                      "quantized_linear.h", "int8_group_sums.h", "int8_rows.h",
                                      "attention_scores.h", "amx_tiles.h")]
# -fopenmp: at::parallel_for is inline OpenMP, serial without it; the runtime it links is the
# libgomp.so.1 torch has already loaded. -fno-trapping-math (torch builds with it too): with
# FP traps assumed, GCC keeps any loop holding a float comparison scalar on AVX2, such as
# exp's clamp in every softmax and SiLU loop; it changes no rounding. Instruction sets:
# those of the kernels torch itself dispatches to on this CPU.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


@functools.cache
def cpu_kernels_available() -> bool:
    """Build (or load the cached build of) the default path's CPU kernels; False if they
    cannot be used."""
    if os.environ.get("PAGELLM_CPU_KERNELS", "1") == "0":
        return False
    if _build_library("pagellm_cpu_kernels", _DEFAULT_UNITS):
        return True
    logger.warning("CPU kernels unavailable, using torch ops instead (slower)")
    return False


@functools.cache
def on_demand_kernels_available() -> bool:
    """Build (or load) the kernels of _ON_DEMAND_UNITS, which only some configurations call:
    the loader and the model runner ask for them when theirs does, the ops' wrappers below
    before any call."""
    return cpu_kernels_available() and _build_library("pagellm_cpu_kernels_on_demand",
                                                      _ON_DEMAND_UNITS)


def _build_library(prefix: str, units: tuple[tuple[str, ...], ...]) -> bool:
    """Load the library of these units built for this CPU, building it first where it is not
    there (with AMX's flags, then without them for a compiler that lacks them)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = _isa_flags(capability)
    without_amx = [flag for flag in flags if flag not in _AMX_FLAGS]
    for attempt, isa in enumerate([flags] if without_amx == flags else [flags, without_amx]):
        name = f"{prefix}_{capability.lower()}_{_build_digest(isa)}_{attempt}"
        try:
            with build_lock(build_directory(name)) as folder:
                if not _load_built(folder / f"{name}.so"):
                    from torch.utils.cpp_extension import load

                    logger.info("Compiling %s (once per machine)",
                                ", ".join(file for unit in units for file in unit))
                    load(name=name, sources=_write_units(folder, units),
                         extra_include_paths=[str(_HERE)], build_directory=str(folder),
                         extra_cflags=["-O3", "-fopenmp", "-fno-trapping-math", "-fno-math-errno",
                                       *_gcc_heap_flags(), *isa],
                         extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
            return True
        except (OSError, RuntimeError, ImportError) as error:  # no compiler or ninja, build error
            logger.warning("CPU kernels could not be built with [%s]: %s", " ".join(isa),
                           str(error).splitlines()[0] if str(error) else type(error).__name__)
    return False


@functools.cache
def _gcc_heap_flags() -> list[str]:
    """GCC collects its garbage whenever its heap has grown by a fraction since the last
    time; a unit of these kernels peaks near 1 GB, and those collections took 0.5-0.9 s of
    each unit's 12 s on a 2-core Xeon. Let it grow instead (about 150 MB more per unit).
    Only for GCC: clang takes no such parameters."""
    compiler = os.environ.get("CXX", "c++")  # the compiler torch's build runs
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    if "Free Software Foundation" not in version or "clang" in version.lower():
        return []
    return ["--param", "ggc-min-expand=10000", "--param", "ggc-min-heapsize=4194304"]


def build_directory(name: str) -> Path:
    """Where torch would build `name`: under TORCH_EXTENSIONS_DIR, else torch's cache folder
    for this Python (CPU kernels: the same folder whatever torch's accelerator)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        version = f"py{sys.version_info.major}{sys.version_info.minor}{sys.abiflags}"
        root = os.path.join(get_default_build_root(), f"{version}_cpu")
    return Path(root) / name


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[Path]:
    """Held while torch builds or loads the kernels in `folder`. torch's own lock is a file
    that a build killed half-way (Ctrl-C during a first start) leaves behind, and every later
    start then waits on it forever. This lock is an flock, which the kernel releases with
    its holder's death: whoever holds it is the only pagellm process building here, so a
    torch lock file found then is stale and removed."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "pagellm.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale.exists():
                logger.warning("Removing %s, left by a kernel build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield folder
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_AMX_INT8_FLAGS = ("-mamx-tile", "-mamx-int8")
_AMX_BF16_FLAG = "-mamx-bf16"
_AMX_FLAGS = (*_AMX_INT8_FLAGS, _AMX_BF16_FLAG)


def _isa_flags(capability: str) -> list[str]:
    """torch's instruction sets for this CPU, plus clflushopt, AVX512-VNNI, AVX512-BF16 and
    AMX's int8 and bf16 tiles where the CPU has them."""
    flags = _ISA_FLAGS.get(capability, [])
    if flags and _cpu_has("clflushopt"):
        flags = [*flags, "-mclflushopt"]
    if capability == "AVX512" and _cpu_has("avx512_vnni"):
        flags = [*flags, "-mavx512vnni"]
    if capability == "AVX512" and _cpu_has("avx512_bf16"):
        flags = [*flags, "-mavx512bf16"]
    if capability == "AVX512" and _cpu_has("amx_tile") and _cpu_has("amx_int8"):
        flags = [*flags, *_AMX_INT8_FLAGS]
        if _cpu_has("amx_bf16") and "-mavx512bf16" in flags:
            flags.append(_AMX_BF16_FLAG)
    return flags


def _cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists this CPU flag (Linux; False elsewhere)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and flag in line.split() for line in info.splitlines())


def _build_digest(isa: list[str]) -> str:
    """Part of the build's name, which changes with any source, header or instruction set
    flag, so that a library found under it is current and loads without torch's build step.
    The checkout's path counts too: torch's build file records the include path, and two
    checkouts sharing one name would rebuild each other's kernels at every start."""
    digest = hashlib.sha256(str(_HERE.resolve()).encode())
    digest.update(" ".join(isa).encode())
    for path in [*_SOURCES, *_HEADERS]:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _load_built(library: Path) -> bool:
    """Load the library a finished build left here; False where there is none, or where it
    does not load (a build killed while linking): then it is built again."""
    if not library.is_file():
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError:
        return False
    return True


def _write_units(folder: Path, units: tuple[tuple[str, ...], ...]) -> list[str]:
    """The translation units, written (only when changed, so that ninja sees no new input)
    into the build folder."""
    paths = []
    for index, unit in enumerate(units):
        path = folder / f"unit_{index}.cpp"
        text = "".join(f'#include "{name}"\n' for name in unit)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
        paths.append(str(path))
    return paths


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, window: int = 0) -> torch.Tensor:
    """query [N, H, D] (one token per request) -> [N, H * D], keys read in place from the cache
    (with a `window`, each query's last `window` keys only)."""
    _require_on_demand_kernels("paged_decode_attention")
    query = query.contiguous()
    out = torch.empty_like(query)
    torch.ops.pagellm.paged_decode_attention(out, query, kv_cache, block_tables, seq_lens, scale,
                                             window)
    return out.view(query.shape[0], -1)


def write_kv_cache(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """key, value [T, KVH, D] (rows contiguous) -> their slots of kv_cache [2, KVH, blocks,
    block_size, D], rounded to its dtype."""
    torch.ops.pagellm.write_kv_cache(kv_cache, key, value, slot_mapping)


def _require_on_demand_kernels(op: str) -> None:
    if not on_demand_kernels_available():
        raise RuntimeError(f"pagellm's CPU kernel {op} could not be built on this machine "
                           "(see the warning above); the default path does not need it")


def use_cpu_kernels(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and cpu_kernels_available()


def rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """x [T, size] = rms_norm(x) * weight, in place."""
    torch.ops.pagellm.rms_norm(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> None:
    """residual += x, then x = rms_norm(residual) * weight; both in place, both [T, size]."""
    torch.ops.pagellm.add_rms_norm(x, residual, weight, eps)


def rotary_embedding_(x: torch.Tensor, angles: torch.Tensor) -> None:
    """Rotate x [T, heads, dim] in place by angles [T, dim] float32 (cos half, then sin half)."""
    torch.ops.pagellm.rotary_embedding(x, angles)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> silu(gate) * up [T, I]."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    torch.ops.pagellm.silu_and_mul(out, gate_up)
    return out


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> gelu(gate, approximate="tanh") * up [T, I]."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    torch.ops.pagellm.gelu_tanh_and_mul(out, gate_up)
    return out


def quantized_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor | None, bits: int, out_features: int,
                     panels_only: bool = False) -> torch.Tensor:
    """x [M, K] @ W^T with W held as per-32- or per-16-group codes (see quantized_linear.cpp)
    -> [M, N].
    `panels_only`: one order of sums at every M, so each row's result is batch-invariant."""
    _require_on_demand_kernels("quantized_linear")
    x = x.contiguous()
    out = x.new_empty(x.shape[0], out_features)
    empty = scales.new_empty(0)
    torch.ops.pagellm.quantized_linear(out, x, codes, scales, empty if zeros is None else zeros,
                                       bits, panels_only)
    return out


@functools.cache
def prefill_attention_available() -> bool:
    """Whether paged_prefill_attention was compiled: it needs AVX2 and FMA."""
    return cpu_kernels_available() and hasattr(torch.ops.pagellm, "paged_prefill_attention")


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_starts: torch.Tensor, query_lens: torch.Tensor,
                            num_queries: int, scale: float, window: int = 0) -> torch.Tensor:
    """Causal attention of each request's chunk (query_lens[n] rows of query [T, H, D] from
    query_starts[n], at the last positions of its seq_lens[n]) over its cached keys (with a
    `window`, each query's last `window` keys only) -> [num_queries, H * D], the chunks one
    after another, in query's dtype."""
    out = query.new_empty(num_queries, query.shape[1] * query.shape[2], dtype=torch.float32)
    torch.ops.pagellm.paged_prefill_attention(out, query.float(), kv_cache, block_tables,
                                              seq_lens, query_starts, query_lens, scale, window)
    return out.to(query.dtype)


@functools.cache
def decode_attention_invariant_available() -> bool:
    """Whether paged_decode_attention_invariant was compiled: it needs AVX2 and FMA."""
    return (cpu_kernels_available()
            and hasattr(torch.ops.pagellm, "paged_decode_attention_invariant"))


def paged_decode_attention_invariant(query: torch.Tensor, kv_cache: torch.Tensor,
                                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                     scale: float, window: int = 0) -> torch.Tensor:
    """query [N, H, D] (one token per request, D a multiple of 16) -> [N, H * D], bit-identical
    to paged_prefill_attention's rows for the same tokens (the batch-invariant engine's
    decode-only steps), and faster: its lanes hold keys or dims, not the few query heads of a
    kv head."""
    out = query.new_empty(query.shape[0], query.shape[1] * query.shape[2], dtype=torch.float32)
    torch.ops.pagellm.paged_decode_attention_invariant(out, query.float(), kv_cache,
                                                       block_tables, seq_lens, scale, window)
    return out.to(query.dtype)


@functools.cache
def int8_matmul_available() -> bool:
    """Whether quantized_linear_int8 was compiled: it needs AVX2 (vpmaddubsw)."""
    return cpu_kernels_available() and hasattr(torch.ops.pagellm, "quantized_linear_int8")


def quantized_linear_int8(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor,
                          zeros: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] rounded to int8 per 32 inputs @ W^T, W's 4-bit (uint8 panels, a code or two
    per byte) or 8-bit (int8 panels) codes in the kernel's layout (see
    quantized_linear_int8.cpp) -> [M, N]."""
    x = x.contiguous()
    out = x.new_empty(x.shape[0], out_features)
    torch.ops.pagellm.quantized_linear_int8(out, x, panels, scales, zeros)
    return out


@functools.cache
def bf16_tiles_available() -> bool:
    """Whether quantized_linear_bf16_tiles was compiled (AMX-BF16) and the OS grants the
    tiles (and PAGELLM_AMX is not 0)."""
    return (on_demand_kernels_available()
            and hasattr(torch.ops.pagellm, "bf16_tiles_permitted")
            and torch.ops.pagellm.bf16_tiles_permitted())


def quantized_linear_bf16_tiles(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor,
                                zeros: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] bf16 @ W^T, W's 4-bit (uint8) or 8-bit (int8) codes in the kernel's tiles (see
    quantized_linear_bf16_amx.cpp) widened to bf16 -> [M, N] bf16."""
    x = x.contiguous()
    out = x.new_empty(x.shape[0], out_features)
    torch.ops.pagellm.quantized_linear_bf16_tiles(out, x, panels, scales, zeros)
    return out


def evict_from_cache(tensors: Iterable[torch.Tensor]) -> None:
    """Flush these CPU tensors' bytes (oneDNN's packed ones too) from the caches (see
    cache_eviction.cpp); nothing where the op was not built."""
    if not (on_demand_kernels_available() and hasattr(torch.ops.pagellm, "evict_from_cache")):
        return
    starts, sizes = [], []
    for t in tensors:
        if t.device.type != "cpu":
            continue
        if t.layout == torch._mkldnn:  # type: ignore[attr-defined]
            starts.append(torch.ops.mkldnn.data_ptr(t))
            sizes.append(torch.ops.mkldnn._nbytes(t))
        else:
            starts.append(t.data_ptr())
            sizes.append(t.numel() * t.element_size())
    torch.ops.pagellm.evict_from_cache(starts, sizes)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (float32, bf16 or fp16) -> [R] int64, as logits.argmax(dim=-1) (first of
    ties, NaN wins)."""
    if not (use_cpu_kernels(logits) and logits.dim() == 2 and logits.is_contiguous()
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    torch.ops.pagellm.argmax_rows(out, logits)
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None,
                        out: torch.Tensor) -> None:
    """out = logits [R, V] (float32, bf16 or fp16, contiguous) with -inf where a row's int32
    bitmask [G, ceil(V / 32)] has a 0 bit; `rows`: the logits row of each bitmask row (None:
    bitmask row r is row r). `out` may be `logits` itself (in place)."""
    if rows is None:
        rows = torch.arange(bitmask.shape[0], dtype=torch.int64)
    torch.ops.pagellm.apply_token_bitmask(out, logits, bitmask, rows)


def subtract_log_exponential_(logits: torch.Tensor, keys: torch.Tensor) -> None:
    """logits [R, V] float32 -= log(q), q ~ Exp(1) hashed from each row's key (see noise.py)."""
    torch.ops.pagellm.subtract_log_exponential(logits, keys)
