"""The int4 path: Q4_1-style grid, row-invariant kernel, prompt/generated row split, block tags."""

import pytest
import torch

from prefixcache.cache.hashing import BlockHasher
from prefixcache.config import EngineConfig
from prefixcache.errors import InvalidInputError
from prefixcache.layers.quant import RowSplit, int4_linear, quantize_weight_int4, row_split, split_linear


def _grid_weight(n, k, seed=0):
    """A weight on a Q4_1 grid: per group of 32, levels 0..15 (both ends used) times d plus m."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(n, k // 32, 1, generator=g) * 0.01 + 0.001
    m = torch.randn(n, k // 32, 1, generator=g) * 0.05
    return (q * d + m).reshape(n, k)


def test_a_weight_on_the_grid_comes_back_to_bf16_rounding_of_scale_and_zero():
    w = _grid_weight(64, 96)
    q = quantize_weight_int4(w)
    assert q.packed.shape == (64, 48) and q.scales_zeros.shape == (3, 64, 2)
    eye = torch.eye(96).bfloat16()
    deq = int4_linear(eye, q).float().t()  # [64, 96]: column j of the identity product = w[:, j]
    scale = q.scales_zeros[..., 0].float().t().repeat_interleave(32, 1)  # [64, 96]
    # levels exact: the error is only scale/zero's bf16 rounding (and the product's bf16 output)
    assert (deq - w).abs().max() <= 8 * scale.max() * 2**-8 + w.abs().max() * 2**-8
    assert torch.allclose(deq, w, atol=2e-3)


def test_int4_linear_gives_a_row_the_same_bits_in_any_call_and_adds_the_bias():
    w, b = _grid_weight(48, 64, seed=1), torch.randn(48)
    q = quantize_weight_int4(w, b)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    single = torch.cat([int4_linear(x[i : i + 1], q) for i in range(40)])
    for m in (2, 3, 4, 5, 17, 33, 40):
        assert torch.equal(int4_linear(x[:m], q), single[:m]), m
    assert torch.equal(int4_linear(x[7:30], q), single[7:30])
    ref = x.float() @ w.t() + b
    assert torch.allclose(single.float(), ref, atol=0.05, rtol=0.02)


def test_shapes_the_kernel_cannot_take_are_refused():
    with pytest.raises(ValueError, match="in_features % 32"):
        quantize_weight_int4(torch.randn(32, 48))
    with pytest.raises(ValueError, match="out_features % 16"):
        quantize_weight_int4(torch.randn(40, 64))


def test_split_linear_runs_generated_rows_on_int4_and_prompt_rows_dense():
    w = _grid_weight(32, 64, seed=3)
    q = quantize_weight_int4(w)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    dense = lambda rows: torch.nn.functional.linear(rows, w.bfloat16())  # noqa: E731
    split = RowSplit(int4_rows=torch.tensor([1, 4, 5]), dense_rows=torch.tensor([0, 2, 3]))
    assert torch.equal(split_linear(x, dense, q), dense(x))  # no split set: all dense
    with row_split(split):
        y = split_linear(x, dense, q)
    assert torch.equal(y[[1, 4, 5]], int4_linear(x[[1, 4, 5]], q))
    assert torch.equal(y[[0, 2, 3]], dense(x[[0, 2, 3]]))
    with row_split(RowSplit(int4_rows=torch.arange(6), dense_rows=torch.arange(0))):
        assert torch.equal(split_linear(x, dense, q), int4_linear(x, q))
    assert torch.equal(split_linear(x, dense, q), dense(x))  # the context ended


def test_blocks_holding_generated_tokens_get_the_output_key():
    tokens = list(range(100, 164))  # 4 blocks of 16
    plain, tagged = BlockHasher(16), BlockHasher(16, output_block_key=b"int4-generated")
    h_plain, h_prompt, h_gen = [], [], []
    plain.extend(h_plain, tokens, b"root")
    tagged.extend(h_prompt, tokens, b"root", num_prompt_tokens=64)  # all prompt: as without the key
    tagged.extend(h_gen, tokens, b"root", num_prompt_tokens=40)  # blocks 2 and 3 hold generated tokens
    assert h_prompt == h_plain
    assert h_gen[:2] == h_plain[:2] and h_gen[2] != h_plain[2] and h_gen[3] != h_plain[3]
    assert h_gen[2] == tagged.hash_block(h_plain[1], tokens[32:48], b"int4-generated")


def test_int4_needs_bfloat16():
    with pytest.raises(InvalidInputError, match="dtype='bfloat16'") as e:
        EngineConfig(quantization="int4").validate()
    assert e.value.field == "quantization"
    EngineConfig(quantization="int4", dtype="bfloat16").validate()
