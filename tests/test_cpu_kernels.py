"""The compiled CPU kernels (RMSNorm, fused add + RMSNorm, rotary, SwiGLU activation, argmax,
KV cache writes) against the torch ops they replace, and the sampler's noise. (The paged
decode attention kernel is tested in test_attention.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagellm.kernels import argmax_rows, cpu_kernels_available, silu_and_mul, write_kv_cache
from pagellm.model import layers
from pagellm.model.attention import write_kv_with_torch_ops
from pagellm.model.layers import RMSNorm, RotaryEmbedding, rotate_
from pagellm.sample import noise, sampler
from pagellm.sample.metadata import TokenMaskMetadata

pytestmark = pytest.mark.skipif(not cpu_kernels_available(),
                                reason="no C++ compiler: the CPU kernels could not be built")
DTYPES = [torch.float32, torch.bfloat16]
# float32: summation order only; bf16: at most one rounding step of the output apart
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=0, rtol=2 ** -7)}


@pytest.fixture
def torch_ops(monkeypatch: pytest.MonkeyPatch):
    """Call the returned function to switch the layers to their torch path."""
    return lambda: monkeypatch.setattr(layers, "use_cpu_kernels", lambda x: False)


def make_norm(size: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(size, 1e-5).to(dtype)
    norm.weight.data = torch.randn(size, generator=torch.Generator().manual_seed(1)).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch(dtype: torch.dtype, torch_ops) -> None:
    norm = make_norm(96, dtype)
    x = (torch.randn(7, 96) * 3).to(dtype)
    kept = x.clone()
    fused = norm(x)
    assert torch.equal(x, kept)  # without a residual the input is left alone
    torch_ops()
    torch.testing.assert_close(fused, norm(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_torch(dtype: torch.dtype, torch_ops) -> None:
    norm = make_norm(64, dtype)
    x, residual = torch.randn(5, 64).to(dtype), (torch.randn(5, 64) * 4).to(dtype)
    fused, fused_sum = norm(x.clone(), residual.clone())
    torch_ops()
    expected, expected_sum = norm(x, residual)
    assert torch.equal(fused_sum, expected_sum)  # the running sum is rounded like torch's add
    torch.testing.assert_close(fused, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_a_strided_view_matches_torch(dtype: torch.dtype, torch_ops) -> None:
    """Queries and keys rotated together inside a fused QKV output; values untouched."""
    heads, kv_heads, dim = 4, 2, 16
    rope = RotaryEmbedding(dim, 64, 10000.0, None)
    angles = rope(torch.tensor([0, 5, 17, 63]))
    qkv = torch.randn(4, (heads + 2 * kv_heads) * dim).to(dtype)
    original, expected = qkv.clone(), qkv.clone()
    rotate_(qkv[:, :(heads + kv_heads) * dim].view(4, -1, dim), angles)
    torch_ops()
    rotate_(expected[:, :(heads + kv_heads) * dim].view(4, -1, dim), angles)
    torch.testing.assert_close(qkv, expected, **TOLERANCE[dtype])
    assert torch.equal(qkv[0], original[0])  # position 0: the identity rotation
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], original[:, (heads + kv_heads) * dim:])
    assert not torch.allclose(qkv[1:], original[1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype: torch.dtype, torch_ops) -> None:
    mlp = layers.GatedMLP(32, 48).to(dtype)
    x = (torch.randn(6, 32) * 2).to(dtype)
    with torch.no_grad():
        mlp.down_proj.weight.copy_(torch.eye(32, 48))  # keep the activation's first 32 values
        fused = mlp(x)
        torch_ops()
        expected = mlp(x)
    assert (fused != 0).any()
    torch.testing.assert_close(fused, expected, **TOLERANCE[dtype])


def test_silu_and_mul_is_finite_at_extremes() -> None:
    gate = torch.tensor([[-1000.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 1000.0]])
    up = torch.full_like(gate, 2.0)
    out = silu_and_mul(torch.cat([gate, up], dim=1))
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-6, rtol=1e-6)


def test_sampling_noise_matches_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused hash-and-subtract kernel gives the torch path's noise (two logs apart) and
    the same sampled tokens; zero logits expose the noise over the whole range of u."""
    keys = torch.tensor([0, 1, 0xFFFFFFFF, 0x9E3779B9, 12345], dtype=torch.int64)
    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(0))
    for base in (torch.zeros_like(logits), logits):
        fused = noise.subtract_noise_(base.clone(), keys)
        with monkeypatch.context() as patch:
            patch.setattr(noise, "use_cpu_kernels", lambda x: False)
            reference = noise.subtract_noise_(base.clone(), keys)
        torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)
        assert torch.equal(fused.argmax(dim=-1), reference.argmax(dim=-1))
    spread = noise.subtract_noise_(torch.zeros(1, 1 << 16), keys[:1])
    assert spread.min() < -2 and spread.max() > 8  # -log(-log u) for u near 0, and near 1


def _random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Random words, with whole words of 0 and of -1 (the kernel's fill and copy paths)."""
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(-2 ** 31, 2 ** 31, (rows, -(-vocab // 32)), dtype=torch.int64,
                          generator=generator).to(torch.int32)
    kind = torch.randint(0, 4, words.shape, generator=generator)
    return words.masked_fill(kind == 0, 0).masked_fill(kind == 1, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 31, 32, 70, 1000, 49152])
@pytest.mark.parametrize("masked_rows", [None, [0, 3, 4], [5]])
def test_token_mask_kernel_equals_the_torch_path(monkeypatch: pytest.MonkeyPatch,
                                                 dtype: torch.dtype, vocab: int,
                                                 masked_rows: list[int] | None) -> None:
    """Bit for bit the torch path's result (unpack, then masked_fill) on random bitmasks: every
    row masked, some rows without a mask, one row only; vocabularies not a multiple of 32; NaN and
    infinities kept where allowed. Out of place the logits are untouched; in place equal."""
    logits = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab)) * 8).to(dtype)
    logits[1, 0] = float("nan")
    logits[2, -1] = float("inf")
    count = 6 if masked_rows is None else len(masked_rows)
    mask = TokenMaskMetadata(
        rows=None if masked_rows is None else torch.tensor(masked_rows, dtype=torch.long),
        bitmask=_random_bitmask(count, vocab, seed=vocab + count))
    before = logits.clone()
    fused = sampler.apply_token_mask(logits, mask)
    assert torch.equal(logits.view(torch.uint8), before.view(torch.uint8))
    with monkeypatch.context() as patch:
        patch.setattr(sampler, "use_cpu_kernels", lambda x: False)
        reference = sampler.apply_token_mask(logits, mask)
    assert torch.equal(fused.view(torch.uint8), reference.view(torch.uint8))
    in_place = logits.clone()
    assert sampler.apply_token_mask(in_place, mask, in_place=True) is in_place
    assert torch.equal(in_place.view(torch.uint8), reference.view(torch.uint8))


def test_token_mask_kernel_rejects_a_row_outside_the_logits() -> None:
    logits = torch.zeros(2, 40)
    mask = TokenMaskMetadata(rows=torch.tensor([2]), bitmask=torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="outside the logits"):
        sampler.apply_token_mask(logits, mask)
    with pytest.raises(RuntimeError, match="32 \\* W >= vocab"):
        sampler.apply_token_mask(logits, TokenMaskMetadata(
            rows=None, bitmask=torch.zeros(2, 1, dtype=torch.int32)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_matches_torch_on_ties_infinities_and_nan(dtype: torch.dtype) -> None:
    """First index of the largest value, as torch answers: ties inside and across the
    kernel's chunks of 64, rows of -inf, and NaN (which torch ranks above everything). In
    the model's dtypes too: a greedy step takes the argmax of bf16 logits as they are."""
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(2)).to(dtype)
    logits[1, [5, 700]] = 50.0  # tie, chunks apart
    logits[2, [130, 131]] = 50.0  # tie within a chunk
    logits[3] = float("-inf")
    logits[4, 999] = float("inf")
    logits[5, [10, 600]] = float("nan")
    logits[6, 0] = 50.0  # first index
    logits[7, 63:66] = 50.0  # tie across a chunk boundary
    assert argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert argmax_rows(logits).tolist() == [int(logits[0].argmax()), 5, 130, 0, 999, 10, 0, 63]


@pytest.mark.parametrize("model_dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16,
                                         torch.float8_e4m3fn, torch.float8_e5m2])
def test_kv_cache_write_matches_torch_exactly(model_dtype: torch.dtype,
                                                  cache_dtype: torch.dtype) -> None:
    """Keys and values as the model hands them over (views into the fused QKV output) land
    in their slots with the torch path's rounding (NaN payloads aside): fp8 saturating, NaN
    kept, other slots untouched."""
    tokens, kv_heads, dim, blocks, block = 37, 3, 64, 16, 4
    qkv = (torch.randn(tokens, (2 + 2 * kv_heads) * dim) * 4).to(model_dtype)
    qkv[0, 2 * dim] = 1e5  # past every fp8 format's largest finite value
    qkv[1, 2 * dim + 1] = -1e5
    qkv[2, (2 + kv_heads) * dim + 5] = float("nan")
    heads = qkv.view(tokens, -1, dim)
    key, value = heads[:, 2:2 + kv_heads], heads[:, 2 + kv_heads:]
    slots = torch.randperm(blocks * block)[:tokens]
    expected = torch.randn(2, kv_heads, blocks, block, dim).to(cache_dtype)
    written = expected.clone()
    write_kv_with_torch_ops(expected, key, value, slots)
    write_kv_cache(written, key, value, slots)
    torch.testing.assert_close(written.float(), expected.float(), rtol=0, atol=0, equal_nan=True)
    cell = lambda kind, token, i: written[kind, 0, slots[token] // block,  # noqa: E731
                                          slots[token] % block, i].float()
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert cell(0, 0, 0) == torch.finfo(cache_dtype).max
        assert cell(0, 1, 1) == -torch.finfo(cache_dtype).max
    assert cell(1, 2, 5).isnan()


def test_kv_cache_write_rejects_a_slot_outside_the_cache() -> None:
    cache = torch.zeros(2, 1, 2, 4, 8)
    rows = torch.ones(1, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        write_kv_cache(cache, rows, rows, torch.tensor([8]))
    assert not cache.any()


def test_a_compiler_without_amx_flags_still_builds_the_rest(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path):
    """The first build (with AMX's flags) fails, the second leaves exactly those out."""
    import torch.utils.cpp_extension

    import pagellm.kernels as kernels
    from pagellm.kernels import build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))

    builds: list[list[str]] = []

    def load(**kwargs) -> None:
        builds.append(kwargs["extra_cflags"])
        if any(flag.startswith("-mamx") for flag in kwargs["extra_cflags"]):
            raise RuntimeError("c++: error: unrecognized command-line option '-mamx-tile'")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    monkeypatch.setattr(build, "_isa_flags", lambda capability: ["-mavx2", *build._AMX_FLAGS])
    assert kernels.cpu_kernels_available.__wrapped__()
    assert len(builds) == 2
    assert builds[0][-4:] == ["-mavx2", "-mamx-tile", "-mamx-int8", "-mamx-bf16"]
    assert builds[1] == builds[0][:-3]


def test_a_build_killed_half_way_does_not_block_the_next_start(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path):
    """torch's lock file, left by a build that was killed, is removed under pagellm's flock,
    so that torch builds instead of waiting for it forever."""
    import torch.utils.cpp_extension

    import pagellm.kernels as kernels
    from pagellm.kernels import build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_isa_flags", lambda capability: ["-mavx2"])
    built_in: list[Path] = []

    def load(**kwargs) -> None:
        folder = Path(kwargs["build_directory"])
        assert not (folder / "lock").exists()
        built_in.append(folder)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    capability = torch.backends.cpu.get_cpu_capability().lower()
    digest = build._build_digest(["-mavx2"], build.DEFAULT_UNITS)
    folder = tmp_path / f"pagellm_cpu_kernels_{capability}_{digest}_0"
    folder.mkdir()
    (folder / "lock").touch()
    assert kernels.cpu_kernels_available.__wrapped__()
    assert built_in == [folder]


def test_every_header_the_kernels_include_counts_in_the_builds_name():
    """A header left out of the build's name would leave a changed kernel unbuilt: the old
    library loads under the old name."""
    from pagellm.kernels import build

    folder = Path(build.__file__).parent
    included = {name for path in [*folder.glob("*.cpp"), *folder.glob("*.h")]
                for name in re.findall(r'#include "([^"]+\.h)"', path.read_text())}
    assert included
    assert included <= {path.name for path in build._HEADERS}


def test_a_built_library_loads_without_the_build_step(monkeypatch: pytest.MonkeyPatch):
    """A later start finds the library under its name (which changes with every source and
    flag) and loads it: torch's build step, and its setuptools import, are skipped."""
    import torch.utils.cpp_extension

    import pagellm.kernels as kernels

    if not kernels.cpu_kernels_available():
        pytest.skip("the CPU kernels do not build here")

    def load(**kwargs) -> None:
        raise AssertionError("built again")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    assert kernels.cpu_kernels_available.__wrapped__()


def test_a_library_that_does_not_load_is_built_again(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path):
    """A build killed while linking leaves a library that does not load: built again."""
    import torch.utils.cpp_extension

    import pagellm.kernels as kernels
    from pagellm.kernels import build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_isa_flags", lambda capability: ["-mavx2"])
    built: list[list[str]] = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load",
                        lambda **kwargs: built.append(kwargs["sources"]))
    capability = torch.backends.cpu.get_cpu_capability().lower()
    digest = build._build_digest(["-mavx2"], build.DEFAULT_UNITS)
    name = f"pagellm_cpu_kernels_{capability}_{digest}_0"
    (tmp_path / name).mkdir()
    (tmp_path / name / f"{name}.so").write_bytes(b"half a library")
    assert kernels.cpu_kernels_available.__wrapped__()
    assert built == [[str(tmp_path / name / "unit_0.cpp"), str(tmp_path / name / "unit_1.cpp")]]
    assert (tmp_path / name / "unit_0.cpp").read_text().startswith(
        '#include "prefill_attention_op.cpp"')


def test_kernels_no_default_path_calls_build_as_a_library_of_their_own(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A first start compiles the default path's kernels only; the plain paged decode
    attention, the attention and cache writes of fp16 and fp8 caches, the float-activation
    matmul, AMX's bf16 tiles and the cache eviction of the quantized forms' timing compile
    when a configuration first asks for them, as a second library; the int8 matmul's forms
    with float32 factors (K-quants') as a third."""
    import torch.utils.cpp_extension

    import pagellm.kernels as kernels
    from pagellm.kernels import build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_isa_flags", lambda capability: ["-mavx2"])
    built: list[dict] = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: built.append(kwargs))
    assert kernels.cpu_kernels_available.__wrapped__()
    monkeypatch.setattr(kernels, "cpu_kernels_available", lambda: True)
    assert kernels.on_demand_kernels_available.__wrapped__()
    assert kernels.int8_other_forms_available.__wrapped__()
    default, on_demand, int8_forms = ([Path(unit).read_text() for unit in build["sources"]]
                                      for build in built)
    assert not any(name in unit for unit in default
                   for name in ('"paged_attention.cpp"', '"quantized_linear.cpp"',
                                '"quantized_linear_bf16_amx.cpp"', '"cache_eviction.cpp"'))
    assert on_demand == ['#include "paged_attention.cpp"\n#include "prefill_attention.cpp"\n'
                         '#include "prefill_attention_op.cpp"\n',
                         '#include "decode_attention_invariant.cpp"\n'
                         '#include "decode_attention_invariant_op.cpp"\n#include "write_kv.cpp"\n'
                         '#include "quantized_linear.cpp"\n#include "quantized_linear_bf16_amx.cpp"\n'
                         '#include "cache_eviction.cpp"\n']
    assert int8_forms == ['#include "quantized_linear_int8.cpp"\n'
                          '#include "quantized_linear_amx.cpp"\n',
                          '#include "quantized_linear_int8_op.cpp"\n']
    assert "-DPAGELLM_OTHER_CACHE_DTYPES" not in built[0]["extra_cflags"]
    assert "-DPAGELLM_OTHER_CACHE_DTYPES" in built[1]["extra_cflags"]
    int8_define = ["-DPAGELLM_OTHER_INT8_FORMS" in build["extra_cflags"] for build in built]
    assert int8_define == [False, False, True]
    assert Path(built[1]["sources"][0]).parent.name.startswith("pagellm_cpu_kernels_on_demand_")


def test_the_default_librarys_kernel_unit_parses_no_tensor_header():
    """The int8 kernels and the attention kernels (prefill, invariant decode) compile in a
    unit of their own without torch's tensor and registration headers (3-4 s of a unit's
    compile); their ops are in the other unit. Every file that unit includes, directly or
    through pagellm's own headers, stays clear of them."""
    import re

    from pagellm.kernels import build

    def includes(name: str) -> set[str]:
        text = (build._HERE / name).read_text()
        local = re.findall(r'#include "([^"]+)"', text)
        return set(re.findall(r"#include <([^>]+)>", text)).union(
            *(includes(header) for header in local))

    kernels_unit = build.DEFAULT_UNITS[1]
    assert {"decode_attention_invariant.cpp", "prefill_attention.cpp"} <= set(kernels_unit)
    for name in kernels_unit:
        assert not includes(name) & {"ATen/core/Tensor.h", "torch/library.h", "torch/extension.h",
                                     "ATen/ATen.h"}, name


@pytest.mark.skipif(not cpu_kernels_available(), reason="the CPU kernels do not build here")
def test_each_library_writes_its_own_cache_dtypes_and_names_the_other_for_the_rest():
    """The default library holds float32 and bf16 caches, the on-demand one fp16 and fp8 (the
    wrappers choose; test_kv_cache_write_matches_torch_exactly covers every dtype through
    them); called directly with the other's, each op says where the dtype lives."""
    import pagellm.kernels as kernels

    assert kernels.on_demand_kernels_available()
    rows, slots = torch.randn(3, 2, 16), torch.tensor([0, 1, 2])
    fp16_cache = torch.zeros(2, 2, 1, 4, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="needs the on-demand library"):
        torch.ops.pagellm.write_kv_cache(fp16_cache, rows, rows, slots)
    bf16_cache = torch.zeros(2, 2, 1, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="belongs to the default library"):
        torch.ops.pagellm.write_kv_cache_other_caches(bf16_cache, rows, rows, slots)
    assert not fp16_cache.any() and not bf16_cache.any()
