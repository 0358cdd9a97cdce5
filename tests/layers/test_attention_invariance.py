"""A query's attention output has the same bits however it is batched (see layers/attention/metadata.py)."""

import random

import pytest
import torch

from prefixcache.layers.attention.metadata import build_attention_metadata, torch_attention_batch_invariant
from prefixcache.layers.attention.torch_attention import Attention

# The padding rule holds on MKL's AVX-512 GEMMs; on its AVX2 path (an AVX2-only CPU) it does not, and the engine says
# so at start-up: tested where this machine's kernels keep it (the probe's own check is below)
pytestmark = pytest.mark.skipif(not torch_attention_batch_invariant(),
                                reason="torch's attention kernels on this CPU are not batch-invariant under the padding "
                                       "rule (MKL's AVX2 path)")
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 32, 16
_BLOCKS = random.Random(0).sample(range(1, 200), 83)
TABLES = [_BLOCKS[:45], _BLOCKS[45:80], _BLOCKS[80:83]]  # shuffled, non-contiguous


def _run(attn, kv_cache, q_all, k_all, v_all, batch):
    """batch: (sequence, num_computed, num_new, positions) per sequence."""
    heads = attn.num_heads
    md, _ = build_attention_metadata([(c, n, TABLES[i]) for i, c, n, _ in batch], BLOCK, "cpu", batch_invariant=True,
                                     dtype=kv_cache.dtype)
    pos = [p for *_, ps in batch for p in ps]
    seq = [i for i, *_, ps in batch for _ in ps]
    q = torch.stack([q_all[s][p] for s, p in zip(seq, pos)])
    k = torch.stack([k_all[s][p] for s, p in zip(seq, pos)])
    v = torch.stack([v_all[s][p] for s, p in zip(seq, pos)])
    return attn(q, k, v, kv_cache, md).view(len(pos), heads, q.shape[-1])


# (query heads, KV heads): a decode's call block holds its query heads of one KV head, its query
# repeated ceil(4 / group) times: 3 heads twice, 2 heads twice, 1 head four times. float32 without
# GQA is left out: there a decode's row differs from its prefill row in the last bits whatever the
# repeat count (1..32 tried), a limit of the int8 format (float32 activations) on MHA models.
# (bf16, 9, 3, 64) is SmolLM2's head shape: before 2026-12-01 its rows in a 2-row tail (start 570:
# 130 rows) or in a 3-row call differed from the same rows in other calls.
@pytest.mark.parametrize("dtype, heads, kv_heads, head_dim", [
    (torch.float32, HEADS, KV_HEADS, HEAD_DIM), (torch.float32, 4, 2, HEAD_DIM),
    (torch.bfloat16, HEADS, KV_HEADS, HEAD_DIM), (torch.bfloat16, 4, 2, HEAD_DIM), (torch.bfloat16, 2, 2, HEAD_DIM),
    (torch.bfloat16, 9, 3, 64),
])
def test_query_bits_do_not_depend_on_the_batch(dtype, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    lens = [700, 530, 40]
    q_all = [torch.randn(n, heads, head_dim).to(dtype) for n in lens]
    k_all = [torch.randn(n, kv_heads, head_dim).to(dtype) for n in lens]
    v_all = [torch.randn(n, kv_heads, head_dim).to(dtype) for n in lens]
    attn = Attention(heads, kv_heads, head_dim, head_dim**-0.5)
    fresh = lambda: torch.zeros(2, 200, BLOCK, kv_heads, head_dim, dtype=dtype)  # noqa: E731

    # Reference: sequence 0 prefilled in one chunk, then position 699 decoded alone.
    cache = fresh()
    whole = _run(attn, cache, q_all, k_all, v_all, [(0, 0, 699, list(range(699)))])
    alone = _run(attn, cache, q_all, k_all, v_all, [(0, 699, 1, [699])])[0]
    # The same position as the last row of different prefill chunks, alone and beside other sequences.
    for start in (0, 1, 2, 31, 100, 512, 570, 582, 635, 650, 666, 697, 698):  # 700 - 635 = 65 rows: 32 + 32 + 1
        cache = fresh()
        if start:
            _run(attn, cache, q_all, k_all, v_all, [(0, 0, start, list(range(start)))])
        _run(attn, cache, q_all, k_all, v_all, [(2, 0, 39, list(range(39)))])
        out = _run(attn, cache, q_all, k_all, v_all, [
            (0, start, 700 - start, list(range(start, 700))),
            (1, 0, 530, list(range(530))),
            (2, 39, 1, [39]),
        ])
        assert torch.equal(out[700 - start - 1], alone), start
        assert torch.equal(out[: 699 - start], whole[start:]), start  # every earlier row too
    # Position 699 as a decode beside decodes of other lengths.
    out = _run(attn, cache, q_all, k_all, v_all, [(1, 529, 1, [529]), (0, 699, 1, [699])])
    assert torch.equal(out[1], alone)
    # Positions decoded with p + 1 keys equal their rows in the 699-token prefill (699 keys, causal):
    # the pool already holds every position's K/V, and a decode rewrites its own slot with the same.
    cache = fresh()
    _run(attn, cache, q_all, k_all, v_all, [(0, 0, 699, list(range(699)))])
    for p in [*range(3, 699, 23), 511, 512, 513]:
        assert torch.equal(_run(attn, cache, q_all, k_all, v_all, [(0, p, 1, [p])])[0], whole[p]), p


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_consecutive_blocks_read_as_a_view_give_the_gathered_bits(batch_invariant):
    """A sequence whose blocks are consecutive in the pool is read as a view (no gather) when the
    pool size is known: a prefill chunk and a lone decode get exactly the gathered path's bits; a
    padded range past the pool's end, a scattered table or two decodes fall back to the gather."""
    torch.manual_seed(1)
    dtype = torch.bfloat16 if batch_invariant else torch.float32
    attn = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    pool = torch.randn(2, 80, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)  # finite junk in every slot
    table = list(range(7, 7 + 40))  # 40 consecutive blocks: 640 tokens
    q, k, v = torch.randn(1, HEADS, HEAD_DIM).to(dtype), torch.randn(1, KV_HEADS, HEAD_DIM).to(dtype), \
        torch.randn(1, KV_HEADS, HEAD_DIM).to(dtype)

    def run(seqs, num_pool_blocks, q, k, v):
        md, _ = build_attention_metadata(seqs, BLOCK, "cpu", batch_invariant=batch_invariant, dtype=dtype,
                                         num_pool_blocks=num_pool_blocks)
        return md, attn(q, k, v, pool.clone(), md)

    md_view, out_view = run([(600, 1, table)], 80, q, k, v)  # decode at position 600
    md_gather, out_gather = run([(600, 1, table)], 0, q, k, v)
    assert md_view.decode_first_block == 7 and md_gather.decode_first_block is None
    assert torch.equal(out_view, out_gather)
    qp, kp, vp = (torch.randn(90, h, HEAD_DIM).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    md_view, out_view = run([(500, 90, table)], 80, qp, kp, vp)  # a chunk after 500 cached tokens
    _, out_gather = run([(500, 90, table)], 0, qp, kp, vp)
    assert md_view.prefills[0].first_block == 7 and torch.equal(out_view, out_gather)
    # keys padded to 1024 (64 blocks from block 7 = 71 > 60): past a 60-block pool when invariant
    assert run([(600, 1, table)], 60, q, k, v)[0].decode_first_block == (None if batch_invariant else 7)
    scattered = table[:10] + [70] + table[11:]
    assert run([(600, 1, scattered)], 80, q, k, v)[0].decode_first_block is None
    two = run([(600, 1, table), (100, 1, list(range(50, 57)))], 80, torch.cat([q, q]), torch.cat([k, k]),
              torch.cat([v, v]))[0]
    assert two.decode_first_block is None
