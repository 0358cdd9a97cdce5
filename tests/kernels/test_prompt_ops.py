"""The fused element-wise ops of a bf16 model's prompt rows (kernels/prompt_ops.py, csrc/prompt_ops.cpp):
RoPE + K/V write with exactly torch's bits, the residual add with torch's bits and RMSNorm / SiLU close
to float64, a row's bits the same in any tiling and batch, and the inputs they refuse."""

import pytest
import torch
import torch.nn.functional as F

from prefixcache.kernels.prefill_attention import prefill_kernel_supported
from prefixcache.kernels.prompt_ops import add_rms_norm, rope_write_kv, silu_mul
from prefixcache.layers.rotary import RotaryEmbedding, apply_rotary_emb

pytestmark = pytest.mark.skipif(not prefill_kernel_supported(9, 3, 64),
                                reason="the fused prompt ops run with the paged kernel (AVX512-BF16)")


def bf16(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def split(x, sizes):
    """Row tiles of x (contiguous), as row_tiles gives them."""
    return [t.contiguous() for t in torch.split(x, sizes)]


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 32), (2, 1, 128)])
def test_rope_write_kv_has_torchs_bits_and_writes_the_pool(heads, kv_heads, head_dim):
    T, num_blocks, block = 37, 16, 4
    qkv = bf16(T, (heads + 2 * kv_heads) * head_dim, seed=1, scale=3.0)
    positions = torch.tensor([5, 900, 0, 17] + list(range(40, 73)))
    cos, sin_rot = RotaryEmbedding(head_dim, 10000.0, None)(positions, torch.bfloat16)
    slots = torch.randperm(num_blocks * block, generator=torch.Generator().manual_seed(2))[:T]
    pool = torch.full((2, num_blocks, block, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    q = rope_write_kv(split(qkv, [16, 16, 5]), cos, sin_rot, pool, slots, heads, kv_heads)

    qk = apply_rotary_emb(qkv[:, : (heads + kv_heads) * head_dim].view(T, heads + kv_heads, head_dim), cos, sin_rot)
    assert q.is_contiguous() and q.shape == (T, heads, head_dim)
    assert torch.equal(q, qk[:, :heads])
    flat = pool.view(2, -1, kv_heads, head_dim)
    assert torch.equal(flat[0, slots], qk[:, heads:])
    assert torch.equal(flat[1, slots], qkv[:, (heads + kv_heads) * head_dim :].view(T, kv_heads, head_dim))
    untouched = torch.ones(num_blocks * block, dtype=torch.bool)
    untouched[slots] = False
    assert flat[:, untouched].isnan().all()  # no other slot written
    # one tile, or the row alone: the same bits
    pool2 = torch.zeros_like(pool)
    assert torch.equal(rope_write_kv([qkv], cos, sin_rot, pool2, slots, heads, kv_heads), q)
    assert torch.equal(rope_write_kv([qkv[7:8].clone()], cos[7:8], sin_rot[7:8], pool2, slots[7:8], heads, kv_heads),
                       q[7:8])


@pytest.mark.parametrize("hidden", [576, 40, 7])
def test_add_rms_norm_adds_with_torchs_bits_and_norms_close_to_float64(hidden):
    T, eps = 21, 1e-5
    x, residual = bf16(T, hidden, seed=3, scale=4.0), bf16(T, hidden, seed=4, scale=10.0)
    weight = bf16(hidden, seed=5)
    y, h = add_rms_norm(split(x, [8, 8, 5]), residual, weight, eps)
    assert torch.equal(h, residual + x)  # torch's bf16 add
    h64 = h.double()
    ref = weight.double() * (h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps))
    torch.testing.assert_close(y.double(), ref, atol=0.02, rtol=0.01)
    # close to the torch form (RMSNorm in layers/norm.py): at most 1 bf16 ulp apart
    torch_form = weight * F.rms_norm(h.float(), (hidden,), None, eps).bfloat16()
    torch.testing.assert_close(y.float(), torch_form.float(), atol=0, rtol=2**-7)
    # a row's bits in any tiling and alone
    for tiles, res in ((x, residual), (x[9:10].clone(), residual[9:10].clone())):
        y2, h2 = add_rms_norm([tiles], res, weight, eps)
        n = tiles.shape[0]
        rows = slice(0, T) if n == T else slice(9, 10)
        assert torch.equal(y2, y[rows]) and torch.equal(h2, h[rows])


def test_add_rms_norm_without_residual_returns_its_one_tile_as_the_stream():
    x, weight = bf16(6, 64, seed=6), bf16(64, seed=7)
    y, h = add_rms_norm([x], None, weight, 1e-6)
    assert h is x or h.data_ptr() == x.data_ptr()
    y2, h2 = add_rms_norm(split(x, [4, 2]), None, weight, 1e-6)  # several tiles: a new stream, same values
    assert torch.equal(h2, x) and h2.data_ptr() != x.data_ptr() and torch.equal(y2, y)


@pytest.mark.parametrize("inter", [1536, 24])
def test_silu_mul_close_to_torch_and_the_same_bits_in_any_tiling(inter):
    T = 19
    gate_up = bf16(T, 2 * inter, seed=8, scale=3.0)
    out = silu_mul(split(gate_up, [16, 3]))
    gate, up = gate_up.chunk(2, dim=-1)
    ref = (F.silu(gate.double()) * up.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-2)
    torch_form = (F.silu(gate) * up).float()  # layers' torch ops: at most 1 bf16 ulp (x2 roundings) apart
    torch.testing.assert_close(out.float(), torch_form, atol=1e-6, rtol=2**-6)
    assert torch.equal(silu_mul([gate_up]), out)
    assert torch.equal(silu_mul([gate_up[4:5].clone()]), out[4:5])


def test_refused_inputs_name_the_problem_and_write_nothing():
    heads, kv_heads, hd = 2, 1, 32
    qkv = bf16(3, (heads + 2 * kv_heads) * hd)
    cos, sin_rot = RotaryEmbedding(hd, 10000.0, None)(torch.arange(3), torch.bfloat16)
    pool = torch.zeros(2, 2, 4, kv_heads, hd, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the pool"):
        rope_write_kv([qkv], cos, sin_rot, pool, torch.tensor([0, 8, 1]), heads, kv_heads)
    assert not pool.any()
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        rope_write_kv([qkv.float()], cos, sin_rot, pool, torch.tensor([0, 1, 2]), heads, kv_heads)
    with pytest.raises(RuntimeError, match="residual"):
        add_rms_norm([bf16(3, 64)], bf16(4, 64), bf16(64), 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        add_rms_norm([bf16(3, 64)], None, bf16(32), 1e-6)
    with pytest.raises(RuntimeError, match="even width"):
        silu_mul([bf16(3, 7)])
    with pytest.raises(RuntimeError, match="at least one tile"):
        silu_mul([])
