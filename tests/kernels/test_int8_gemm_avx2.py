"""The AVX2 int8 GEMM (prefixcache/kernels/csrc/int8_gemm_avx2.cpp): torch._int_mm's exact int32 sums, whatever
the shape, the values or the rows sharing the call; its rescaled form int8_rows_to_float_torch's bits. The
reference is the float64 product (exact: |sum| < 2**53), which torch._int_mm equals on VNNI / AMX CPUs."""

from __future__ import annotations

import pytest
import torch

from prefixcache.kernels import avx2_kernels
from prefixcache.kernels.avx2_kernels import int8_gemm_avx2, int8_linear_avx2, pack_weight
from prefixcache.layers import quant

pytestmark = pytest.mark.requires_isa("avx2", "fma")


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double()).to(torch.int32)


def rand_int8(*shape: int, seed: int, low: int = -127) -> torch.Tensor:
    return torch.randint(low, 128, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


@pytest.mark.parametrize("k", [64, 101, 576, 1536])
def test_the_sums_are_exact_over_odd_shapes(k):
    for n in (8, 9, 576, 1536):
        w = rand_int8(k, n, seed=k + n)
        packed = pack_weight(w)
        for m in (1, 3, 17, 130):
            x = rand_int8(m, k, seed=m * 7 + k)
            assert torch.equal(int8_gemm_avx2(x, packed, n), exact(x, w)), (m, k, n)


def test_extremes_zero_rows_and_the_largest_sums():
    k, n = 1536, 40
    w = torch.full((k, n), 127, dtype=torch.int8)
    w[:, 1::2] = -127
    w[:, 5] = -128  # outside quantize_weight's range, still exact
    x = torch.full((6, k), 127, dtype=torch.int8)
    x[1] = -127
    x[2] = 0
    x[3, ::2] = -127
    x[4] = -128
    got = int8_gemm_avx2(x, pack_weight(w), n)
    assert torch.equal(got, exact(x, w))
    assert got[0, 0] == k * 127 * 127 and got[2].eq(0).all() and got[4, 5] == k * 128 * 128


def test_every_extreme_pair_every_row_count_the_largest_k_and_a_partial_panel():
    """The kernel takes any int8 on both sides (no precondition: -128 is exact too). K = 131,071 is odd (a
    zero-padded last pair) and the largest K whose worst sum fits int32: 131,071 * 128**2 = 2**31 - 16,384.
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
    packed = pack_weight(w)
    full = exact(x, w)
    assert full[0, 0] == k * 128 * 128 == 2**31 - 16_384  # (-128) * (-128) in every pair: the bound itself
    assert full[2, 8] == k * 127 * 127 and full[0, 8] == -k * 128 * 127
    for m in range(1, 14):
        assert torch.equal(int8_gemm_avx2(x[:m], packed, n), full[:m]), m


def test_a_row_gets_the_same_bits_alone_and_in_any_batch():
    k, n = 576, 200
    packed = pack_weight(rand_int8(k, n, seed=1))
    rows = rand_int8(37, k, seed=2)
    alone = torch.cat([int8_gemm_avx2(rows[i : i + 1], packed, n) for i in range(37)])
    for start, num_rows in ((0, 37), (3, 5), (10, 13), (30, 7)):
        assert torch.equal(int8_gemm_avx2(rows[start : start + num_rows], packed, n), alone[start : start + num_rows])


def test_empty_and_mismatched_inputs():
    packed = pack_weight(rand_int8(64, 24, seed=3))
    assert int8_gemm_avx2(torch.zeros(0, 64, dtype=torch.int8), packed, 24).shape == (0, 24)
    with pytest.raises(RuntimeError, match="not that of a"):
        int8_gemm_avx2(rand_int8(2, 66, seed=4), packed, 24)
    with pytest.raises(ValueError, match="int8"):
        pack_weight(torch.zeros(4, 4))


@pytest.mark.parametrize("with_bias", [False, True])
def test_the_rescaled_form_has_int8_rows_to_float_torchs_bits(with_bias):
    gen = torch.Generator().manual_seed(5)
    for m, k, n in ((1, 64, 8), (3, 100, 9), (17, 576, 576), (130, 1536, 200)):
        bias = torch.randn(n, generator=gen) if with_bias else None
        weight = quant.quantize_weight(torch.randn(n, k, generator=gen), bias)
        x_q, x_scale = quant.quantize_activations_torch(torch.randn(m, k, generator=gen) * 3)
        expected = quant.int8_rows_to_float_torch(exact(x_q, weight.qweight), x_scale, weight, torch.float32)
        got = int8_linear_avx2(x_q, x_scale, pack_weight(weight.qweight), weight.scale, weight.bias)
        assert torch.equal(got, expected), (m, k, n)


def test_int8_linear_runs_the_kernel_where_the_cpu_lacks_fast_int8_products(monkeypatch):
    """Where uses_avx2_int8_gemm holds (PREFIXCACHE_KERNELS=avx2 here), quantize_weight packs the weight and
    int8_linear never calls torch._int_mm; the result is the exact product's."""
    monkeypatch.setattr(quant, "uses_avx2_int8_gemm", lambda: True)
    monkeypatch.setattr(torch, "_int_mm", lambda *a: pytest.fail("torch._int_mm called"))
    gen = torch.Generator().manual_seed(6)
    weight = quant.quantize_weight(torch.randn(48, 96, generator=gen), torch.randn(48, generator=gen))
    assert weight.avx2_packed is not None
    x_q, x_scale = quant.quantize_activations(torch.randn(5, 96, generator=gen))
    for out_dtype in (torch.float32, torch.bfloat16):
        expected = quant.int8_rows_to_float_torch(exact(x_q, weight.qweight), x_scale, weight, out_dtype)
        assert torch.equal(quant.int8_linear(x_q, x_scale, weight, out_dtype), expected)


def test_the_kernel_is_chosen_only_without_vnni_or_amx_int8(monkeypatch):
    fast = ({"avx512_vnni"}, {"amx_int8"}, {"avx_vnni"})  # cpu_features' fast torch._int_mm features
    for flags, used in (({"avx2", "fma", "f16c"}, True), ({"avx2", "fma", "f16c", "avx512_vnni"}, False),
                        ({"avx2", "fma", "f16c", "amx_int8"}, False), ({"avx2", "fma", "f16c", "avx_vnni"}, False),
                        ({"avx2"}, False)):
        monkeypatch.setattr(avx2_kernels, "cpu_has", lambda *names, flags=flags: set(names) <= flags)
        monkeypatch.setattr(avx2_kernels, "fast_int_mm", lambda flags=flags: any(f <= flags for f in fast))
        assert avx2_kernels.uses_avx2_int8_gemm() is used, flags
