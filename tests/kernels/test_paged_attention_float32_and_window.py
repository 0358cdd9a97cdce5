"""What only the paged prompt kernel's AVX2 form takes (csrc/prefill_attention_avx2.cpp): a float32 pool and a
sliding window. Right values against float64 attention, a row's exact bits whatever its batch, chunking or
decode, keys before every row's window never read (a sliding group may have released their blocks), and
the routing: which form a pool gets (kernel_form), what the other forms refuse, the cache key's names."""

import math
import random

import pytest
import torch

from prefixcache.kernels.prefill_attention import (build_paged_rows, form_supported, kernel_form,
                                                   paged_prefill_attention, prefill_form, prefill_kernel_supported)
from prefixcache.layers.attention.metadata import build_attention_metadata, build_sliding_attention_metadata
from prefixcache.layers.attention.numerics import (PAGED_ATTENTION_NUMERICS, PAGED_AVX2_NUMERICS, PAGED_KV_NUMERICS,
                                                   kv_numerics)

pytestmark = pytest.mark.skipif(not form_supported("avx2"), reason="the kernel's AVX2 form needs AVX2, FMA and F16C")
BLOCK, NUM_BLOCKS, SEQ_BLOCKS = 16, 200, 44
DTYPES = [torch.float32, torch.bfloat16]


class Pool:
    """A pool of ``dtype`` holding two 700-token sequences' K/V in scattered blocks, and their queries."""

    def __init__(self, heads, kv_heads, head_dim, dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.pool = torch.randn(2, NUM_BLOCKS, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
        blocks = random.Random(seed).sample(range(1, NUM_BLOCKS), 2 * SEQ_BLOCKS)  # block 0 kept for "released"
        self.tables = [blocks[SEQ_BLOCKS * i : SEQ_BLOCKS * (i + 1)] for i in range(2)]
        self.q = [torch.randn(700, heads, head_dim, generator=gen).to(dtype) for _ in range(2)]

    def run(self, batch, window=0, tables=None, form=None):
        """batch: (sequence, num_computed, num_new); the new tokens' outputs [tokens, heads, head_dim]."""
        tables = tables or self.tables
        seqs = [(c, n, tables[i]) for i, c, n in batch]
        options = dict(batch_invariant=True, dtype=self.pool.dtype, num_pool_blocks=NUM_BLOCKS, paged_kernel=True)
        if window:
            md, _ = build_sliding_attention_metadata(seqs, BLOCK, "cpu", window, **options)
        else:
            md, _ = build_attention_metadata(seqs, BLOCK, "cpu", **options)
        assert md.paged is not None and md.paged.window == window and md.prefills == []
        q = torch.cat([self.q[i][c : c + n] for i, c, n in batch])
        return paged_prefill_attention(q, self.pool, md.paged, self.head_dim**-0.5, form=form)

    def reference(self, i, pos, window=0):
        """Token ``pos`` of sequence i over its keys (the last ``window`` of them), float64: [heads, head_dim]."""
        first = max(0, pos - window + 1) if window else 0
        slots = [self.tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(first, pos + 1)]
        k, v = (self.pool[j].reshape(-1, self.kv_heads, self.head_dim)[slots].double() for j in (0, 1))
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [keys, heads, hd]
        scores = torch.einsum("hd,khd->hk", self.q[i][pos].double(), k) / math.sqrt(self.head_dim)
        return torch.einsum("hk,khd->hd", scores.softmax(-1), v)


# float32: every product a float32 FMA and p in float32, so the error is float32 rounding of the sums;
# bf16: the output's rounding to bf16
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 0.02}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "window"), [((9, 3, 64), 0), ((4, 1, 256), 0), ((9, 3, 64), 40),
                                               ((4, 1, 256), 8), ((8, 2, 128), 1), ((9, 3, 64), 100)])
def test_rows_match_float64_attention(shape, window, dtype):
    """A cold prefill, a chunk after a cached prefix and decodes, with and without a window (of 1, of
    fewer keys than a 32-key block, of more): every row is float64 attention over its keys."""
    if dtype == torch.float32:
        assert kernel_form(torch.float32) == "avx2"
    pool = Pool(*shape, dtype=dtype)
    batch = [(0, 0, 130), (1, 517, 1), (1, 300, 77), (0, 40, 1)]
    out = pool.run(batch, window)
    assert out.dtype == dtype and out.shape == (sum(n for _, _, n in batch), *shape[::2])
    start = 0
    for i, c, n in batch:
        for j in range(n):
            err = (out[start + j].double() - pool.reference(i, c + j, window)).abs().max().item()
            assert err < TOLERANCE[dtype], (i, c + j, err)
        start += n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 40, 5])
def test_a_row_has_the_same_bits_in_any_batch_chunking_or_decode(window, dtype):
    """Sequence 1's tokens 300..499 in one chunk, in two after a cache hit beside other sequences, one
    by one as decodes, and inside a cold 500-token prefill: identical bits (cache on == off)."""
    pool = Pool(9, 3, 64, dtype=dtype)
    whole = pool.run([(1, 300, 200)], window)
    split = torch.cat([pool.run([(1, 300, 37)], window),
                       pool.run([(0, 5, 90), (1, 337, 163), (0, 10, 1)], window)[90:253]])
    assert torch.equal(whole, split)
    for pos in (300, 301, 331, 347, 352, 499):
        alone = pool.run([(0, 600, 1), (1, pos, 1)], window)[1]
        assert torch.equal(alone, whole[pos - 300]), pos
    assert torch.equal(pool.run([(1, 0, 500)], window)[300:], whole)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_window_as_long_as_the_context_gives_the_causal_bits(dtype):
    pool = Pool(9, 3, 64, dtype=dtype)
    batch = [(0, 0, 300), (1, 200, 1)]
    assert torch.equal(pool.run(batch, window=700), pool.run(batch, form="avx2"))
    assert not torch.equal(pool.run(batch, window=299), pool.run(batch, form="avx2"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_keys_before_every_rows_window_are_never_read(dtype):
    """Window 40, rows 590..619 and a decode at 600: every key before 551 (the first row's first key) lies
    outside every window. Blocks 0-33 (keys 0-543) become block 0, as a sliding group's released blocks do,
    holding NaN, and keys 544-550 (inside the 32-key block 544-575 the kernel starts at) NaN too: the
    outputs keep their bits; a NaN at key 551 reaches the first row."""
    pool = Pool(9, 3, 64, dtype=dtype)
    batch = [(0, 590, 30), (0, 600, 1)]
    clean = pool.run(batch, window=40)
    table = list(pool.tables[0])
    pool.pool[:, 0] = float("nan")
    released = [0] * 34 + table[34:]
    flat = pool.pool.view(2, -1, 3, 64)
    for pos in range(544, 551):
        flat[:, table[pos // BLOCK] * BLOCK + pos % BLOCK] = float("nan")
    assert torch.equal(pool.run(batch, window=40, tables=[released, pool.tables[1]]), clean)
    flat[0, table[551 // BLOCK] * BLOCK + 551 % BLOCK] = float("nan")  # K only: the rows that mask it stay finite
    poisoned = pool.run(batch, window=40)
    assert poisoned[0].isnan().all() and not poisoned[1:].isnan().any()  # token 591's window starts at 552


def test_forms_and_what_the_others_refuse():
    """kernel_form: a bf16 pool without a window gets the machine's fastest form; a float32 pool or a window
    "avx2"; other dtypes none. The AMX and AVX-512 forms take neither, with a ValueError saying so."""
    assert kernel_form(torch.bfloat16) == prefill_form()
    assert kernel_form(torch.float32) == kernel_form(torch.bfloat16, windowed=True) == "avx2"
    assert kernel_form(torch.float32, windowed=True) == "avx2" and kernel_form(torch.float16) is None
    assert prefill_kernel_supported(9, 3, 64, torch.float32) and prefill_kernel_supported(4, 1, 256, windowed=True)
    assert not prefill_kernel_supported(9, 3, 64, torch.float16)
    pool = Pool(9, 3, 64, dtype=torch.float32)
    rows = build_paged_rows([0], [4], torch.tensor([pool.tables[0][:1]]))
    for form in ("amx", "avx512"):
        with pytest.raises(ValueError, match="takes a bf16 pool without a window"):
            paged_prefill_attention(pool.q[0][:4], pool.pool, rows, 0.125, form=form)
        windowed = build_paged_rows([0], [4], torch.tensor([pool.tables[0][:1]]), window=2)
        with pytest.raises(ValueError, match="takes a bf16 pool without a window"):
            paged_prefill_attention(pool.q[0][:4].bfloat16(), pool.pool.bfloat16(), windowed, 0.125, form=form)
    with pytest.raises(RuntimeError, match="q's dtype"):  # a float32 q over a bf16 pool
        paged_prefill_attention(pool.q[0][:4], pool.pool.bfloat16(), rows, 0.125)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        build_sliding_attention_metadata([(0, 4, [1])], BLOCK, "cpu", 0, batch_invariant=True, paged_kernel=True)


def test_the_cache_key_names_the_kernel_without_prompt_ops_and_the_sliding_layers_form():
    """A float32 model or Gemma 3 on the kernel runs torch's element-wise ops, and Gemma's sliding layers may run
    another form than its global ones: each is a different key."""
    fused = kv_numerics(True, False, form="avx2")
    plain = kv_numerics(True, False, form="avx2", prompt_ops=False)
    sliding = kv_numerics(True, False, form="avx2", prompt_ops=False, sliding_form="avx2")
    assert fused.startswith(PAGED_KV_NUMERICS + PAGED_AVX2_NUMERICS)
    assert plain.startswith(PAGED_ATTENTION_NUMERICS + PAGED_AVX2_NUMERICS)
    assert sliding.startswith(PAGED_ATTENTION_NUMERICS + PAGED_AVX2_NUMERICS + "|sliding-layers:avx2")
    assert len({fused, plain, sliding, kv_numerics(False, False)}) == 4
