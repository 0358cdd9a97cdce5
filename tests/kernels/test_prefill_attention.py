"""Our paged prompt-attention kernel (kernels/prefill_attention.py, csrc/prefill_attention.cpp and
prefill_attention_avx2.cpp), in each of its forms this CPU runs (AVX512-BF16 dot products; AMX tiles; AVX2
float32 FMAs): right values against float64
attention, and a row's exact bits whatever its batch, chunking, cached prefix, or decode; the metadata
that routes every row to it; the shapes it refuses."""

import math
import random

import pytest
import torch

from prefixcache.kernels.amx_gemm import amx_gemm_supported
from prefixcache.kernels.cpu_kernels import kernels_compiler
from prefixcache.kernels.prefill_attention import (FORMS, build_paged_rows, form_supported, paged_prefill_attention,
                                                   prefill_form, prefill_kernel_supported)
from prefixcache.layers.attention.metadata import build_attention_metadata
from prefixcache.layers.attention.numerics import (AMX_GEMM_NUMERICS, KV_NUMERICS, PAGED_AMX_NUMERICS,
                                                   PAGED_AVX2_NUMERICS, PAGED_KV_NUMERICS, kv_numerics)
from prefixcache.layers.attention.torch_attention import Attention

pytestmark = pytest.mark.skipif(not prefill_kernel_supported(9, 3, 64),
                                reason="our paged attention kernel needs AVX512-BF16 or AVX2")
BLOCK, NUM_BLOCKS = 16, 300
# each form where this CPU runs it (an AMX machine runs all three, an AVX2 one only "avx2")
RUNNABLE = [pytest.param(form, marks=pytest.mark.skipif(not form_supported(form), reason=f"this CPU can't run {form}"))
            for form in FORMS]


class Pool:
    """A bf16 pool holding three 700-token sequences' K/V in scattered blocks, and their queries."""

    def __init__(self, heads, kv_heads, head_dim, seed=0, form=None, block=BLOCK):
        self.form, self.block = form, block
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.pool = torch.randn(2, NUM_BLOCKS, BLOCK, kv_heads, head_dim, generator=gen).bfloat16()
        blocks = random.Random(seed).sample(range(NUM_BLOCKS), 3 * 44)
        self.tables = [blocks[44 * i : 44 * (i + 1)] for i in range(3)]
        self.q = [torch.randn(700, heads, head_dim, generator=gen).bfloat16() for _ in range(3)]

    def run(self, batch):
        """batch: (sequence, num_computed, num_new); the new tokens' outputs [tokens, heads, head_dim]."""
        md, _ = build_attention_metadata([(c, n, self.tables[i]) for i, c, n in batch], BLOCK, "cpu",
                                         batch_invariant=True, dtype=torch.bfloat16, num_pool_blocks=NUM_BLOCKS,
                                         paged_kernel=True)
        q = torch.cat([self.q[i][c : c + n] for i, c, n in batch])
        return paged_prefill_attention(q, self.pool, md.paged, self.head_dim**-0.5, form=self.form)

    def reference(self, i, pos):
        """Token ``pos`` of sequence i over keys 0..pos, float64: [heads, head_dim]."""
        slots = [self.tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(pos + 1)]
        k, v = (self.pool[j].reshape(-1, self.kv_heads, self.head_dim)[slots].double() for j in (0, 1))
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [keys, heads, hd]
        scores = torch.einsum("hd,khd->hk", self.q[i][pos].double(), k) / math.sqrt(self.head_dim)
        return torch.einsum("hk,khd->hd", scores.softmax(-1), v)


@pytest.mark.parametrize("form", RUNNABLE)
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (16, 1, 64)])
def test_rows_match_float64_attention(shape, form):
    """Every row of a batch (a cold prefill, a chunk after a cached prefix, decodes) is float64
    attention to bf16 accuracy: the error of bf16 p in the second product, at most 0.02 here."""
    pool = Pool(*shape, form=form)
    batch = [(0, 0, 130), (1, 517, 1), (2, 300, 77), (0, 40, 1)]
    out = pool.run(batch)
    start = 0
    for i, c, n in batch:
        for j in range(n):
            ref = pool.reference(i, c + j)
            assert (out[start + j].double() - ref).abs().max() < 0.02, (i, c + j)
        start += n


@pytest.mark.parametrize("form", RUNNABLE)
def test_a_row_has_the_same_bits_in_any_batch_chunking_or_decode(form):
    """Sequence 2's tokens 300..499: one 200-token chunk, 37 + 163 after a cache hit, beside other
    sequences, and each token alone as a decode: identical bits (the property cache on == off rests on)."""
    pool = Pool(9, 3, 64, form=form)
    whole = pool.run([(2, 300, 200)])
    split = torch.cat([pool.run([(2, 300, 37)]), pool.run([(0, 5, 90), (2, 337, 163), (1, 10, 1)])[90:253]])
    assert torch.equal(whole, split)
    for pos in (300, 301, 331, 347, 352, 499):
        alone = pool.run([(1, 600, 1), (2, pos, 1)])[1]
        assert torch.equal(alone, whole[pos - 300]), pos
    cold = pool.run([(2, 0, 500)])[300:]
    assert torch.equal(cold, whole)


def test_matches_torchs_padded_path_to_rounding():
    """The Attention module on the kernel's metadata agrees with its torch flash path within bf16
    rounding (they round differently, hence kv_numerics)."""
    pool = Pool(9, 3, 64)
    attn = Attention(9, 3, 64, 64**-0.5)
    batch = [(2, 100, 50), (1, 333, 1)]
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(51, 3, 64, generator=gen).bfloat16(), torch.randn(51, 3, 64, generator=gen).bfloat16()
    q = torch.cat([pool.q[i][c : c + n] for i, c, n in batch])
    outs = []
    for paged in (False, True):
        md, _ = build_attention_metadata([(c, n, pool.tables[i]) for i, c, n in batch], BLOCK, "cpu",
                                         batch_invariant=True, dtype=torch.bfloat16, num_pool_blocks=NUM_BLOCKS,
                                         paged_kernel=paged)
        assert (md.paged is not None) == paged and (md.prefills == []) == paged
        outs.append(attn(q, k, v, pool.pool.clone(), md).float())
    assert (outs[0] - outs[1]).abs().max() < 0.02
    assert not torch.equal(outs[0], outs[1])


def test_paged_metadata_tables():
    md, positions = build_attention_metadata([(5, 3, [7, 2]), (16, 1, [4, 9, 1])], BLOCK, "cpu",
                                             batch_invariant=True, dtype=torch.bfloat16, paged_kernel=True)
    assert md.paged.query_start.tolist() == [0, 3, 4]
    assert md.paged.num_computed.tolist() == [5, 16]
    assert md.paged.block_table.tolist() == [[7, 0], [4, 9]]  # padded with block 0
    assert md.slot_mapping.tolist() == [7 * 16 + 5, 7 * 16 + 6, 7 * 16 + 7, 9 * 16 + 0]
    assert positions.tolist() == [5, 6, 7, 16]
    with pytest.raises(ValueError, match="batch_invariant"):
        build_attention_metadata([(0, 2, [0])], BLOCK, "cpu", paged_kernel=True)


def test_refuses_what_it_cannot_run():
    assert not prefill_kernel_supported(4, 4, 16)  # head_dim not a multiple of 32
    assert not prefill_kernel_supported(98, 2, 64)  # 49 query heads per KV head
    pool = Pool(9, 3, 64)
    rows = build_paged_rows([0], [4], torch.tensor([[NUM_BLOCKS]]))  # a block outside the pool
    with pytest.raises(RuntimeError, match="outside the pool"):
        paged_prefill_attention(pool.q[0][:4], pool.pool, rows, 0.125)
    form_key = {"amx": PAGED_AMX_NUMERICS, "avx512": "", "avx2": PAGED_AVX2_NUMERICS}[prefill_form()]
    gemm_key = AMX_GEMM_NUMERICS if amx_gemm_supported() else ""
    cc = "|cc:" + kernels_compiler()
    assert kernels_compiler()  # e.g. "12.2.0"
    assert kv_numerics(True, True) == PAGED_KV_NUMERICS + form_key + gemm_key + cc != kv_numerics(False, True)
    assert kv_numerics(False, False) == KV_NUMERICS  # a float32 model: none of our kernels, nothing more to name
    assert kv_numerics(False, False, int4=True) == KV_NUMERICS + cc  # int4's generated rows run our decoder


@pytest.mark.parametrize("form", RUNNABLE)
def test_a_nan_score_makes_its_rows_nan_in_every_tiling(form):
    """A NaN key at position 35: rows that see it are NaN (as float attention gives), chunked or as
    decodes; the rows before it, in the same work item, are finite and keep their bits."""
    pool = Pool(9, 3, 64, form=form)
    clean = pool.run([(0, 0, 40)])
    slot = pool.tables[0][35 // BLOCK] * BLOCK + 35 % BLOCK
    pool.pool[0].view(-1, 3, 64)[slot, 1] = float("nan")  # kv head 1: query heads 3-5
    chunk = pool.run([(0, 0, 40)])
    decodes = torch.cat([pool.run([(0, pos, 1)]) for pos in range(40)])
    for out in (chunk, decodes):
        assert torch.equal(out[:35], clean[:35])
        assert out[35:, 3:6].isnan().all() and torch.equal(out[35:, :3], clean[35:, :3])


@pytest.mark.parametrize("form", RUNNABLE)
def test_an_infinite_key_gives_nan_rows_by_each_forms_rule(form):
    """Key 35's head-1 K is -inf in dim 0 only: a row whose q has dim 0 > 0 scores it -inf, < 0 +inf.
    +inf makes a row NaN in every form. -inf: the AVX-512 and AVX2 forms give the key p = 0 (as if masked); the AMX
    form makes the row NaN (its softmax checks every non-finite score in one test). Rows before the key,
    and other heads, keep their bits; chunked and decoded rows agree."""
    pool = Pool(9, 3, 64, form=form)
    clean = pool.run([(0, 0, 40)])
    slot = pool.tables[0][35 // BLOCK] * BLOCK + 35 % BLOCK
    pool.pool[0].view(-1, 3, 64)[slot, 1] = 0.0
    pool.pool[0].view(-1, 3, 64)[slot, 1, 0] = float("-inf")
    chunk = pool.run([(0, 0, 40)])
    decodes = torch.cat([pool.run([(0, pos, 1)]) for pos in range(40)])
    q0 = pool.q[0][35:40, 3:6, 0].float()  # [rows, heads 3-5]: the sign of each row's score
    assert (q0 > 0).any() and (q0 < 0).any()
    for out in (chunk, decodes):
        assert torch.equal(out[:35], clean[:35]) and torch.equal(out[35:, :3], clean[35:, :3])
        nan = out[35:, 3:6].isnan().all(-1)
        assert torch.equal(nan, torch.ones_like(nan) if form == "amx" else q0 < 0)
        assert not out[35:, 3:6][~nan].isnan().any()
    assert torch.equal(chunk.isnan(), decodes.isnan()) and torch.equal(chunk.nan_to_num(), decodes.nan_to_num())


@pytest.mark.parametrize("form", RUNNABLE)
def test_huge_finite_scores_give_the_exact_softmax(form):
    """Row 0 sees one key (score S), row 1 keys S and S/2 with V 1.0 and 2.0: outputs exactly 1.0 for S
    from 2^20 to 2^39 (a fresh reviewer found the AMX form's first softmax, p = 2^fma(s, scale, -m), NaN
    from S ~ 4e10 and 0.996 from ~4e7: m rounded, the fma's product not)."""
    md, _ = build_attention_metadata([(0, 2, [0])], BLOCK, "cpu", batch_invariant=True, dtype=torch.bfloat16,
                                     num_pool_blocks=1, paged_kernel=True)
    q = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    q[:, 0, 0] = 64.0
    for e in range(20, 40):
        pool = torch.zeros(2, 1, BLOCK, 1, 64, dtype=torch.bfloat16)
        pool[0, 0, 0, 0, 0], pool[0, 0, 1, 0, 0] = 1.3 * 2.0**e / 64, 1.3 * 2.0**e / 128
        pool[1, 0, 0], pool[1, 0, 1] = 1.0, 2.0
        out = paged_prefill_attention(q, pool, md.paged, 64**-0.5, form=form)
        assert out[:, 0, 0].tolist() == [1.0, 1.0], e


@pytest.mark.parametrize("form", [p for p in RUNNABLE if p.values[0] != "avx512"])
def test_each_form_agrees_with_the_avx512_form_to_rounding_and_is_keyed_apart(form):
    """The forms sum in different orders (AMX tiles; AVX2's float32 FMAs with p kept in float32): values
    within bf16 rounding of the AVX-512 form's, bits not all equal, so the cache key names the form (K/V
    from one is never read as another's)."""
    if not form_supported("avx512"):
        pytest.skip("no AVX-512 form to compare with on this CPU")
    pool = Pool(9, 3, 64, form="avx512")
    batch = [(0, 0, 300), (1, 517, 1), (2, 300, 77)]
    avx512 = pool.run(batch).float()
    pool.form = form
    other = pool.run(batch).float()
    assert (avx512 - other).abs().max() < 0.02
    assert not torch.equal(avx512, other)
    assert len({PAGED_AMX_NUMERICS, PAGED_AVX2_NUMERICS, ""}) == 3


def test_a_form_this_cpu_cannot_run_or_does_not_know_is_refused():
    pool = Pool(9, 3, 64)
    rows = build_paged_rows([0], [4], torch.tensor([[0]]))
    with pytest.raises(ValueError, match="form must be one of"):
        paged_prefill_attention(pool.q[0][:4], pool.pool, rows, 0.125, form="avx1024")
    with pytest.raises(ValueError, match="form must be one of"):
        form_supported("neon")
    assert prefill_form() == next(f for f in FORMS if form_supported(f))


def test_a_cpu_where_no_form_runs_gets_a_runtime_error_not_a_form_name_error(monkeypatch):
    from prefixcache.kernels import prefill_attention

    monkeypatch.setattr(prefill_attention, "prefill_form", lambda: None)  # as under PREFIXCACHE_KERNELS=reference
    pool = Pool(9, 3, 64)
    rows = build_paged_rows([0], [4], torch.tensor([[0]]))
    with pytest.raises(RuntimeError, match="no form of the paged prompt-attention kernel runs on this CPU"):
        paged_prefill_attention(pool.q[0][:4], pool.pool, rows, 0.125)


@pytest.mark.parametrize("form", FORMS)
def test_the_cache_key_names_the_form_that_computed_the_kv(form, monkeypatch):
    """Each form's K/V gets its own key, so a disk or Redis tier shared by an AMX, an AVX-512 and an AVX2
    machine never serves one's K/V to another."""
    from prefixcache.kernels import prefill_attention

    monkeypatch.setattr(prefill_attention, "prefill_form", lambda: form)
    key = kv_numerics(True, False)
    assert key.startswith(PAGED_KV_NUMERICS + {"amx": PAGED_AMX_NUMERICS, "avx512": "", "avx2": PAGED_AVX2_NUMERICS}[form])
    keys = set()
    for other in FORMS:
        monkeypatch.setattr(prefill_attention, "prefill_form", lambda other=other: other)
        keys.add(kv_numerics(True, False))
    assert len(keys) == 3


@pytest.mark.parametrize("form", RUNNABLE)
@pytest.mark.parametrize("block_size", [8, 32, 1])
def test_block_sizes_other_than_16(block_size, form):
    """Pool blocks of 8 or 1 tokens (the AMX form copies a tile's 16 K rows together) and of 32: a row
    has the same bits as with 16-token blocks holding the same K/V, chunked or as decodes."""
    pool = Pool(9, 3, 64, form=form)
    slots = [[t * BLOCK + o for t in table for o in range(BLOCK)] for table in pool.tables]  # token -> slot
    reblocked = torch.zeros(2, NUM_BLOCKS * BLOCK // block_size, block_size, 3, 64, dtype=torch.bfloat16)
    flat_old, flat_new = pool.pool.view(2, -1, 3, 64), reblocked.view(2, -1, 3, 64)
    perm = random.Random(7).sample(range(NUM_BLOCKS * BLOCK // block_size), len(slots[0]) // block_size)
    new_slots = [b * block_size + o for b in perm for o in range(block_size)]
    flat_new[:, new_slots] = flat_old[:, slots[0]]
    batch = [(0, 0, 230), (0, 600, 1), (0, 231, 5)]
    md, _ = build_attention_metadata([(c, n, perm) for _, c, n in batch], block_size, "cpu", batch_invariant=True,
                                     dtype=torch.bfloat16, num_pool_blocks=reblocked.shape[1], paged_kernel=True)
    q = torch.cat([pool.q[0][c : c + n] for _, c, n in batch])
    out = paged_prefill_attention(q, reblocked, md.paged, 0.125, form=form)
    assert torch.equal(out, pool.run(batch))


@pytest.mark.parametrize("form", RUNNABLE)
def test_an_infinite_value_at_a_rows_last_key_gives_the_same_bits_in_every_tiling(form):
    """V of token 20 is +inf in dim 0: token 20 sees it (its output there is +inf, as float attention
    gives), alone as a decode and as the first row of a chunk; the AMX form multiplies whole 32-key
    blocks, so the keys past a context must be zeros there, not copies of its last V (0 * inf = NaN)."""
    pool = Pool(9, 3, 64, form=form)
    slot = pool.tables[0][20 // BLOCK] * BLOCK + 20 % BLOCK
    pool.pool[1].view(-1, 3, 64)[slot, 0, 0] = float("inf")  # kv head 0: query heads 0-2
    decode = pool.run([(0, 20, 1)])[0]
    chunk = pool.run([(0, 20, 6)])[0]
    assert torch.equal(decode, chunk)
    assert decode[:3, 0].isposinf().all() and decode[3:].isfinite().all()
