"""Our AVX-VNNI int8 product (csrc/int8_gemm_vnni.cpp), int8's kernel on CPUs with AVX-VNNI but neither AVX512-VNNI nor
AMX-INT8: exact int32 sums (a float64 reference; every int8 value, -128 included, K odd and large), the rescaled
form with int8_rows_to_float_torch's bits, a row's bits in any batch, and the dispatch: quantize_weight packs the
weight once, int8_linear never calls torch._int_mm, and the plain int8 matrix is released."""

from __future__ import annotations

import pytest
import torch

from prefixcache.kernels import avx2_kernels
from prefixcache.kernels.avx2_kernels import int8_gemm_vnni, int8_linear_vnni, pack_weight_vnni
from prefixcache.layers import quant

requires_vnni = pytest.mark.requires_isa("avx2", "avx_vnni")


def rand_int8(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [K, N] in float64, exact for these sizes (|sum| < 2^53), as int32."""
    return (x.double() @ w.double()).to(torch.int32)


@requires_vnni
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (1, 5, 3), (5, 7, 17), (6, 64, 16), (7, 33, 31), (13, 576, 50),
                                   (40, 1537, 100), (300, 576, 49)])
def test_the_sums_are_exact_for_any_int8_values(m, k, n):
    x, w = rand_int8(m, k, seed=m * 7 + k), rand_int8(k, n, seed=n)
    assert torch.equal(int8_gemm_vnni(x, pack_weight_vnni(w), n), exact(x, w))
    # the extremes: the +128 offset's u = 0 and 255, the compensation's largest and smallest column sums
    for xv, wv in ((-128, -128), (127, -128), (-128, 127), (127, 127)):
        x.fill_(xv), w.fill_(wv)
        assert torch.equal(int8_gemm_vnni(x, pack_weight_vnni(w), n), exact(x, w)), (xv, wv)


@requires_vnni
def test_a_rows_sums_are_the_same_alone_and_in_any_batch():
    w, x = rand_int8(200, 70, seed=1), rand_int8(23, 200, seed=2)
    packed = pack_weight_vnni(w)
    batched = int8_gemm_vnni(x, packed, 70)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 10), slice(17, 23)):
        assert torch.equal(int8_gemm_vnni(x[rows], packed, 70), batched[rows])


@requires_vnni
def test_shapes_are_checked():
    packed = pack_weight_vnni(rand_int8(64, 24, seed=3))
    assert int8_gemm_vnni(torch.zeros(0, 64, dtype=torch.int8), packed, 24).shape == (0, 24)
    with pytest.raises(RuntimeError, match="not that of a"):
        int8_gemm_vnni(rand_int8(2, 70, seed=4), packed, 24)
    with pytest.raises(RuntimeError, match="comp must be"):
        int8_gemm_vnni(rand_int8(2, 64, seed=4), (packed[0], packed[1][:8].contiguous()), 24)
    with pytest.raises(ValueError, match="int8"):
        pack_weight_vnni(torch.zeros(4, 4))


def test_the_packed_layout_and_the_compensation():
    """packed[p, q, 4 j + i] = w[4 q + i, 16 p + j], zero past K and N; comp = 128 * the column sums (no CPU
    feature needed: the packing is torch)."""
    w = rand_int8(6, 18, seed=5)
    packed, comp = pack_weight_vnni(w)
    assert packed.shape == (2, 2, 64) and comp.shape == (32,) and comp.dtype == torch.int32
    assert packed[1, 1, 4 * 1 + 1].item() == w[5, 17].item() and packed[0, 0, 4 * 3 + 2].item() == w[2, 3].item()
    assert packed[1, 1, 4 * 2 + 0].item() == 0 and packed[0, 1, 4 * 5 + 2].item() == 0  # column 18, row 6
    assert comp[:18].tolist() == (128 * w.int().sum(0)).tolist() and comp[18:].tolist() == [0] * 14


@requires_vnni
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_rescaled_form_has_int8_rows_to_float_torchs_bits(with_bias):
    gen = torch.Generator().manual_seed(5)
    for m, k, n in ((1, 64, 8), (3, 100, 9), (17, 576, 576), (130, 1536, 200)):
        bias = torch.randn(n, generator=gen) if with_bias else None
        weight = quant.quantize_weight(torch.randn(n, k, generator=gen), bias)
        x_q, x_scale = quant.quantize_activations_torch(torch.randn(m, k, generator=gen) * 3)
        expected = quant.int8_rows_to_float_torch(exact(x_q, weight.qweight), x_scale, weight, torch.float32)
        got = int8_linear_vnni(x_q, x_scale, pack_weight_vnni(weight.qweight), weight.scale, weight.bias)
        assert torch.equal(got, expected), (m, k, n)


@requires_vnni
def test_int8_linear_runs_the_kernel_and_holds_the_matrix_once(monkeypatch):
    """Where uses_vnni_int8_gemm holds, quantize_weight packs the weight, int8_linear never calls torch._int_mm
    (in float32 and bfloat16 out), and release_qweight drops the plain matrix."""
    monkeypatch.setattr(quant, "uses_vnni_int8_gemm", lambda: True)
    monkeypatch.setattr(quant, "uses_avx2_int8_gemm", lambda: False)
    gen = torch.Generator().manual_seed(6)
    weight = quant.quantize_weight(torch.randn(48, 96, generator=gen), torch.randn(48, generator=gen))
    assert weight.vnni_packed is not None and weight.avx2_packed is None
    x_q, x_scale = quant.quantize_activations(torch.randn(5, 96, generator=gen))
    expected = {dtype: quant.int8_rows_to_float_torch(exact(x_q, weight.qweight), x_scale, weight, dtype)
                for dtype in (torch.float32, torch.bfloat16)}
    assert weight.release_qweight() == 48 * 96 and weight.qweight.numel() == 0
    monkeypatch.setattr(torch, "_int_mm", lambda *a: pytest.fail("torch._int_mm called"))
    for out_dtype, want in expected.items():
        assert torch.equal(quant.int8_linear(x_q, x_scale, weight, out_dtype), want)


def test_the_kernel_is_chosen_only_with_avx_vnni_and_without_avx512_vnni_or_amx_int8(monkeypatch):
    monkeypatch.setattr(avx2_kernels, "load_avx2_kernels", lambda: type("M", (), {"avx_vnni_ready": lambda: True}))
    base = {"avx2", "fma", "f16c"}
    for flags, used in ((base, False), (base | {"avx_vnni"}, True), (base | {"avx_vnni", "avx512_vnni"}, False),
                        (base | {"avx_vnni", "amx_int8"}, False), ({"avx_vnni"}, False)):
        monkeypatch.setattr(avx2_kernels, "cpu_has", lambda *names, flags=flags: set(names) <= flags)
        assert avx2_kernels.uses_vnni_int8_gemm() is used, flags


def _unfused(x: torch.Tensor, weight: quant.Int8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """int8_product's two halves in torch ops over the exact product (finite rows)."""
    x_q, x_scale = quant.quantize_activations_torch(x, weight.act_mul)
    return quant.int8_rows_to_float_torch(exact(x_q, weight.qweight), x_scale, weight, out_dtype)


@requires_vnni
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_the_fused_product_has_the_unfused_halves_bits(x_dtype, out_dtype):
    """Quantization, product and rescale in one call == quantize_activations_torch, the exact product and
    int8_rows_to_float_torch, with and without the smoothing multiplier and a bias, K a multiple of 8 or not (the
    vector body and the scalar tail), rows with a tiny or an all-zero scale."""
    gen = torch.Generator().manual_seed(8)
    for m, k, n, smooth, with_bias in ((1, 64, 8, False, False), (3, 100, 9, True, True), (17, 576, 40, True, False),
                                       (70, 1537, 33, False, True)):
        weight = quant.quantize_weight(torch.randn(n, k, generator=gen), torch.randn(n, generator=gen) if with_bias
                                       else None, torch.rand(k, generator=gen) + 0.5 if smooth else None)
        x = (torch.randn(m, k, generator=gen) * 3).to(x_dtype)
        x[0, : k // 2] *= 1e4  # one large half-row: the scale follows it
        if m > 2:
            x[1] = 0  # scale 1e-12, q = 0
            x[2] *= 1e-30  # subnormal-sized values
        got = avx2_kernels.int8_product_vnni(x, weight.act_mul, pack_weight_vnni(weight.qweight), weight.scale,
                                             weight.bias, out_dtype)
        assert got.dtype == out_dtype and torch.equal(got, _unfused(x, weight, out_dtype)), (m, k, n)


@requires_vnni
@pytest.mark.requires_isa("avx512")  # our AVX-512 kernels' fused int8 rows (csrc/int8_rows.cpp)
def test_the_fused_product_equals_the_avx512_kernels_halves_nan_and_infinite_rows_included():
    """A row holding a NaN or an infinity: a NaN scale and NaN outputs in that row only, as int8_rows.cpp's
    quantize_rows_int8 + int8_rows_to_float give (torch's ops differ there); the other rows unchanged."""
    from prefixcache.kernels.cpu_kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    gen = torch.Generator().manual_seed(9)
    weight = quant.quantize_weight(torch.randn(24, 50, generator=gen), torch.randn(24, generator=gen))
    x = torch.randn(5, 50, generator=gen).to(torch.bfloat16)
    x[1, 7], x[3, 49] = float("nan"), float("-inf")
    for out_dtype in (torch.float32, torch.bfloat16):
        x_q, x_scale = kernels.quantize_rows_int8(x, weight.act_mul)
        expected = kernels.int8_rows_to_float(exact(x_q, weight.qweight), x_scale, weight.scale, weight.bias, out_dtype)
        got = avx2_kernels.int8_product_vnni(x, None, pack_weight_vnni(weight.qweight), weight.scale, weight.bias,
                                             out_dtype)
        assert torch.equal(got.isnan(), expected.isnan()) and got[[1, 3]].isnan().all()
        assert torch.equal(got[[0, 2, 4]], expected[[0, 2, 4]])


@requires_vnni
def test_int8_product_takes_the_fused_call_where_the_weight_is_vnni_packed(monkeypatch):
    monkeypatch.setattr(quant, "uses_vnni_int8_gemm", lambda: True)
    monkeypatch.setattr(quant, "uses_avx2_int8_gemm", lambda: False)
    gen = torch.Generator().manual_seed(10)
    weight = quant.quantize_weight(torch.randn(40, 96, generator=gen), None, torch.rand(96, generator=gen) + 0.5)
    x = torch.randn(7, 96, generator=gen).to(torch.bfloat16)
    expected = _unfused(x, weight, torch.bfloat16)
    monkeypatch.setattr(quant, "quantize_activations", lambda *a: pytest.fail("the unfused halves ran"))
    assert torch.equal(quant.int8_product(x, weight, torch.bfloat16), expected)
