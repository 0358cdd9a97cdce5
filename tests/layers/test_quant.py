"""The W8A8 linear path: exact integer products, batch invariance, fused = separate, SmoothQuant's
smoothing."""

from types import SimpleNamespace

import pytest
import torch

from prefixcache.layers.quant import (int8_linear, int8_product, quantize_activations, quantize_weight,
                                     recording_activation_amax, smooth_factors)


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
    weights = [_rand(n, 64, seed=7 + n) for n in (32, 16, 16)]
    biases = [_rand(32, seed=32), torch.zeros(16), _rand(16, seed=16)]
    parts = [quantize_weight(w, b) for w, b in zip(weights, biases)]
    fused = quantize_weight(torch.cat(weights), torch.cat(biases))  # as the model stacks q, k, v
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
    """kernels/csrc/int8_rows.cpp: the same int8 rows, scales and outputs as the torch ops it replaces, over odd
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
        mul = torch.exp(torch.randn(k, generator=gen) * 2)  # smoothing multipliers, e^-6..e^6
        assert all(map(torch.equal, kernels.quantize_rows_int8(x, mul), quantize_activations_torch(x, mul))), (m, k)
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
        quantize_rows_int8=lambda x, mul: calls.append("q") or kernels.quantize_rows_int8(x, mul),
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



def test_fused_quantize_refuses_a_multiplier_of_another_shape():
    kernels = _fused()
    for mul in (torch.ones(4), torch.ones(1, 5), torch.ones(5, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match="mul must be a contiguous float32 \\[K\\]"):
            kernels.quantize_rows_int8(torch.ones(2, 5), mul)


def test_smooth_factors_follow_smoothquant():
    """s_j = max|X_j|^0.5 / max|W_j|^0.5 (Xiao et al., 2023, eq. 4) with max|X_j| raised to the channels'
    (lower) median first: the channel quiet in calibration (0) gets the median's 1, not 1e-5."""
    act = torch.tensor([4.0, 1.0, 0.0, 100.0])
    w = torch.tensor([[1.0, -4.0, 2.0, 0.25], [-0.5, 1.0, 0.0, 0.01]])
    s = smooth_factors(act, w)
    expected = [4 ** 0.5 / 1.0, 1.0 / 2.0, 1.0 / 2 ** 0.5, 10.0 / 0.5]
    torch.testing.assert_close(s, torch.tensor(expected), rtol=1e-6, atol=0)
    torch.testing.assert_close(smooth_factors(act, w, alpha=1.0), torch.tensor([4.0, 1.0, 1.0, 100.0]))


def test_smoothing_is_exact_in_real_arithmetic_and_tames_an_outlier_channel():
    """x / s @ (W s)^T = x @ W^T; with one input channel 100x the others (the outliers SmoothQuant is
    about), per-token int8 loses the small channels and the smoothed product is far closer to the float one."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(64, 96, generator=gen)
    x[:, 7] *= 100
    w = torch.randn(48, 96, generator=gen) / 10
    ref = x @ w.t()
    plain = quantize_weight(w)
    s = smooth_factors(x.abs().amax(0), w)
    smoothed = quantize_weight(w, None, s)
    assert plain.act_mul is None and torch.equal(smoothed.act_mul, torch.reciprocal(s))
    torch.testing.assert_close((x * smoothed.act_mul) @ (w * s).t(), ref, rtol=1e-4, atol=1e-3)
    err_plain = (int8_product(x, plain, torch.float32) - ref).norm() / ref.norm()
    err_smooth = (int8_product(x, smoothed, torch.float32) - ref).norm() / ref.norm()
    assert err_smooth < err_plain / 3, (err_plain, err_smooth)
    # rows stay independent: the smoothed product of a batch is each row's alone
    alone = torch.cat([int8_product(x[i : i + 1], smoothed, torch.float32) for i in range(8)])
    assert torch.equal(int8_product(x[:8], smoothed, torch.float32), alone)


def test_recording_activation_amax_keeps_each_weights_largest_inputs():
    a, b = quantize_weight(_rand(8, 4, seed=22)), quantize_weight(_rand(8, 4, seed=23))
    with recording_activation_amax() as amax:
        int8_product(torch.tensor([[1.0, -5.0, 0.0, 2.0]]), a, torch.float32)
        int8_product(torch.tensor([[-3.0, 1.0, 0.5, 0.0], [0.0, 0.0, 0.0, -7.0]]), a, torch.float32)
        int8_product(torch.tensor([[1.0, 1.0, 1.0, 1.0]]), b, torch.float32)
    assert amax[id(a)].tolist() == [3.0, 5.0, 0.5, 7.0] and amax[id(b)].tolist() == [1.0, 1.0, 1.0, 1.0]
    int8_product(torch.ones(1, 4), a, torch.float32)  # outside the block: nothing recorded
    assert amax[id(a)].tolist() == [3.0, 5.0, 0.5, 7.0]
    with recording_activation_amax() as amax:  # a row that overflowed (a NaN or an infinity) is left out
        int8_product(torch.tensor([[1.0, 2.0, 3.0, 4.0], [float("inf"), 0.0, 9.0, 0.0],
                                   [0.5, float("nan"), 0.0, 0.0]]), a, torch.float32)
        int8_product(torch.tensor([[float("inf"), 1.0, 1.0, 1.0]]), b, torch.float32)
    assert amax[id(a)].tolist() == [1.0, 2.0, 3.0, 4.0] and id(b) not in amax


def test_a_row_split_holds_in_its_own_thread_only():
    """Review (2026-12-03): the running step's RowSplit was process-wide, so another engine's thread
    computing prompt logprobs (all rows dense) meanwhile ran some rows on the 8-bit lm_head, others
    into an unfilled buffer. Now a split is per thread; nested splits restore the outer one."""
    import threading

    from prefixcache.layers.quant import RowSplit, row_split, split_rows

    x = torch.arange(12.0).reshape(4, 3)
    split = RowSplit(int4_rows=torch.tensor([1, 3]), dense_rows=torch.tensor([0, 2]))
    dense, quantized = (lambda rows: rows + 100), (lambda rows: rows - 100)
    inside, done, seen = threading.Event(), threading.Event(), {}

    def step():
        with row_split(split):
            inside.set()
            done.wait(10)
            seen["step"] = split_rows(x, dense, quantized)

    t = threading.Thread(target=step)
    t.start()
    inside.wait(10)
    seen["other"] = split_rows(x, dense, quantized)  # another thread while the step's split is set
    done.set()
    t.join()
    assert torch.equal(seen["other"], x + 100)
    assert torch.equal(seen["step"], torch.stack([x[0] + 100, x[1] - 100, x[2] + 100, x[3] - 100]))
    with row_split(split):
        with row_split(None):
            assert torch.equal(split_rows(x, dense, quantized), x + 100)
        assert torch.equal(split_rows(x, dense, quantized), seen["step"])
