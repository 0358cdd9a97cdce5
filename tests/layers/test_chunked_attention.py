"""Chunked attention of generated tokens (layers/chunked_attention.py): right values, the same bits in
any batch, shared chunks computed once."""

import math
import random

import pytest
import torch

from prefixcache.layers.attention import Attention, build_attention_metadata
from prefixcache.layers.chunked_attention import CHUNK_KEYS, build_chunked_rows, merge_chunks

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 32, 16
PROMPT = 1100  # shared prompt: 68 whole blocks (4 whole 256-key chunks), then a partial block
_SCATTERED = random.Random(0).sample(range(1, 200), 69)  # shuffled, none of the requests' own blocks


def _reference(q, k, v, context_len):
    """One query over its context, plain softmax attention in float64: [heads, head_dim]."""
    k = k[:context_len].double().repeat_interleave(HEADS // KV_HEADS, dim=1)  # [ctx, heads, hd]
    v = v[:context_len].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("hd,khd->hk", q.double(), k) / math.sqrt(HEAD_DIM)
    return torch.einsum("hk,khd->hd", scores.softmax(-1), v)


class Sequences:
    """Three requests over one 1,100-token prompt (shared blocks, consecutive or scattered), each with
    its own generated tokens: K/V written into a pool, queries kept to replay any batch."""

    def __init__(self, dtype, shared_blocks):
        torch.manual_seed(0)
        self.dtype = dtype
        self.pool = torch.zeros(2, 420, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
        own = [list(range(200 + 10 * i, 210 + 10 * i)) for i in range(3)]  # 160 tokens of its own each
        # The prompt's last block (tokens 1,088..1,099) is copied per request, as a partial block is.
        self.tables = [shared_blocks[:68] + [300 + i] + own[i] for i in range(3)]
        n = PROMPT + 150
        self.q = [torch.randn(n, HEADS, HEAD_DIM).to(dtype) for _ in range(3)]
        self.k = [torch.randn(n, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(3)]
        self.v = [torch.randn(n, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(3)]
        for i in range(1, 3):  # the same prompt: the same prompt K/V
            self.k[i][:PROMPT], self.v[i][:PROMPT] = self.k[0][:PROMPT], self.v[0][:PROMPT]
        for i, table in enumerate(self.tables):
            for pos in range(n):
                b, o = table[pos // BLOCK], pos % BLOCK
                self.pool[0, b, o], self.pool[1, b, o] = self.k[i][pos], self.v[i][pos]
        self.attn = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)

    def run(self, batch):
        """batch: (request, num_computed, num_new) per sequence; every token's output, [tokens, heads, hd]."""
        md, _ = build_attention_metadata([(c, n, self.tables[i]) for i, c, n in batch], BLOCK, "cpu",
                                         batch_invariant=True, dtype=self.dtype, num_pool_blocks=420,
                                         num_prompt_tokens=[PROMPT] * len(batch))
        q, k, v = (torch.cat([t[i][c : c + n] for i, c, n in batch]) for t in (self.q, self.k, self.v))
        return md, self.attn(q, k, v, self.pool.clone(), md).view(-1, HEADS, HEAD_DIM)


@pytest.mark.parametrize("shared_blocks", [list(range(1, 70)), _SCATTERED], ids=["consecutive", "scattered"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generated_rows_get_the_same_bits_in_any_batch(dtype, shared_blocks):
    s = Sequences(dtype, shared_blocks)
    # Reference: request 0's generated position 1,120 decoded alone (5 chunks, nothing to share).
    md, alone = s.run([(0, 1120, 1)])
    assert md.chunked.shared == [] and md.chunked.job_chunks.tolist() == list(range(-(-1121 // CHUNK_KEYS)))
    torch.testing.assert_close(alone[0].double(), _reference(s.q[0][1120], s.k[0], s.v[0], 1121),
                               atol=2e-2 if dtype == torch.bfloat16 else 2e-6, rtol=0)
    # Beside the other requests' decodes: the chunks inside the 68 shared blocks (keys 0..1,023) shared by
    # all three (one call), the rest per row.
    md, out = s.run([(1, 1130, 1), (0, 1120, 1), (2, 1101, 1)])
    [g] = md.chunked.shared
    assert (g.rows.tolist(), g.num_chunks) == ([0, 1, 2], 68 * BLOCK // CHUNK_KEYS)
    assert (g.first_slot, g.runs is None) == ((BLOCK, True) if shared_blocks[0] == 1 else (None, False))
    rest = [list(range(g.num_chunks, -(-(pos + 1) // CHUNK_KEYS))) for pos in (1130, 1120, 1101)]
    assert md.chunked.job_rows.tolist() == [r for r, chunks in enumerate(rest) for _ in chunks]
    assert md.chunked.job_chunks.tolist() == [j for chunks in rest for j in chunks]
    assert md.decode_block_table is None  # every decode is a generated token
    assert torch.equal(out[1], alone[0])
    for i, (r, pos) in enumerate([(1, 1130), (2, 1101)]):
        torch.testing.assert_close(out[i * 2].double(), _reference(s.q[r][pos], s.k[r], s.v[r], pos + 1),
                                   atol=2e-2 if dtype == torch.bfloat16 else 2e-6, rtol=0)
    # Recomputed after a preemption: the prompt's tail and generated tokens in one prefill chunk, beside
    # a decode; each generated row equals its decode, the prompt rows their prefill rows.
    _, decodes = s.run([(0, p, 1) for p in range(1100, 1125)])
    _, prompt_rows = s.run([(0, 1000, 100)])
    md, out = s.run([(2, 1101, 1), (0, 1000, 125)])
    assert md.chunked.token_indices.tolist() == [0, *range(101, 126)]
    assert torch.equal(out[1:101], prompt_rows)
    assert torch.equal(out[101:], decodes) and torch.equal(decodes[20], alone[0])
    # A prompt token decoded alone (its last, after a full hit) keeps the one-call path.
    md, out = s.run([(0, 1099, 1)])
    assert md.chunked is None and torch.equal(out[0], prompt_rows[99])


def test_plan_groups_only_whole_chunks_before_every_members_position():
    assert CHUNK_KEYS == 256  # the expected values below are written out for it
    table = torch.arange(1, 101).repeat(4, 1)  # [4 rows, 100 blocks], one sequence's blocks
    table[3, 40:] += 500  # row 3 leaves the others at block 40 (token 640): two whole chunks in common
    plan = build_chunked_rows([5, 6, 7, 9], [1200, 1537, 1025, 1300], table, BLOCK, "cpu", torch.float32)
    [g] = plan.shared
    assert (g.rows.tolist(), g.num_chunks, g.first_slot) == ([0, 1, 2, 3], 2, BLOCK)
    assert plan.job_rows.tolist() == [0] * 3 + [1] * 5 + [2] * 3 + [3] * 4
    assert plan.job_chunks.tolist() == [2, 3, 4, 2, 3, 4, 5, 6, 2, 3, 4, 2, 3, 4, 5]
    assert plan.num_chunks == 7 and plan.run == BLOCK and plan.job_runs.shape == (15 * 256 // BLOCK,)
    # Job (row 0, chunk 4): keys 1,024..1,199 real (blocks 65..75, whole blocks gathered), the rest
    # masked, read from run 0.
    runs, bias = plan.job_runs.view(15, 256 // BLOCK)[2], plan.job_bias[2, 0, 0]
    assert runs.tolist() == list(range(65, 76)) + [0] * 5
    assert bool((bias[:176] == 0).all()) and bool(torch.isinf(bias[176:]).all())
    # A block size that does not divide a chunk: runs of gcd(48, 256) = 16 slots, none crossing a block.
    plan48 = build_chunked_rows([0], [300], torch.arange(3, 10)[None], 48, "cpu", torch.float32)
    assert plan48.run == 16 and plan48.job_runs.tolist()[:4] == [9, 10, 11, 12]  # block 3 = slots 144..191
    # chunk 1, keys 256..299: keys 256..287 in block 8 (slots 400..431), 288..299 in block 9 (432..443)
    assert plan48.job_runs.tolist()[16:20] == [25, 26, 27, 0]
    # Two rows sharing less than one whole chunk before their positions: no group.
    assert build_chunked_rows([0, 1], [256, 900], table[:2], BLOCK, "cpu", torch.float32).shared == []


def test_merge_of_one_chunk_is_its_output_and_missing_chunks_add_nothing():
    torch.manual_seed(2)
    out, lse = torch.randn(3, 4, 6, 8), torch.randn(3, 4, 6)
    merged = merge_chunks(out, lse)
    out_missing = torch.cat([out, torch.zeros(2, 4, 6, 8)])
    lse_missing = torch.cat([lse, torch.full((2, 4, 6), float("-inf"))])
    assert torch.equal(merge_chunks(out_missing, lse_missing), merged)
    assert torch.equal(merge_chunks(out[:1], lse[:1]), out[0])
    one = torch.cat([out[:1], torch.zeros(1, 4, 6, 8)]), torch.cat([lse[:1], torch.full((1, 4, 6), float("-inf"))])
    assert torch.equal(merge_chunks(*one), out[0])
    weights = torch.softmax(lse.double(), 0)[..., None]  # chunk j's share of the softmax mass
    torch.testing.assert_close(merged.double(), (out.double() * weights).sum(0), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_chunks", [2, 7, 18, 33])
def test_merge_gives_a_row_the_same_bits_alone_and_among_rows_with_more_chunks(num_chunks):
    """A running sum in chunk order: a row's merge doesn't depend on the other rows (torch's
    ``sum(0)`` fails this: its order changes with the number of rows)."""
    torch.manual_seed(num_chunks)
    out, lse = torch.randn(num_chunks + 3, 12, 9, 64), torch.randn(num_chunks + 3, 12, 9) * 3
    out[num_chunks:, 4], lse[num_chunks:, 4] = 0, float("-inf")  # row 4 has num_chunks chunks, the rest 3 more
    alone = merge_chunks(out[:num_chunks, 4:5].contiguous(), lse[:num_chunks, 4:5].contiguous())
    assert torch.equal(merge_chunks(out, lse)[4], alone[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lone_decode_on_consecutive_blocks_reads_a_view_with_the_gathered_bits(dtype):
    torch.manual_seed(3)
    attn = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    pool = torch.randn(2, 120, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)  # finite junk in every slot
    table = list(range(10, 10 + 75))  # 1,200 tokens in consecutive blocks
    q, k, v = (torch.randn(1, h, HEAD_DIM).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS))

    padded = -(-1151 // CHUNK_KEYS) * CHUNK_KEYS  # position 1,150, generated: its chunks' keys

    def run(num_pool_blocks):
        md, _ = build_attention_metadata([(1150, 1, table)], BLOCK, "cpu", batch_invariant=True, dtype=dtype,
                                         num_pool_blocks=num_pool_blocks, num_prompt_tokens=[1000])
        return md, attn(q, k, v, pool.clone(), md)

    md_view, out_view = run(120)
    md_gather, out_gather = run(0)
    assert md_view.chunked.job_first_slot == 10 * BLOCK and md_gather.chunked.job_first_slot is None
    assert torch.equal(out_view, out_gather)
    past = (10 * BLOCK + padded) // BLOCK - 1  # slots 160 + padded past the pool's end: gathered
    assert run(past)[0].chunked.job_first_slot is None and run(past + 1)[0].chunked.job_first_slot == 10 * BLOCK
    scattered = table[:30] + [110] + table[31:]
    md = build_attention_metadata([(1150, 1, scattered)], BLOCK, "cpu", batch_invariant=True, dtype=dtype,
                                  num_pool_blocks=120, num_prompt_tokens=[1000])[0]
    assert md.chunked.job_first_slot is None
