"""Our AVX-VNNI int8 product (csrc/int8_gemm_vnni.cpp), int8's kernel on CPUs with AVX-VNNI but neither AVX512-VNNI
nor AMX-INT8: what is its own, its packing with the compensation for the activations' +128 offset, that
compensation's check, and when it is chosen. What it shares with the AVX2 kernel (exact sums for any int8 values,
-128 included, K odd and large; the rescaled and fused forms' bits; a row's bits in any batch; quant's dispatch) is
tested over both kernels in test_int8_gemm_avx2.py."""

from __future__ import annotations

import pytest
import torch

from prefixcache.kernels import avx2_kernels
from prefixcache.kernels.avx2_kernels import int8_gemm_vnni, pack_weight_vnni


def rand_int8(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.requires_isa("avx2", "avx_vnni")
def test_the_compensation_is_checked():
    packed = pack_weight_vnni(rand_int8(64, 24, seed=3))
    with pytest.raises(RuntimeError, match="comp must be"):
        int8_gemm_vnni(rand_int8(2, 64, seed=4), (packed[0], packed[1][:8].contiguous()), 24)
    with pytest.raises(RuntimeError, match="comp must be"):
        int8_gemm_vnni(rand_int8(2, 64, seed=4), (packed[0], packed[1].long()), 24)


def test_the_packed_layout_and_the_compensation():
    """packed[p, q, 4 j + i] = w[4 q + i, 16 p + j], zero past K and N; comp = 128 * the column sums (no CPU
    feature needed: the packing is torch)."""
    w = rand_int8(6, 18, seed=5)
    packed, comp = pack_weight_vnni(w)
    assert packed.shape == (2, 2, 64) and comp.shape == (32,) and comp.dtype == torch.int32
    assert packed[1, 1, 4 * 1 + 1].item() == w[5, 17].item() and packed[0, 0, 4 * 3 + 2].item() == w[2, 3].item()
    assert packed[1, 1, 4 * 2 + 0].item() == 0 and packed[0, 1, 4 * 5 + 2].item() == 0  # column 18, row 6
    assert comp[:18].tolist() == (128 * w.int().sum(0)).tolist() and comp[18:].tolist() == [0] * 14


def test_the_kernel_is_chosen_only_with_avx_vnni_and_without_avx512_vnni_or_amx_int8(monkeypatch):
    monkeypatch.setattr(avx2_kernels, "load_avx2_kernels", lambda: type("M", (), {"avx_vnni_ready": lambda: True}))
    base = {"avx2", "fma", "f16c"}
    for flags, used in ((base, False), (base | {"avx_vnni"}, True), (base | {"avx_vnni", "avx512_vnni"}, False),
                        (base | {"avx_vnni", "amx_int8"}, False), ({"avx_vnni"}, False)):
        monkeypatch.setattr(avx2_kernels, "cpu_has", lambda *names, flags=flags: set(names) <= flags)
        assert avx2_kernels.uses_vnni_int8_gemm() is used, flags
