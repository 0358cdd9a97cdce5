"""Our two int8 GEMMs for CPUs without AVX512-VNNI or AMX-INT8 (prefixcache/kernels/csrc/int8_gemm_avx2.cpp, AVX2
vpmaddwd; int8_gemm_vnni.cpp, AVX-VNNI vpdpbusd; int8_gemm_common.h, what they share): torch._int_mm's exact int32
sums, whatever the shape, the values or the rows sharing the call; the rescaled form int8_rows_to_float_torch's
bits; the fused product (quantization, product, rescale) the unfused halves' bits, NaN and infinite rows included;
and quant's dispatch to each. The shared behaviour is one test parametrized over both kernels, each param skipped
where this CPU can't run its kernel; the VNNI kernel's own (its packing, its compensation, its choice) are in
test_int8_gemm_vnni.py. The reference is the float64 product (exact: |sum| < 2**53), which torch._int_mm equals
on VNNI / AMX CPUs."""

from __future__ import annotations

from typing import Callable, NamedTuple

import pytest
import torch

from prefixcache.kernels import avx2_kernels
from prefixcache.kernels.avx2_kernels import (int8_gemm_avx2, int8_gemm_vnni, int8_linear_avx2, int8_linear_vnni,
                                              int8_product_avx2, int8_product_vnni, pack_weight, pack_weight_vnni)
from prefixcache.layers import quant


class Kernel(NamedTuple):
    """One of the two kernels, as quant drives it."""

    pack: Callable  # qweight [K, N] int8 -> the kernel's packed weight
    gemm: Callable  # (x_q, packed, N) -> int32
    linear: Callable  # (x_q, x_scale, packed, w_scale, bias) -> float32
    product: Callable  # (x, mul, packed, w_scale, bias, out_dtype) -> out_dtype
    chooser: str  # quant's function saying the kernel runs here
    packed_field: str  # Int8Weight's field holding the packed weight


AVX2 = Kernel(pack_weight, int8_gemm_avx2, int8_linear_avx2, int8_product_avx2, "uses_avx2_int8_gemm", "avx2_packed")
VNNI = Kernel(pack_weight_vnni, int8_gemm_vnni, int8_linear_vnni, int8_product_vnni, "uses_vnni_int8_gemm",
              "vnni_packed")
KERNELS = [pytest.param(AVX2, id="avx2", marks=pytest.mark.requires_isa("avx2", "fma")),
           pytest.param(VNNI, id="vnni", marks=pytest.mark.requires_isa("avx2", "avx_vnni"))]


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double()).to(torch.int32)


def rand_int8(*shape: int, seed: int, low: int = -128) -> torch.Tensor:
    return torch.randint(low, 128, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("k", [1, 7, 64, 101, 576, 1537])
def test_the_sums_are_exact_over_odd_shapes_and_the_extreme_values(kernel, k):
    """K below, at and past the input step (2 or 4), N below, at and past a panel, M every 6-row tail."""
    for n in (1, 9, 16, 49, 576):
        w = rand_int8(k, n, seed=k + n)
        packed = kernel.pack(w)
        for m in (1, 3, 6, 17, 130):
            x = rand_int8(m, k, seed=m * 7 + k)
            assert torch.equal(kernel.gemm(x, packed, n), exact(x, w)), (m, k, n)
    # the extremes: the VNNI offset's u = 0 and 255, the compensation's largest and smallest column sums
    x, w = torch.empty(13, k, dtype=torch.int8), torch.empty(k, 50, dtype=torch.int8)
    for xv, wv in ((-128, -128), (127, -128), (-128, 127), (127, 127)):
        x.fill_(xv), w.fill_(wv)
        assert torch.equal(kernel.gemm(x, kernel.pack(w), 50), exact(x, w)), (xv, wv)


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_extreme_pair_every_row_count_the_largest_k_and_a_partial_panel(kernel):
    """Any int8 on both sides (no precondition: -128 is exact too). K = 131,071 is odd and not a multiple of 4 (a
    zero-padded last step) and the largest K whose worst sum fits int32: 131,071 * 128**2 = 2**31 - 16,384.
    N = 40 leaves a half panel; M = 1..13 runs every tail of the 6-row blocks (and two full blocks)."""
    k, n = 131_071, 40
    values = torch.tensor([-128, -127, 127], dtype=torch.int8)
    w = values[torch.randint(0, 3, (k, n), generator=torch.Generator().manual_seed(7))]
    for j, (a, b) in enumerate([(a, b) for a in values for b in values]):  # columns 0..8: every (a, b) pair
        w[0::2, j], w[1::2, j] = a, b
    x = values[torch.randint(0, 3, (13, k), generator=torch.Generator().manual_seed(8))]
    for i, v in enumerate(values):  # rows 0..2: constant -128, -127, 127
        x[i] = v
    x[3, ::2], x[3, 1::2] = -128, 127
    x[4] = 0
    packed = kernel.pack(w)
    full = exact(x, w)
    assert full[0, 0] == k * 128 * 128 == 2**31 - 16_384  # (-128) * (-128) in every pair: the bound itself
    assert full[2, 8] == k * 127 * 127 and full[0, 8] == -k * 128 * 127
    for m in range(1, 14):
        assert torch.equal(kernel.gemm(x[:m], packed, n), full[:m]), m


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(kernel):
    k, n = 576, 200
    packed = kernel.pack(rand_int8(k, n, seed=1))
    rows = rand_int8(37, k, seed=2)
    alone = torch.cat([kernel.gemm(rows[i : i + 1], packed, n) for i in range(37)])
    for start, num_rows in ((0, 37), (3, 5), (10, 13), (30, 7)):
        assert torch.equal(kernel.gemm(rows[start : start + num_rows], packed, n), alone[start : start + num_rows])


@pytest.mark.parametrize("kernel", KERNELS)
def test_empty_and_mismatched_inputs(kernel):
    packed = kernel.pack(rand_int8(64, 24, seed=3))
    assert kernel.gemm(torch.zeros(0, 64, dtype=torch.int8), packed, 24).shape == (0, 24)
    with pytest.raises(RuntimeError, match="not that of a"):
        kernel.gemm(rand_int8(2, 72, seed=4), packed, 24)
    with pytest.raises(RuntimeError, match="x must be"):
        kernel.gemm(rand_int8(2, 64, seed=4).float(), packed, 24)
    with pytest.raises(RuntimeError, match="out_dtype must be"):
        kernel.product(torch.zeros(2, 64), None, packed, torch.ones(24), None, torch.int32)
    with pytest.raises(RuntimeError, match="mul must be 64 contiguous float32"):
        kernel.product(torch.zeros(2, 64), torch.ones(63), packed, torch.ones(24), None, torch.float32)
    with pytest.raises(ValueError, match="int8"):
        kernel.pack(torch.zeros(4, 4))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_rescaled_form_has_int8_rows_to_float_torchs_bits(kernel, with_bias):
    gen = torch.Generator().manual_seed(5)
    for m, k, n in ((1, 64, 8), (3, 100, 9), (17, 576, 576), (130, 1536, 200)):
        bias = torch.randn(n, generator=gen) if with_bias else None
        weight = quant.quantize_weight(torch.randn(n, k, generator=gen), bias)
        x_q, x_scale = quant.quantize_activations_torch(torch.randn(m, k, generator=gen) * 3)
        expected = quant.int8_rows_to_float_torch(exact(x_q, weight.qweight), x_scale, weight, torch.float32)
        got = kernel.linear(x_q, x_scale, kernel.pack(weight.qweight), weight.scale, weight.bias)
        assert torch.equal(got, expected), (m, k, n)


def _unfused(x: torch.Tensor, weight: quant.Int8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """int8_product's two halves in torch ops over the exact product (finite rows)."""
    x_q, x_scale = quant.quantize_activations_torch(x, weight.act_mul)
    return quant.int8_rows_to_float_torch(exact(x_q, weight.qweight), x_scale, weight, out_dtype)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_the_fused_product_has_the_unfused_halves_bits(kernel, x_dtype, out_dtype):
    """Quantization, product and rescale in one call == quantize_activations_torch, the exact product and
    int8_rows_to_float_torch, with and without the smoothing multiplier and a bias, K a multiple of 8 or not (the
    vector body and the scalar tail), N a multiple of 16 or not (the epilogue's full and partial panels), rows
    with a tiny or an all-zero scale."""
    gen = torch.Generator().manual_seed(8)
    for m, k, n, smooth, with_bias in ((1, 64, 8, False, False), (3, 100, 9, True, True), (17, 576, 40, True, False),
                                       (70, 1537, 33, False, True), (13, 96, 64, True, True)):
        weight = quant.quantize_weight(torch.randn(n, k, generator=gen), torch.randn(n, generator=gen) if with_bias
                                       else None, torch.rand(k, generator=gen) + 0.5 if smooth else None)
        x = (torch.randn(m, k, generator=gen) * 3).to(x_dtype)
        x[0, : k // 2] *= 1e4  # one large half-row: the scale follows it
        if m > 2:
            x[1] = 0  # scale 1e-12, q = 0
            x[2] *= 1e-30  # subnormal-sized values
        got = kernel.product(x, weight.act_mul, kernel.pack(weight.qweight), weight.scale, weight.bias, out_dtype)
        assert got.dtype == out_dtype and torch.equal(got, _unfused(x, weight, out_dtype)), (m, k, n)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.requires_isa("avx512")  # our AVX-512 kernels' fused int8 rows (csrc/int8_rows.cpp)
def test_the_fused_product_equals_the_avx512_kernels_halves_nan_and_infinite_rows_included(kernel):
    """A row holding a NaN or an infinity: a NaN scale and NaN outputs in that row only, as int8_rows.cpp's
    quantize_rows_int8 + int8_rows_to_float give (torch's ops differ there); the other rows unchanged."""
    from prefixcache.kernels.cpu_kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    gen = torch.Generator().manual_seed(9)
    weight = quant.quantize_weight(torch.randn(24, 50, generator=gen), torch.randn(24, generator=gen))
    x = torch.randn(5, 50, generator=gen).to(torch.bfloat16)
    x[1, 7], x[3, 49] = float("nan"), float("-inf")  # in the vector body, in the scalar tail
    for out_dtype in (torch.float32, torch.bfloat16):
        x_q, x_scale = kernels.quantize_rows_int8(x, weight.act_mul)
        expected = kernels.int8_rows_to_float(exact(x_q, weight.qweight), x_scale, weight.scale, weight.bias, out_dtype)
        got = kernel.product(x, None, kernel.pack(weight.qweight), weight.scale, weight.bias, out_dtype)
        assert torch.equal(got.isnan(), expected.isnan()) and got[[1, 3]].isnan().all()
        assert torch.equal(got[[0, 2, 4]], expected[[0, 2, 4]])


def _packed_weight(monkeypatch, kernel: Kernel, *args) -> quant.Int8Weight:
    """quantize_weight(*args) as on a CPU where ``kernel`` (and not the other) runs the products."""
    for other in (AVX2, VNNI):
        monkeypatch.setattr(quant, other.chooser, lambda used=other is kernel: used)
    weight = quant.quantize_weight(*args)
    assert all((getattr(weight, k.packed_field) is None) is (k is not kernel) for k in (AVX2, VNNI))
    return weight


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_linear_runs_the_kernel_and_holds_the_matrix_once(monkeypatch, kernel):
    """Where the kernel is chosen, quantize_weight packs the weight, int8_linear never calls torch._int_mm (in
    float32 and bfloat16 out) and release_qweight drops the plain matrix; the result is the exact product's."""
    gen = torch.Generator().manual_seed(6)
    weight = _packed_weight(monkeypatch, kernel, torch.randn(48, 96, generator=gen), torch.randn(48, generator=gen))
    x_q, x_scale = quant.quantize_activations(torch.randn(5, 96, generator=gen))
    expected = {dtype: quant.int8_rows_to_float_torch(exact(x_q, weight.qweight), x_scale, weight, dtype)
                for dtype in (torch.float32, torch.bfloat16)}
    assert weight.release_qweight() == 48 * 96 and weight.qweight.numel() == 0
    monkeypatch.setattr(torch, "_int_mm", lambda *a: pytest.fail("torch._int_mm called"))
    for out_dtype, want in expected.items():
        assert torch.equal(quant.int8_linear(x_q, x_scale, weight, out_dtype), want)


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_product_takes_the_fused_call_where_the_weight_is_packed(monkeypatch, kernel):
    gen = torch.Generator().manual_seed(10)
    weight = _packed_weight(monkeypatch, kernel, torch.randn(40, 96, generator=gen), None,
                            torch.rand(96, generator=gen) + 0.5)
    x = torch.randn(7, 96, generator=gen).to(torch.bfloat16)
    expected = {dtype: _unfused(x, weight, dtype) for dtype in (torch.float32, torch.bfloat16)}
    monkeypatch.setattr(quant, "quantize_activations", lambda *a: pytest.fail("the unfused halves ran"))
    for out_dtype, want in expected.items():
        assert torch.equal(quant.int8_product(x, weight, out_dtype), want)


def test_the_avx2_kernel_is_chosen_only_without_vnni_or_amx_int8(monkeypatch):
    fast = ({"avx512_vnni"}, {"amx_int8"}, {"avx_vnni"})  # cpu_features' fast torch._int_mm features
    for flags, used in (({"avx2", "fma", "f16c"}, True), ({"avx2", "fma", "f16c", "avx512_vnni"}, False),
                        ({"avx2", "fma", "f16c", "amx_int8"}, False), ({"avx2", "fma", "f16c", "avx_vnni"}, False),
                        ({"avx2"}, False)):
        monkeypatch.setattr(avx2_kernels, "cpu_has", lambda *names, flags=flags: set(names) <= flags)
        monkeypatch.setattr(avx2_kernels, "fast_int_mm", lambda flags=flags: any(f <= flags for f in fast))
        assert avx2_kernels.uses_avx2_int8_gemm() is used, flags


def test_the_avx2_packed_layout():
    """packed[p, q, 2 j + i] = w[2 q + i, 16 p + j], zero past K and N (no CPU feature needed: the packing is
    torch)."""
    w = rand_int8(5, 18, seed=11)
    packed = pack_weight(w)
    assert packed.shape == (2, 3, 32) and packed.dtype == torch.int8
    assert packed[1, 2, 2 * 1 + 0].item() == w[4, 17].item() and packed[0, 1, 2 * 3 + 1].item() == w[3, 3].item()
    assert packed[1, 2, 2 * 1 + 1].item() == 0 and packed[1, 0, 2 * 2 + 0].item() == 0  # row 5, column 18
