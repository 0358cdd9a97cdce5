"""The int4 formats' kernels in each ISA build (csrc/qgemm.cpp, paged_attention.cpp's float32 form,
decode_layers.cpp; cpu_kernels.load_int4_kernels picks): the AVX2 build's int4_mm / int8_mm give the bits of the
plain-loop reference over random shapes (odd row counts, odd multiples of 16 outputs and 32 inputs), at the
extremes where vpmaddubsw would saturate if the operands were chosen badly, and the bits of the AVX-512 build
where this CPU has it, the decode attention and the whole decoder included; the tier the Python side chose
reaches the C++ dispatch (set_kernel_tier)."""

from __future__ import annotations

import pytest
import torch

from prefixcache.layers.quant import quantize_weight_group_int8, quantize_weight_int4
from tests.kernels.paged_inputs import random_paged_decode_inputs

AVX2 = pytest.mark.requires_isa("avx2")
AVX512 = pytest.mark.requires_isa("avx512")
SHAPES = [(1, 16, 32), (3, 48, 96), (5, 80, 160), (7, 16, 288), (4, 144, 64), (9, 32, 576)]  # rows, out, in


def _avx2():
    from prefixcache.kernels.avx2_kernels import load_avx2_kernels

    return load_avx2_kernels()


def _avx512():
    from prefixcache.kernels.cpu_kernels import load_cpu_kernels

    return load_cpu_kernels()


def _case(m, n, k, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = (torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 3).to(dtype)
    bias = torch.randn(n, generator=g)
    return w, x, bias


def _products(kernels, x, w4, w8, bias, out_dtype):
    """int4_mm with and without bias, int8_mm: the same call in any build."""
    return [kernels.int4_mm(x, w4.packed, w4.scale, w4.min, bias, out_dtype),
            kernels.int4_mm(x, w4.packed, w4.scale, w4.min, None, out_dtype),
            kernels.int8_mm(x, w8.packed, w8.scale, w8.correction, None, out_dtype)]


def _references(kernels, x, w4, w8, bias, out_dtype):
    return [kernels.int4_mm_reference(x, w4.packed, w4.scale, w4.min, bias, out_dtype),
            kernels.int4_mm_reference(x, w4.packed, w4.scale, w4.min, None, out_dtype),
            kernels.int8_mm_reference(x, w8.packed, w8.scale, None, out_dtype)]


def _bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32),
                           y.view(torch.int16 if y.dtype == torch.bfloat16 else torch.int32)) for x, y in zip(a, b))


@AVX2
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_the_avx2_build_gives_the_references_bits(m, n, k, x_dtype, out_dtype):
    w, x, bias = _case(m, n, k, seed=m * 1000 + n + k, dtype=x_dtype)
    w4, w8 = quantize_weight_int4(w, bias), quantize_weight_group_int8(w)
    kernels = _avx2()
    got = _products(kernels, x, w4, w8, bias, out_dtype)
    assert _bitwise_equal(got, _references(kernels, x, w4, w8, bias, out_dtype))
    assert got[0].shape == (m, n) and got[0].dtype == out_dtype and torch.isfinite(got[0]).all()


@AVX2
def test_the_avx2_build_is_exact_at_the_operands_extremes():
    """Every level 15 (int4) or +-127 (int8) times every activation +-127: the largest pair sums vpmaddubsw
    sees (3,810 per int4 pair, 30,480 per int16 lane over a group; 32,258 per int8 pair), which a saturating
    int16 would cut (qgemm.cpp's header)."""
    n, k = 32, 128
    w4_levels = torch.full((n, k), 15.0)
    w4_levels[:, 0::32] = 0.0  # each group spans 0..15: every other level is 15
    w8_levels = torch.where(torch.arange(k) % 3 == 0, -127.0, 127.0).expand(n, k).clone()
    x = torch.cat([torch.full((1, k), 3.0), torch.full((1, k), -3.0), torch.where(torch.arange(k) % 2 == 0, 5.0, -5.0)[None]])
    kernels = _avx2()
    w4, w8 = quantize_weight_int4(w4_levels * 0.01), quantize_weight_group_int8(w8_levels * 0.01)
    got = _products(kernels, x, w4, w8, None, torch.float32)
    assert _bitwise_equal(got, _references(kernels, x, w4, w8, None, torch.float32))
    # and the exact values: x's groups quantize to +-127 exactly, the weights to their levels
    expected8 = x @ (w8.scale.float().transpose(1, 2).reshape(n, -1).repeat_interleave(32, 1) * w8_levels).t()
    assert torch.allclose(got[2], expected8, rtol=1e-5)


@AVX512
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
def test_the_avx2_and_avx512_builds_give_the_same_bits(m, n, k, x_dtype, out_dtype):
    w, x, bias = _case(m, n, k, seed=7 * m + n + k, dtype=x_dtype)
    w4, w8 = quantize_weight_int4(w, bias), quantize_weight_group_int8(w)
    avx2 = _products(_avx2(), x, w4, w8, bias, out_dtype)
    avx512 = _products(_avx512(), x, w4, w8, bias, out_dtype)
    assert _bitwise_equal(avx2, avx512)
    assert _bitwise_equal(avx512, _references(_avx512(), x, w4, w8, bias, out_dtype))


@pytest.fixture
def avx512_capped_to(request):
    """The AVX-512 build told a lower tier for the test (set_kernel_tier), its own tier restored after."""
    from prefixcache.kernels.cpu_features import TIERS, kernel_tier

    kernels = _avx512()
    yield lambda tier: kernels.set_kernel_tier(list(TIERS).index(tier))
    kernels.set_kernel_tier(list(TIERS).index(kernel_tier()))


def _attention_case(seed, lens, heads=6, kv_heads=2, head_dim=64, block=16):
    return (*random_paged_decode_inputs(seed, lens, heads, kv_heads, head_dim, block), block)


@AVX512
def test_decode_attention_float32_form_has_the_same_bits_in_both_builds_and_the_cap_reaches_cpp(avx512_capped_to):
    """Rows of 1 to 2,100 keys (several 1,024-key segments, partial blocks): the AVX2 build (float32 form only)
    equals the AVX-512 build's float32 form, and the AVX-512 build's default entry point takes that form too
    once told the tier is below AVX512-BF16 (PREFIXCACHE_KERNELS=avx512), whatever __builtin_cpu_supports says."""
    q, k, v, table, lens, block = _attention_case(3, [1, 17, 100, 1025, 2100])
    args = (q, k, v, table, lens, block, 0.125)
    avx2 = _avx2().paged_decode_attention(*args)
    assert torch.equal(avx2.view(torch.int16), _avx512().paged_decode_attention_float32(*args).view(torch.int16))
    avx512_capped_to("avx512")
    assert torch.equal(avx2.view(torch.int16), _avx512().paged_decode_attention(*args).view(torch.int16))


@AVX2
def test_load_int4_kernels_picks_the_best_build_the_tier_allows():
    from prefixcache.kernels.cpu_features import cpu_has
    from prefixcache.kernels.cpu_kernels import int4_kernels_build, load_int4_kernels

    build = int4_kernels_build()
    assert build == ("avx512" if cpu_has("avx512_vnni", "avx512bw") else "avx2")
    assert hasattr(load_int4_kernels(), "DecodeLayers") and load_int4_kernels().compiler()


@AVX2
@pytest.mark.parametrize("build", ["avx2", pytest.param("avx512", marks=AVX512)])
def test_products_and_references_refuse_a_malformed_weight_with_its_name(build):
    """The products and their plain-loop references share their checks: a packed weight of the wrong layout,
    scales or mins of the wrong shape, a wrong int8 correction or an input width off the 32-input groups is a
    RuntimeError naming the tensor, never a read past the buffers."""
    kernels = _avx2() if build == "avx2" else _avx512()
    w, x, _ = _case(3, 48, 96, seed=5)
    w4, w8 = quantize_weight_int4(w, None), quantize_weight_group_int8(w)
    f32 = torch.float32
    for int4 in (kernels.int4_mm, kernels.int4_mm_reference):
        with pytest.raises(RuntimeError, match="packed must be contiguous uint8"):
            int4(x, w4.packed[:, :-1], w4.scale, w4.min, None, f32)
        with pytest.raises(RuntimeError, match="min must be contiguous"):
            int4(x, w4.packed, w4.scale, w4.min[:, :-1], None, f32)
        with pytest.raises(RuntimeError, match="scale must be contiguous"):
            int4(x, w4.packed, w4.scale.float(), w4.min, None, f32)
        with pytest.raises(RuntimeError, match="K % 32 == 0"):
            int4(x[:, :40], w4.packed, w4.scale, w4.min, None, f32)
    with pytest.raises(RuntimeError, match="packed must be contiguous int8"):
        kernels.int8_mm_reference(x, w8.packed.view(torch.uint8), w8.scale, None, f32)
    with pytest.raises(RuntimeError, match="packed must be contiguous int8"):
        kernels.int8_mm(x, w8.packed[:, :-1], w8.scale, w8.correction, None, f32)
    with pytest.raises(RuntimeError, match="corr must be contiguous"):
        kernels.int8_mm(x, w8.packed, w8.scale, w8.correction.float(), None, f32)
    with pytest.raises(RuntimeError, match="bias must be contiguous float32"):
        kernels.int8_mm(x, w8.packed, w8.scale, w8.correction, torch.zeros(47), f32)
