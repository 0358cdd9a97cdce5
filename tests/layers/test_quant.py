"""The W8A8 linear path: exact integer products, batch invariance, fused = separate."""

from types import SimpleNamespace

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


def _fused():
    from prefixcache.layers import quant

    kernels = quant._fused_int8_rows()
    if kernels is None:
        pytest.skip("our CPU kernels don't run here (no AVX512-VNNI or no compiler): int8 uses the torch ops")
    return kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_int8_rows_give_the_torch_ops_bits(dtype):
    """csrc/int8_rows.cpp: the same int8 rows, scales and outputs as the torch ops it replaces, over odd
    widths (masked tails), tiny and large magnitudes, an all-zero row, with and without bias, float32
    and bf16 outputs."""
    from prefixcache.layers.quant import int8_rows_to_float_torch, quantize_activations_torch

    kernels = _fused()
    gen = torch.Generator().manual_seed(11)
    for trial in range(60):
        m, k, n = (int(v) for v in torch.randint(1, 90, (3,), generator=gen))
        magnitude = 10.0 ** float(torch.empty(()).uniform_(-6, 3, generator=gen))
        x = (torch.randn(m, k, generator=gen) * magnitude).to(dtype)
        x[trial % m] = 0
        q, s = kernels.quantize_rows_int8(x)
        q_ref, s_ref = quantize_activations_torch(x)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref), (m, k)
        w = quantize_weight(torch.randn(n, k, generator=gen), torch.randn(n, generator=gen) if trial % 3 else None)
        acc = q_ref.int() @ w.qweight.int()
        for out_dtype in (torch.float32, torch.bfloat16):
            y = kernels.int8_rows_to_float(acc, s_ref, w.scale, w.bias, out_dtype)
            assert torch.equal(y, int8_rows_to_float_torch(acc, s_ref, w, out_dtype)), (m, k, n, out_dtype)


def test_fused_int8_rows_make_a_non_finite_row_nan_alone():
    kernels = _fused()
    x = _rand(4, 40, seed=12)
    x[1, 3], x[2, 39] = float("nan"), float("-inf")
    q, s = kernels.quantize_rows_int8(x)
    assert s[1].isnan() and s[2].isnan() and q[1:3].eq(0).all()
    assert torch.equal(q[[0, 3]], quantize_activations(x[[0, 3]])[0])
    w = quantize_weight(_rand(24, 40, seed=13))
    y = int8_linear(q, s, w, torch.bfloat16)
    assert y[1:3].isnan().all() and y[[0, 3]].isfinite().all()


def test_int8_linear_takes_the_fused_path_where_the_kernels_run(monkeypatch):
    """The model's int8 layers go through the fused kernels (their bits, checked above), and through
    the torch ops with PREFIXCACHE_INT8_FUSED=0."""
    from prefixcache.layers import quant

    kernels = _fused()
    uncached = quant._fused_int8_rows.__wrapped__
    calls = []
    monkeypatch.setattr(quant, "_fused_int8_rows", lambda: SimpleNamespace(
        quantize_rows_int8=lambda x: calls.append("q") or kernels.quantize_rows_int8(x),
        int8_rows_to_float=lambda *a: calls.append("y") or kernels.int8_rows_to_float(*a)))
    w = quantize_weight(_rand(16, 32, seed=14))
    int8_linear(*quantize_activations(_rand(3, 32, seed=15)), w, torch.bfloat16)
    assert calls == ["q", "y"]
    monkeypatch.setenv("PREFIXCACHE_INT8_FUSED", "0")
    assert uncached() is None


def test_fused_rescale_refuses_scales_of_other_shapes():
    """Review: a [1, M] row scale was taken per row where torch broadcasts it per column."""
    kernels = _fused()
    acc = torch.arange(1, 10, dtype=torch.int32).reshape(3, 3)
    for x_scale, w_scale in ((torch.ones(1, 3), torch.ones(3)), (torch.ones(3), torch.ones(3)),
                             (torch.ones(3, 1), torch.ones(3, 1))):
        with pytest.raises(RuntimeError, match="must be a contiguous float32"):
            kernels.int8_rows_to_float(acc, x_scale, w_scale, None, torch.float32)

