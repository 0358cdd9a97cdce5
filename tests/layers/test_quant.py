"""The W8A8 linear path: exact integer products, batch invariance, fused = separate."""

import pytest
import torch

from prefixcache.layers.quant import concat_weights, int8_linear, quantize_activations, quantize_weight


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_quantize_weight_per_channel():
    w = torch.tensor([[0.5, -1.0, 0.25], [2.0, 0.0, -0.5], [0.0, 0.0, 0.0]])
    q = quantize_weight(w, torch.tensor([1.0, 2.0, 3.0]))
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (3, 3)  # [in, out]
    assert q.qweight.t().tolist() == [[64, -127, 32], [127, 0, -32], [0, 0, 0]]  # round(w / (max|row| / 127))
    torch.testing.assert_close(q.scale, torch.tensor([1.0 / 127, 2.0 / 127, 1e-12]), rtol=0, atol=0)
    assert q.bias.tolist() == [1.0, 2.0, 3.0]


def test_quantize_activations_per_row():
    x = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0], [-3.0, 3.0, 1.5]])
    xq, scale = quantize_activations(x)
    assert xq.tolist() == [[127, -64, 32], [0, 0, 0], [-127, 127, 64]]  # halves round to even: 63.5 -> 64
    assert scale.shape == (3, 1)


def test_int8_linear_is_the_exact_integer_product():
    x, w, b = _rand(5, 64, seed=1), _rand(48, 64, seed=2), _rand(48, seed=3)
    qw = quantize_weight(w, b)
    xq, xs = quantize_activations(x)
    y = int8_linear(xq, xs, qw, torch.float32)
    acc = xq.double() @ qw.qweight.double()  # exact: |sum| < 2**53
    expected = (acc.float() * xs * qw.scale) + qw.bias
    assert torch.equal(y, expected)
    # and close to the float product (per-row / per-channel 8-bit rounding)
    rel = (y - torch.nn.functional.linear(x, w, b)).norm() / torch.nn.functional.linear(x, w, b).norm()
    assert rel < 0.02


@pytest.mark.parametrize("num_rows", [1, 2, 3, 7, 16, 33, 200])
def test_each_row_is_the_same_in_any_batch(num_rows):
    """A token's output does not depend on which or how many other rows share the call."""
    w = quantize_weight(_rand(96, 80, seed=4))
    rows = _rand(200, 80, seed=5)
    alone = torch.cat([int8_linear(*quantize_activations(rows[i : i + 1]), w, torch.float32) for i in range(200)])
    for start in (0, 200 - num_rows):
        batch = rows[start : start + num_rows]
        assert torch.equal(int8_linear(*quantize_activations(batch), w, torch.float32), alone[start : start + num_rows])


def test_fused_projection_equals_separate_ones():
    x = _rand(9, 64, seed=6)
    parts = [quantize_weight(_rand(n, 64, seed=7 + n), _rand(n, seed=n) if n != 16 else None) for n in (32, 16, 16)]
    fused = concat_weights(parts)
    xq, xs = quantize_activations(x)
    split = int8_linear(xq, xs, fused, torch.float32).split([32, 16, 16], dim=-1)
    for part, got in zip(parts, split):
        expected = int8_linear(xq, xs, part, torch.float32)
        assert torch.equal(got, expected)
