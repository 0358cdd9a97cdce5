"""The int4 path: Q4_1-style grid, row-invariant kernel, prompt/generated row split, block tags."""

import pytest
import torch

from prefixcache.cache.hashing import OUTPUT_KEY_PREFIX, BlockHasher, output_slot_of_extra_key, tenant_extra_key
from prefixcache.config import EngineConfig
from prefixcache.errors import InvalidInputError
from prefixcache.layers.quant import (INT4_OUTPUT_KEY, RowSplit, group_int8_linear, int4_linear, quantize_weight_group_int8,
                                      quantize_weight_int4, row_split, split_rows)

KERNELS = pytest.mark.requires_isa("avx2")  # int4_mm / int8_mm (our C++ kernels: the AVX2 or AVX-512 build)


def _grid_weight(n, k, seed=0):
    """A weight on a Q4_1 grid: per group of 32, levels 0..15 (both ends used) times d plus m."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(n, k // 32, 1, generator=g) * 0.01 + 0.001
    m = torch.randn(n, k // 32, 1, generator=g) * 0.05
    return (q * d + m).reshape(n, k)


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Levels q [N, K] from the kernel's layout [N / 16, K / 8, 64] (byte 4 j + i: q[j, i] | q[j, 4 + i] << 4)."""
    nb, c = packed.shape[:2]
    b = packed.view(nb, c, 16, 4)
    q = torch.stack([b & 15, b >> 4], dim=3)  # [block, c, j, half, i]
    return q.permute(0, 2, 1, 3, 4).reshape(nb * 16, c * 8)


def test_a_weight_on_the_grid_gets_its_levels_back_with_float16_scale_and_min():
    w = _grid_weight(64, 96)
    q = quantize_weight_int4(w)
    assert q.packed.shape == (4, 12, 64) and q.packed.dtype == torch.uint8
    assert q.scale.shape == q.min.shape == (4, 3, 16) and q.scale.dtype == torch.float16
    levels = _unpack_int4(q.packed).float()  # [64, 96]
    by_output = lambda t: t.float().transpose(1, 2).reshape(64, 3).repeat_interleave(32, 1)  # noqa: E731
    deq = levels * by_output(q.scale) + by_output(q.min)
    assert torch.allclose(deq, w, rtol=0, atol=2e-4)  # float16 scale and min: 11-bit mantissas
    g = torch.Generator().manual_seed(0)
    expected = torch.randint(0, 16, (64, 3, 32), generator=g).float()
    expected[..., 0], expected[..., 1] = 0, 15  # _grid_weight's levels
    assert torch.equal(levels, expected.reshape(64, 96))


def _exact_case(n, k, rows, seed):
    """Weights and activations whose every product and partial sum is exact in float32: levels times
    power-of-two scales, activations already on their int8 grid (each group's max |q| = 127)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g).float()
    q[:, 0::32], q[:, 1::32] = 0, 15  # each group spans the grid: scale = 2**-6 exactly
    m = torch.randint(-8, 8, (n, k // 32), generator=g).float() * 2.0**-6
    w = q * 2.0**-6 + m.repeat_interleave(32, 1)
    qx = torch.randint(-127, 128, (rows, k // 32, 32), generator=g).float()
    qx[..., 5] = 127
    x = (qx * 2.0**-7).reshape(rows, k)
    return w, x


@KERNELS
def test_int4_linear_is_exact_where_float32_is_exact():
    w, x = _exact_case(48, 96, 10, seed=5)
    b = torch.randint(-64, 64, (48,)).float() * 2.0**-6
    y = int4_linear(x, quantize_weight_int4(w, b))  # float32 in, float32 out
    assert y.dtype == torch.float32
    assert torch.equal(y.double(), x.double() @ w.double().t() + b.double())


@KERNELS
def test_group_int8_linear_is_exact_where_float32_is_exact():
    g = torch.Generator().manual_seed(6)
    q = torch.randint(-127, 128, (32, 64), generator=g).float()
    q[:, 0], q[:, 32] = 127, -127  # each group's max |q| = 127: scale = 2**-6 exactly
    w = q * 2.0**-6
    _, x = _exact_case(32, 64, 7, seed=7)
    y = group_int8_linear(x, quantize_weight_group_int8(w), torch.float32)
    assert torch.equal(y.double(), x.double() @ w.double().t())


@KERNELS
@pytest.mark.parametrize("linear", ["int4", "int8"])
def test_a_row_gets_the_same_bits_in_any_call(linear):
    w, b = _grid_weight(48, 64, seed=1), torch.randn(48)
    if linear == "int4":
        q = quantize_weight_int4(w, b)
        f = lambda rows: int4_linear(rows, q)  # noqa: E731
    else:
        q8 = quantize_weight_group_int8(w)
        f = lambda rows: group_int8_linear(rows, q8, torch.bfloat16)  # noqa: E731
        b = torch.zeros(48)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    single = torch.cat([f(x[i : i + 1]) for i in range(40)])
    for m in (2, 3, 4, 5, 9, 17, 33, 40):
        assert torch.equal(f(x[:m]), single[:m]), m
    assert torch.equal(f(x[7:30]), single[7:30])
    assert single.dtype == torch.bfloat16
    ref = x.float() @ w.t() + b  # int8 activations + bf16 output: close, not equal
    assert torch.allclose(single.float(), ref, atol=0.05, rtol=0.02)


@KERNELS
def test_non_finite_activations_give_that_row_nan_and_subnormal_groups_count_as_zeros():
    w = _grid_weight(32, 64, seed=8)
    q4, q8 = quantize_weight_int4(w), quantize_weight_group_int8(w)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(9))
    x[1, 3], x[2, 40] = float("nan"), float("inf")
    x[3, 32:] = 1e-39  # a group of subnormals: 1 / (max / 127) overflows
    for y in (int4_linear(x, q4), group_int8_linear(x, q8, torch.float32)):
        assert bool(y[1].isnan().all()) and bool(y[2].isnan().all())
        assert bool(y[0].isfinite().all()) and bool(y[3].isfinite().all())
    x3 = x[3:4].clone()
    x3[0, 32:] = 0
    assert torch.equal(int4_linear(x[3:4], q4), int4_linear(x3, q4))


def test_shapes_the_kernel_cannot_take_are_refused():
    with pytest.raises(ValueError, match="in_features % 32"):
        quantize_weight_int4(torch.randn(32, 48))
    with pytest.raises(ValueError, match="out_features % 16"):
        quantize_weight_int4(torch.randn(40, 64))
    with pytest.raises(ValueError, match="out_features % 16"):
        quantize_weight_group_int8(torch.randn(40, 64))


@KERNELS
def test_split_rows_runs_generated_rows_quantized_and_prompt_rows_dense():
    """The int4 model's logits rows: generated tokens' on the quantized product, a prompt's last
    token's on the dense one, stitched back in row order."""
    w = _grid_weight(32, 64, seed=3)
    q = quantize_weight_int4(w)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    dense = lambda rows: torch.nn.functional.linear(rows, w.bfloat16())  # noqa: E731
    quantized = lambda rows: int4_linear(rows, q)  # noqa: E731
    split = RowSplit(int4_rows=torch.tensor([1, 4, 5]), dense_rows=torch.tensor([0, 2, 3]))
    assert torch.equal(split_rows(x, dense, quantized), dense(x))  # no split set: all dense
    with row_split(split):
        y = split_rows(x, dense, quantized)
    assert torch.equal(y[[1, 4, 5]], int4_linear(x[[1, 4, 5]], q))
    assert torch.equal(y[[0, 2, 3]], dense(x[[0, 2, 3]]))
    with row_split(RowSplit(int4_rows=torch.arange(6), dense_rows=torch.arange(0))):
        assert torch.equal(split_rows(x, dense, quantized), int4_linear(x, q))
    assert torch.equal(split_rows(x, dense, quantized), dense(x))  # the context ended


def test_blocks_holding_generated_tokens_get_the_output_key():
    tokens = list(range(100, 164))  # 4 blocks of 16
    plain, tagged = BlockHasher(16), BlockHasher(16, output_block_key=INT4_OUTPUT_KEY)
    h_plain, h_prompt, h_gen = [], [], []
    plain.extend(h_plain, tokens, b"root")
    tagged.extend(h_prompt, tokens, b"root", num_prompt_tokens=64)  # all prompt: as without the key
    tagged.extend(h_gen, tokens, b"root", num_prompt_tokens=40)  # blocks 2 and 3 hold generated tokens
    assert h_prompt == h_plain
    assert h_gen[:2] == h_plain[:2] and h_gen[2] != h_plain[2] and h_gen[3] != h_plain[3]
    assert h_gen[2] == tagged.hash_block(h_plain[1], tokens[32:48],
                                         OUTPUT_KEY_PREFIX + INT4_OUTPUT_KEY + (40 % 16).to_bytes(4, "little"))
    h_gen41 = []  # the same tokens, generation starting one slot later in block 2: another block
    tagged.extend(h_gen41, tokens, b"root", num_prompt_tokens=41)
    assert h_gen41[:2] == h_gen[:2] and h_gen41[2] != h_gen[2] and h_gen41[3] != h_gen[3]
    assert tagged.output_key(41) == OUTPUT_KEY_PREFIX + INT4_OUTPUT_KEY + b"\x09\x00\x00\x00"
    assert tagged.output_key(48)[-4:] == bytes(4)
    # the slot is read back only from what follows the tenant part and starts with the output prefix
    assert output_slot_of_extra_key(tagged.output_key(41)) == 9
    assert output_slot_of_extra_key(tenant_extra_key("t") + tagged.output_key(41)) == 9
    assert output_slot_of_extra_key(tenant_extra_key("t") + tagged.output_key(48)) == 0
    assert output_slot_of_extra_key(tenant_extra_key("abcd")) is None
    assert output_slot_of_extra_key(b"") is None
    assert output_slot_of_extra_key(b"any other key part") is None
    assert output_slot_of_extra_key(tenant_extra_key("t") + b"\x01\x02\x03\x04") is None


@KERNELS
def test_int4_needs_bfloat16():
    with pytest.raises(InvalidInputError, match="dtype='bfloat16'") as e:
        EngineConfig(quantization="int4").validate()
    assert e.value.field == "quantization"
    EngineConfig(quantization="int4-int8", dtype="bfloat16").validate()
    EngineConfig(quantization="int4", dtype="bfloat16", device="cuda").validate()  # on a CPU: where bf16 products run
