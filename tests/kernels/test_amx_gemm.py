"""Our AMX GEMM for a bf16 model's linear layers (kernels/amx_gemm.py, csrc/amx_gemm.cpp): right values
against float64, a row's exact bits in a call of any number of rows (the property that lets it run
without oneDNN's row tiles), the prepacked weights that route to it, and the inputs it refuses."""

import pytest
import torch
from torch import nn

from prefixcache.kernels.amx_gemm import amx_gemm_supported, amx_linear, amx_packable, pack_weight
from prefixcache.layers.linear import PrepackedWeight, row_tiles

pytestmark = pytest.mark.skipif(not amx_gemm_supported(), reason="needs a CPU with AMX-BF16 tiles")


def operands(m, k, n, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    return x, w, b


@pytest.mark.parametrize("m,k,n,bias", [(1, 576, 960, False), (17, 96, 49, True), (33, 1536, 576, False),
                                        (300, 64, 20, True), (257, 576, 3072, False)])
def test_values_are_float64_products_rounded_to_bf16(m, k, n, bias):
    """Row and column tails (17, 33, 257 rows; 49 and 20 columns), biases: within one bf16 rounding
    (2^-8 relative) of the float64 product, float32 sums being far finer."""
    x, w, b = operands(m, k, n, bias)
    y = amx_linear(x, pack_weight(w), b, n)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert ((y.double() - ref).abs() / (ref.abs() + 1e-2)).max() < 2**-8


@pytest.mark.parametrize("k,n", [(576, 960), (224, 48), (1536, 64)])
def test_a_row_has_the_same_bits_in_a_call_of_any_number_of_rows(k, n):
    """300 rows in one call (two 256-row work items), split 137 + 163, and each row alone: identical bits.
    A call of more than 32 rows sums 6 feature blocks at a time over its row chunks, the sums resting in
    memory between (18 blocks of 32 features = 3 x 6, 7 = 6 + 1, 48 = 8 x 6); a row alone sums all in
    one pass: the same bits."""
    x, w, b = operands(300, k, n)
    packed = pack_weight(w)
    whole = amx_linear(x, packed, b, n)
    assert torch.equal(torch.cat([amx_linear(x[:137], packed, b, n), amx_linear(x[137:], packed, b, n)]), whole)
    for i in (0, 15, 16, 31, 32, 255, 256, 299):
        assert torch.equal(amx_linear(x[i : i + 1], packed, b, n), whole[i : i + 1]), i


def test_one_thread_and_two_give_the_same_bits():
    x, w, b = operands(100, 576, 1536)
    packed = pack_weight(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = amx_linear(x, packed, b, 1536)
        torch.set_num_threads(2)
        assert torch.equal(amx_linear(x, packed, b, 1536), one)
    finally:
        torch.set_num_threads(threads)


def test_prepacked_weights_run_it_in_one_call_for_any_rows():
    """q, k, v stacked (with biases, as Qwen2's): one tile of all 300 rows, the bits of amx_linear on the
    stacked weight and of each row alone."""
    torch.manual_seed(0)
    mods = [nn.Linear(64, 64).bfloat16(), nn.Linear(64, 32).bfloat16(), nn.Linear(64, 32).bfloat16()]
    packed = PrepackedWeight(mods)
    assert packed.amx
    x = torch.randn(300, 64).bfloat16()
    tiles = row_tiles(x, None, packed=packed)
    assert len(tiles) == 1 and tiles[0].shape == (300, 128)
    w = torch.cat([m.weight for m in mods]).detach()
    b = torch.cat([m.bias for m in mods]).detach()
    assert torch.equal(tiles[0], amx_linear(x, pack_weight(w), b, 128))
    assert torch.equal(row_tiles(x[7:8], None, packed=packed)[0], tiles[0][7:8])


def test_refuses_what_it_cannot_run():
    assert not amx_packable(torch.zeros(16, 48, dtype=torch.bfloat16))  # in_features not a multiple of 32
    assert not amx_packable(torch.zeros(16, 64))  # float32
    assert not PrepackedWeight([nn.Linear(48, 16).bfloat16()]).amx  # takes oneDNN's row tiles instead
    x, w, _ = operands(4, 64, 16, bias=False)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        amx_linear(torch.zeros(4, 48, dtype=torch.bfloat16), pack_weight(w), None, 16)
    with pytest.raises(RuntimeError, match="fit packed"):
        amx_linear(x, pack_weight(w), None, 17)
    with pytest.raises(RuntimeError, match="bf16"):
        amx_linear(x.float(), pack_weight(w), None, 16)


def test_a_replaced_weight_of_another_shape_is_packed_for_its_shape():
    """pack() re-decides the layout from the weights it packs: a weight swapped for one with fewer
    outputs gives that many columns (not the old count with zeros)."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 50, bias=False).bfloat16()
    packed = PrepackedWeight([lin])
    x = torch.randn(3, 64).bfloat16()
    assert packed.linear(x).shape == (3, 50)
    lin.weight = nn.Parameter(torch.randn(49, 64).bfloat16())
    y = packed.linear(x)
    assert y.shape == (3, 49) and torch.equal(y, amx_linear(x, pack_weight(lin.weight.data), None, 49))


def test_a_weight_written_in_place_is_packed_again():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32).bfloat16()
    packed = PrepackedWeight([lin])
    x = torch.randn(5, 64).bfloat16()
    before = packed.linear(x)
    with torch.no_grad():
        lin.weight.mul_(2)
        lin.bias.zero_()
    after = packed.linear(x)
    assert torch.equal(after, amx_linear(x, pack_weight(lin.weight.detach()), lin.bias.detach(), 32))
    assert not torch.equal(after, before)


@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_interleaved_gives_the_plain_products_and_silu_mul_fused_gives_silu_mul(bias):
    """A gate|up weight packed interleaved (blocks gate 0, up 0, gate 1, ...): its [gate | up] output has the
    bits of the plain layout's, and the fused silu(gate) * up store has the bits of prompt_ops.silu_mul on
    that output, for 1, 17 and 300 rows (each row also alone)."""
    from prefixcache.kernels.prompt_ops import silu_mul

    torch.manual_seed(0)
    gate, up = nn.Linear(64, 96, bias=bias).bfloat16(), nn.Linear(64, 96, bias=bias).bfloat16()
    packed = PrepackedWeight([gate, up], gate_up=True)
    plain = PrepackedWeight([gate, up])
    for rows in (1, 17, 300):
        x = torch.randn(rows, 64).bfloat16() * 3
        gate_up = packed.linear(x)
        assert packed.interleaved and gate_up.shape == (rows, 192)
        assert torch.equal(gate_up, plain.linear(x))
        fused = packed.silu_linear(x)
        assert fused.shape == (rows, 96) and torch.equal(fused, silu_mul([gate_up]))
        assert torch.equal(packed.silu_linear(x[-1:]), fused[-1:])
    assert plain.silu_linear(x) is None  # not a gate|up weight: no fused form
