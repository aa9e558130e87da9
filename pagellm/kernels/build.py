"""How the CPU kernels are built: which files, with which flags, into which library.

Each library is built through `torch.utils.cpp_extension` into torch's extension cache,
under a name that changes with any source, flag or unit layout; a later start finds it
there and loads it without torch's build step.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from pagellm.logger import init_logger

logger = init_logger(__name__)

_HERE = Path(__file__).parent
# Compiled as two translation units side by side, each including its kernel files: torch's
# headers are parsed once per unit instead of once per file, and the two units build at
# once on two cores. Every file keeps its internals in a namespace of its own
# (pagellm::kernels::<file> or pagellm::quantized::<kind>) so that they can share one. The
# default serving path's kernels are one library, built at a first start; those only some
# configurations call are another, built when one first needs them (ON_DEMAND_UNITS). The
# int8 kernel, its AMX form and the attention kernels (the prefill one and the invariant
# decode one) include none of torch's headers (their ops, which check the tensors and hand
# their pointers over, are the *_op.cpp files of the other unit), and the ops use torch's
# stable ABI (stable_ops.h), whose headers parse in 2 s where torch/library.h took 6. Each
# template instantiation costs a first start seconds: the kernels instantiate only what this
# CPU runs (the int8 kernel's instructions of one instruction set), what changes their
# arithmetic (attention computes float32 queries; the wrappers widen others), the default
# configurations' KV caches (float32 and bf16; see tensor_dispatch.h's dispatch_cache_dtype)
# and the int8 forms of Q4_0, Q4_1 and Q8_0 (quantized_linear.h; K-quants' are
# INT8_FORMS_UNITS'). On a 2-core AMD EPYC, each unit alone: the ops' 6.0 s, the kernels'
# 5.1 s (they were 6.9 and 8.3 s with every int8 form and the prefill kernel among the ops).
DEFAULT_UNITS = (
    ("prefill_attention_op.cpp", "write_kv.cpp", "rotary_embedding.cpp", "activation.cpp",
     "argmax.cpp", "rms_norm.cpp", "token_mask.cpp", "decoder_layer.cpp", "sampling_noise.cpp",
     "quantized_linear_int8_op.cpp", "decode_attention_invariant_op.cpp"),
    ("quantized_linear_int8.cpp", "quantized_linear_amx.cpp", "decode_attention_invariant.cpp",
     "prefill_attention.cpp"),
)
# The decode attention of --no-batch-invariant (paged_attention), the batch-invariant
# attention and cache writes again for fp16 and fp8 caches (built with
# PAGELLM_OTHER_CACHE_DTYPES, as the ops named *_other_caches), the quantized matmul with
# float activations (--no-gguf-int8-activations, --dtype float32), AMX's bf16 tiles (bf16
# models) and the cache eviction that timing the quantized forms needs (a projection that
# measures its forms, off the batch-invariant path): compiler time no default path needs.
ON_DEMAND_UNITS = (
    ("paged_attention.cpp", "prefill_attention.cpp", "prefill_attention_op.cpp"),
    ("decode_attention_invariant.cpp", "decode_attention_invariant_op.cpp", "write_kv.cpp",
     "quantized_linear.cpp",
     "quantized_linear_bf16_amx.cpp", "cache_eviction.cpp"),
)
ON_DEMAND_DEFINES = ("PAGELLM_OTHER_CACHE_DTYPES",)
# The int8 matmul's forms with float32 factors (K-quants', Q6_K's groups of 16 among them;
# quantized_linear.h), as the op quantized_linear_int8_other_forms: a library of its own,
# small enough not to hold up a first start of a K-quant model much (the on-demand one takes
# 14 s on 2 cores).
INT8_FORMS_UNITS = (("quantized_linear_int8.cpp", "quantized_linear_amx.cpp"),
                    ("quantized_linear_int8_op.cpp",))
INT8_FORMS_DEFINES = ("PAGELLM_OTHER_INT8_FORMS",)
_SOURCES = sorted({_HERE / name for unit in (*DEFAULT_UNITS, *ON_DEMAND_UNITS)
                   for name in unit})  # INT8_FORMS_UNITS' are among them
# Every header here, so that a new one counts in the build's name without a list to extend.
_HEADERS = sorted(_HERE.glob("*.h"))
# -fopenmp: at::parallel_for is inline OpenMP, serial without it; the runtime it links is the
# libgomp.so.1 torch has already loaded. -fno-trapping-math (torch builds with it too): with
# FP traps assumed, GCC keeps any loop holding a float comparison scalar on AVX2, such as
# exp's clamp in every softmax and SiLU loop; it changes no rounding. Instruction sets:
# those of the kernels torch itself dispatches to on this CPU.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


def build_library(prefix: str, units: tuple[tuple[str, ...], ...],
                  defines: tuple[str, ...] = ()) -> bool:
    """Load the library of these units built for this CPU, building it first where it is not
    there (with AMX's flags, then without them for a compiler that lacks them)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = _isa_flags(capability)
    without_amx = [flag for flag in flags if flag not in _AMX_FLAGS]
    macros = [f"-D{define}" for define in defines]
    for attempt, isa in enumerate([flags] if without_amx == flags else [flags, without_amx]):
        digest = _build_digest([*isa, *macros], units)
        name = f"{prefix}_{capability.lower()}_{digest}_{attempt}"
        try:
            with build_lock(build_directory(name)) as folder:
                if not _load_built(folder / f"{name}.so"):
                    from torch.utils.cpp_extension import load

                    logger.info("Compiling %s (once per machine)",
                                ", ".join(file for unit in units for file in unit))
                    load(name=name, sources=_write_units(folder, units),
                         extra_include_paths=[str(_HERE)], build_directory=str(folder),
                         extra_cflags=["-O3", "-fopenmp", "-fno-trapping-math", "-fno-math-errno",
                                       *_gcc_heap_flags(), *isa, *macros],
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


def _build_digest(flags: list[str], units: tuple[tuple[str, ...], ...]) -> str:
    """Part of the build's name, which changes with any source, header, flag or unit layout,
    so that a library found under it is current and loads without torch's build step.
    The checkout's path counts too: torch's build file records the include path, and two
    checkouts sharing one name would rebuild each other's kernels at every start."""
    digest = hashlib.sha256(str(_HERE.resolve()).encode())
    digest.update(" ".join(flags).encode())
    digest.update(repr(units).encode())
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
