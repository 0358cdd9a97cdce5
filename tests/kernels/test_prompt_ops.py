"""The fused element-wise ops of a bf16 model's prompt rows (kernels/prompt_ops.py, csrc/prompt_ops.cpp):
RoPE + K/V write with exactly torch's bits, the residual add with torch's bits and RMSNorm / SiLU close
to float64, a row's bits the same in any tiling and batch, and the inputs they refuse; the AVX2 build gives the
AVX-512 build's bits bit for bit (odd widths' tails, several row tiles, no residual, NaN, infinities, -0,
subnormals), and the calls run on the AVX2 build where ``PREFIXCACHE_KERNELS`` caps the CPU to AVX2."""

import pytest
import torch
import torch.nn.functional as F

from prefixcache.kernels import avx2_kernels, cpu_kernels, prompt_ops
from prefixcache.kernels.cpu_features import TIERS, reported_cpu_features
from prefixcache.kernels.cpu_kernels import CpuKernelsUnavailable
from prefixcache.kernels.prompt_ops import add_rms_norm, prompt_ops_supported, rope_write_kv, silu_mul
from prefixcache.layers.rotary import RotaryEmbedding, apply_rotary_emb

runs_here = pytest.mark.skipif(not prompt_ops_supported(),
                               reason="no build of the fused prompt ops here (AVX-512, AVX2 + FMA + F16C or NEON)")
AVX512 = pytest.mark.requires_isa("avx512")  # both x86 builds load: the AVX-512 tier's features include AVX2's
AVX2 = pytest.mark.requires_isa("avx2")


def bf16(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def split(x, sizes):
    """Row tiles of x (contiguous), as row_tiles gives them."""
    return [t.contiguous() for t in torch.split(x, sizes)]


def bits(t):
    return t.view(torch.int16)


@runs_here
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


@runs_here
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


@runs_here
def test_add_rms_norm_without_residual_returns_its_one_tile_as_the_stream():
    x, weight = bf16(6, 64, seed=6), bf16(64, seed=7)
    y, h = add_rms_norm([x], None, weight, 1e-6)
    assert h is x or h.data_ptr() == x.data_ptr()
    y2, h2 = add_rms_norm(split(x, [4, 2]), None, weight, 1e-6)  # several tiles: a new stream, same values
    assert torch.equal(h2, x) and h2.data_ptr() != x.data_ptr() and torch.equal(y2, y)


@runs_here
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


@runs_here
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


def _avx512():
    from prefixcache.kernels.cpu_kernels import load_cpu_kernels

    return load_cpu_kernels()


def _avx2():
    from prefixcache.kernels.avx2_kernels import load_avx2_kernels

    return load_avx2_kernels()


def special(*shape, seed, scale=1.0):
    """bf16 values spread over many binades; in a 2-D tensor's rows 1, 2, 4, 5, ... NaN, +-inf, +-0 and subnormals
    sprinkled in (rows 0, 3, ... stay finite), in a 1-D one +-0 and subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g) * 3) * scale
    u = torch.rand(*shape, generator=g)
    if x.dim() == 2:
        u[::3] = 1.0
    kinds = ((0.0, float("nan")), (0.02, float("inf")), (0.04, float("-inf"))) if x.dim() == 2 else ()
    for lo, value in (*kinds, (0.06, -0.0), (0.1, 0.0), (0.14, 1e-39)):
        x[(u >= lo) & (u < lo + 0.02 + (lo >= 0.06) * 0.02)] = value
    return x.bfloat16()


@AVX512
@pytest.mark.parametrize("hidden", [1, 7, 15, 16, 17, 40, 577, 576])
@pytest.mark.parametrize("specials", [False, True])
def test_add_rms_norm_avx2_build_has_the_avx512_bits(hidden, specials):
    a, b = _avx512(), _avx2()
    assert b.__name__.startswith("prefixcache_avx2_kernels") and not a.__name__.startswith("prefixcache_avx2")
    T = 21
    make = (lambda *s, seed: special(*s, seed=seed)) if specials else (lambda *s, seed: bf16(*s, seed=seed, scale=4.0))
    x, residual, weight = make(T, hidden, seed=hidden), make(T, hidden, seed=hidden + 1), make(hidden, seed=hidden + 2)
    for tiles in ([x], split(x, [8, 8, 5]), split(x, [1, 19, 1])):
        for res in (residual, None):
            y512, h512 = a.add_rms_norm([t.clone() for t in tiles], res, weight, 1e-5)
            y2, h2 = b.add_rms_norm([t.clone() for t in tiles], res, weight, 1e-5)
            assert torch.equal(bits(y2), bits(y512)) and torch.equal(bits(h2), bits(h512)), (len(tiles), res is None)
    if specials and hidden >= 40:  # rows with NaN and finite rows went through: not two all-NaN outputs compared
        assert y2.isnan().any() and y2[::3].isfinite().all()


@AVX512
def test_add_rms_norm_keeps_negative_zero_and_reads_no_element_past_a_row():
    """-0 + -0 = -0 in h and w * (-0 * r) in y, in both builds; a row of width 7 gives the same bits next to a row
    of NaN and infinities as alone (its tail lanes are +0, not the next row's elements)."""
    weight = torch.tensor([1.0, -2.0, 3.0, 0.5, -1.0, 2.0, 4.0]).bfloat16()
    zeros = torch.full((2, 7), -0.0).bfloat16()
    for kernels in (_avx512(), _avx2()):
        y, h = kernels.add_rms_norm([zeros.clone()], zeros, weight, 1e-6)
        assert (bits(h) == -32768).all()  # 0x8000: -0
        assert bits(y)[0].tolist() == [-32768, 0, -32768, -32768, 0, -32768, -32768]  # sign of w * -0
        rows = torch.cat([bf16(1, 7, seed=11, scale=3.0), torch.tensor([[float("nan"), float("inf")] * 3 + [1.0]])
                          .bfloat16()])
        y2, _ = kernels.add_rms_norm([rows], None, weight, 1e-6)
        alone, _ = kernels.add_rms_norm([rows[:1].clone()], None, weight, 1e-6)
        assert y2[0].isfinite().all() and torch.equal(bits(y2[0]), bits(alone[0]))


@AVX512
@pytest.mark.parametrize("inter", [1, 7, 24, 33, 1536])
@pytest.mark.parametrize("specials", [False, True])
def test_silu_mul_avx2_build_has_the_avx512_bits(inter, specials):
    T = 19
    gate_up = special(T, 2 * inter, seed=inter) if specials else bf16(T, 2 * inter, seed=inter, scale=3.0)
    for tiles in ([gate_up], split(gate_up, [16, 3]), split(gate_up, [5, 5, 9])):
        out512, out2 = _avx512().silu_mul(tiles), _avx2().silu_mul(tiles)
        assert torch.equal(bits(out2), bits(out512)), len(tiles)
    # exp's clamp at both ends (e^-g for g = +-100), saturation to +-inf and NaN: the same bits
    edge = torch.tensor([[100.0, -100.0, 87.5, -88.5, 0.0, -0.0, float("nan"), float("inf")] * 2 + [1.0] * 16]).bfloat16()
    assert torch.equal(bits(_avx2().silu_mul([edge])), bits(_avx512().silu_mul([edge])))


@AVX512
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 32), (2, 1, 128), (1, 1, 96)])
@pytest.mark.parametrize("specials", [False, True])
def test_rope_write_kv_avx2_build_has_the_avx512_bits(heads, kv_heads, head_dim, specials):
    T, S = 37, 64
    width = (heads + 2 * kv_heads) * head_dim
    if specials:
        qkv, cos, sin_rot = special(T, width, seed=1), special(T, head_dim, seed=2), special(T, head_dim, seed=3)
    else:
        qkv = bf16(T, width, seed=1, scale=3.0)
        cos, sin_rot = (t.view(T, head_dim) for t in RotaryEmbedding(head_dim, 10000.0, None)(
            torch.arange(T) * 7, torch.bfloat16))
    slots = torch.randperm(S, generator=torch.Generator().manual_seed(4))[:T]
    results = []
    for kernels in (_avx512(), _avx2()):
        k_slots = torch.full((S, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16)
        v_slots = k_slots.clone()
        q = kernels.rope_write_kv(split(qkv, [16, 16, 5]), cos, sin_rot, k_slots, v_slots, slots, heads, kv_heads)
        results.append((q, k_slots, v_slots))
    for got, want in zip(results[1], results[0]):
        assert torch.equal(bits(got), bits(want))


@pytest.fixture
def fresh_choice():
    """The build choice (cpu_kernels', cached per CPU feature set) forgotten before and after the test."""
    cpu_kernels._best_build.cache_clear()
    yield
    cpu_kernels._best_build.cache_clear()


class _Spy:
    """An extension whose calls are counted by name."""

    def __init__(self, module):
        self.module, self.calls = module, []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.module, name)


@AVX2
def test_capped_to_avx2_the_calls_run_on_the_avx2_build(fake_cpu, fresh_choice, monkeypatch):
    real = reported_cpu_features()
    kernels = _avx2()  # loaded uncapped, as the model's process would have it
    spy = _Spy(kernels)
    monkeypatch.setattr(avx2_kernels, "load_avx2_kernels", lambda: spy)
    fake_cpu(real, cap="avx2")
    assert prompt_ops.prompt_ops_build() == "avx2" and prompt_ops_supported()
    x, weight = bf16(5, 40, seed=12), bf16(40, seed=13)
    y, h = add_rms_norm(split(x, [3, 2]), None, weight, 1e-6)
    gate_up = bf16(5, 48, seed=14)
    out = silu_mul([gate_up])
    qkv = bf16(5, 4 * 32, seed=15)
    cos, sin_rot = RotaryEmbedding(32, 10000.0, None)(torch.arange(5), torch.bfloat16)
    pool = torch.zeros(2, 2, 4, 1, 32, dtype=torch.bfloat16)
    q = rope_write_kv([qkv], cos, sin_rot, pool, torch.tensor([3, 0, 7, 1, 2]), 2, 1)
    assert spy.calls == ["add_rms_norm", "silu_mul", "rope_write_kv"]
    assert torch.equal(bits(y), bits(kernels.add_rms_norm([x], None, weight, 1e-6)[0])) and torch.equal(h, x)
    assert torch.equal(bits(out), bits(kernels.silu_mul([gate_up])))
    assert q.shape == (5, 2, 32) and torch.equal(pool.view(2, 8, 1, 32)[1, 3, 0], qkv[0, 96:])  # v of row 0 at slot 3


def test_the_cap_chooses_the_build(fake_cpu, fresh_choice):
    real = reported_cpu_features()
    fake_cpu(real, cap="reference")
    assert prompt_ops.prompt_ops_build() == "" and not prompt_ops_supported()
    with pytest.raises(CpuKernelsUnavailable, match="AVX2 \\+ FMA \\+ F16C or aarch64 NEON"):
        silu_mul([bf16(2, 32)])
    fake_cpu(real)
    expected = "avx512" if TIERS["avx512"] <= real else "avx2" if TIERS["avx2"] <= real else "neon" if "asimd" in real else ""
    assert prompt_ops.prompt_ops_build() == expected
