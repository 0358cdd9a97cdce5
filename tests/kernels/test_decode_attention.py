"""Generated tokens' attention (kernels/decode_attention.py, csrc/paged_attention.cpp) and the split
attention metadata that routes them: right values, the same bits in any batch and after a preemption,
only the row's own keys read."""

import math
import random

import pytest
import torch

from prefixcache.kernels.cpu_features import cpu_has
from prefixcache.kernels.decode_attention import build_decode_rows, decode_attention
from prefixcache.layers.attention.metadata import build_attention_metadata
from prefixcache.layers.attention.torch_attention import Attention

pytestmark = pytest.mark.requires_isa("avx2")  # our C++ kernels: the AVX-512 build, else the AVX2 one (load_int4_kernels)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 32, 16
PROMPT = 1100  # shared prompt: 68 whole blocks, then a partial block
_SCATTERED = random.Random(0).sample(range(1, 200), 69)  # shuffled, none of the requests' own blocks


def _reference(q, k, v, context_len):
    """One query over its context, plain softmax attention in float64: [heads, head_dim]."""
    group = q.shape[0] // k.shape[1]
    k = k[:context_len].double().repeat_interleave(group, dim=1)  # [ctx, heads, hd]
    v = v[:context_len].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,khd->hk", q.double(), k) / math.sqrt(q.shape[-1])
    return torch.einsum("hk,khd->hd", scores.softmax(-1), v)


class Sequences:
    """Three requests over one 1,100-token prompt (shared blocks, consecutive or scattered), each with
    its own generated tokens: K/V written into a pool, queries kept to replay any batch."""

    def __init__(self, shared_blocks):
        torch.manual_seed(0)
        dtype = torch.bfloat16
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
                                         batch_invariant=True, dtype=torch.bfloat16, num_pool_blocks=420,
                                         num_prompt_tokens=[PROMPT] * len(batch))
        q, k, v = (torch.cat([t[i][c : c + n] for i, c, n in batch]) for t in (self.q, self.k, self.v))
        pool = self.pool.clone()
        if md.generated is None:
            return md, self.attn(q, k, v, pool, md).view(-1, HEADS, HEAD_DIM)
        # generated rows as the model runs them (layers.decode_layers: their K/V is already in
        # the pool here), the others through Attention with the metadata of their sub-batch
        out, dense, rows = torch.empty_like(q), md.dense_token_indices, md.generated.token_indices
        if dense.numel():
            out[dense] = self.attn(q[dense], k[dense], v[dense], pool, md).view(-1, HEADS, HEAD_DIM)
        slots = (-1, KV_HEADS, HEAD_DIM)
        out[rows] = decode_attention(q[rows], pool[0].view(slots), pool[1].view(slots), md.generated, HEAD_DIM**-0.5)
        return md, out


@pytest.mark.parametrize("shared_blocks", [list(range(1, 70)), _SCATTERED], ids=["consecutive", "scattered"])
def test_generated_rows_get_the_same_bits_in_any_batch(shared_blocks):
    s = Sequences(shared_blocks)
    md, alone = s.run([(0, 1120, 1)])  # request 0's generated position 1,120 decoded alone
    assert md.generated.token_indices.tolist() == [0] and md.generated.context_lens.tolist() == [1121]
    assert md.generated.block_table[0, :71].tolist() == s.tables[0][:71]  # 1,121 keys: 71 blocks
    torch.testing.assert_close(alone[0].double(), _reference(s.q[0][1120], s.k[0], s.v[0], 1121), atol=2e-2, rtol=0)
    # Beside the other requests' decodes (the 68 shared blocks in all three tables)
    md, out = s.run([(1, 1130, 1), (0, 1120, 1), (2, 1101, 1)])
    assert md.decode_block_table is None  # every decode is a generated token
    assert md.generated.context_lens.tolist() == [1131, 1121, 1102]
    assert torch.equal(out[1], alone[0])
    for i, (r, pos) in enumerate([(1, 1130), (2, 1101)]):
        torch.testing.assert_close(out[i * 2].double(), _reference(s.q[r][pos], s.k[r], s.v[r], pos + 1),
                                   atol=2e-2, rtol=0)
    # Recomputed after a preemption: the prompt's tail and generated tokens in one prefill chunk, beside
    # a decode; each generated row equals its decode, the prompt rows their prefill rows.
    _, decodes = s.run([(0, p, 1) for p in range(1100, 1125)])
    _, prompt_rows = s.run([(0, 1000, 100)])
    md, out = s.run([(2, 1101, 1), (0, 1000, 125)])
    assert md.generated.token_indices.tolist() == [0, *range(101, 126)]
    assert md.dense_token_indices.tolist() == list(range(1, 101)) and md.num_tokens == 100
    assert torch.equal(out[1:101], prompt_rows)
    assert torch.equal(out[101:], decodes) and torch.equal(decodes[20], alone[0])
    # A prompt token decoded alone (its last, after a full hit) keeps the one-call path.
    md, out = s.run([(0, 1099, 1)])
    assert md.generated is None and torch.equal(out[0], prompt_rows[99])


@pytest.mark.parametrize("float32_form", [False, True], ids=["bf16-form", "float32-form"])
@pytest.mark.parametrize("block_size", [1, 5, 16, 48])
# (9, 3, 64) is SmolLM2's; with (2, 2, 64), (4, 2, 64), (8, 2, 64), (2, 2, 128), (4, 2, 128) every compiled
# fast path runs; (4, 4, 16) and (8, 2, 128) take the general loop
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (2, 2, 64), (4, 2, 64), (8, 2, 64), (2, 2, 128),
                                                     (4, 2, 128), (4, 4, 16), (8, 2, 128)])
def test_kernel_reads_only_each_rows_keys_and_gives_it_the_same_bits_alone(block_size, heads, kv_heads, head_dim,
                                                                          float32_form):
    """Rows over shared and own blocks of any block size (the longest context in three 1,024-key
    segments; the bf16 form prepares the shared blocks once for the rows that share them, the float32 form
    widens them to float32 once, in chunks of whole pieces up to the last block end before the shortest grouped
    row's end); every slot
    outside the rows' contexts holds NaN (a read of one would show); each row alone = in the batch,
    and close to float64 softmax. Both forms (the bf16 one where the CPU has AVX512-BF16 and head_dim
    % 32 == 0, else float32)."""
    g = torch.Generator().manual_seed(block_size)
    num_blocks = -(-2100 // block_size) * 3 + 4
    k_slots = torch.full((num_blocks * block_size, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    v_slots = k_slots.clone()
    perm = torch.randperm(num_blocks, generator=g)
    need = -(-2100 // block_size)
    shared = perm[:need // 2]  # the three rows share their first half
    tables = [torch.cat([shared, perm[need // 2 + i * need : need // 2 + (i + 1) * need]])[:need] for i in range(3)]
    lens = [2100, 351, 1]
    for table, n in zip(tables, lens):
        slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        k_slots[slots] = torch.randn(n, kv_heads, head_dim, generator=g).bfloat16()
        v_slots[slots] = torch.randn(n, kv_heads, head_dim, generator=g).bfloat16()
    q = torch.randn(3, heads, head_dim, generator=g).bfloat16()
    rows = build_decode_rows([0, 1, 2], lens, torch.stack(tables), block_size, "cpu")
    out = decode_attention(q, k_slots, v_slots, rows, head_dim**-0.5, float32_form)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    for r, (table, n) in enumerate(zip(tables, lens)):
        alone = decode_attention(q[r : r + 1], k_slots, v_slots,
                                 build_decode_rows([0], [n], table[None], block_size, "cpu"), head_dim**-0.5,
                                 float32_form)
        assert torch.equal(alone[0], out[r])
        slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        torch.testing.assert_close(out[r].double(), _reference(q[r], k_slots[slots], v_slots[slots], n),
                                   atol=2e-2, rtol=0)
    # one key: the output is its value (softmax of one score is 1), to bf16 rounding
    slot = int(tables[2][0]) * block_size
    assert torch.equal(out[2], v_slots[slot].repeat_interleave(heads // kv_heads, 0))


@pytest.mark.parametrize("block_size", [24, 100, 256])
def test_float32_form_rows_whose_tables_diverge_mid_segment_keep_their_bits_alone(block_size):
    """The float32 form widens the keys a group of rows shares in chunks of whole pieces: with blocks that don't
    divide the 1,024-key segments or are longer than a chunk, and tables that part ways in the middle of a segment
    (rows 0-2 share 1,500 keys' blocks, row 3 only the first two blocks, row 4 none), each row alone = in the
    batch, bit for bit, and close to float64 softmax."""
    g = torch.Generator().manual_seed(block_size)
    heads, kv_heads, head_dim = 9, 3, 64
    lens = [2300, 2111, 1700, 2050, 90]
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    common = [perm.pop() for _ in range(-(-1500 // block_size))]
    tables = []
    for r, n in enumerate(need):
        shared = common if r < 3 else common[:2] if r == 3 else []
        own = [perm.pop() for _ in range(n - min(n, len(shared)))]
        tables.append(torch.tensor((shared[:n] + own) + [0] * (max(need) - n), dtype=torch.int32))
    table = torch.stack(tables)
    k_slots = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g).bfloat16()
    v_slots = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g).bfloat16()
    q = torch.randn(len(lens), heads, head_dim, generator=g).bfloat16()
    out = decode_attention(q, k_slots, v_slots, build_decode_rows(list(range(len(lens))), lens, table, block_size, "cpu"),
                           head_dim**-0.5, float32_form=True)
    for r, n in enumerate(lens):
        alone = decode_attention(q[r : r + 1], k_slots, v_slots, build_decode_rows([0], [n], table[r : r + 1], block_size,
                                                                                     "cpu"), head_dim**-0.5, float32_form=True)
        assert torch.equal(alone[0].view(torch.int16), out[r].view(torch.int16)), r
        slots = (table[r, :, None].long() * block_size + torch.arange(block_size)).flatten()[:n]
        torch.testing.assert_close(out[r].double(), _reference(q[r], k_slots[slots], v_slots[slots], n), atol=2e-2,
                                   rtol=0)


def test_rows_past_4096_keys_take_the_float32_form_by_their_own_length():
    """Where the bf16 form runs, a row whose context passes 4,096 keys gets exactly the float32 form's
    bits (a lone long context streams its K/V faster that way), alone and beside shorter rows, which keep
    the bf16 form's bits; the rule reads only the row's own length."""
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    num_blocks = 2 * 260 + 8
    k_slots = torch.randn(num_blocks * block, kv_heads, head_dim, generator=g).bfloat16()
    v_slots = torch.randn(num_blocks * block, kv_heads, head_dim, generator=g).bfloat16()
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.stack([perm[:260], perm[260:520], perm[:260]])  # the third shares the first's blocks
    lens = [4097, 4096, 600]
    q = torch.randn(3, heads, head_dim, generator=g).bfloat16()

    def run(rows_idx, float32_form=False):
        rows = build_decode_rows(list(range(len(rows_idx))), [lens[i] for i in rows_idx], tables[rows_idx], block,
                                 "cpu")
        return decode_attention(q[rows_idx], k_slots, v_slots, rows, head_dim**-0.5, float32_form)

    batch = run([0, 1, 2])
    for r in range(3):
        assert torch.equal(run([r])[0], batch[r])
    assert torch.equal(batch[0], run([0], float32_form=True)[0])  # past 4,096: the float32 form's bits
    if cpu_has("avx512_bf16"):  # else every row runs the float32 form
        assert not torch.equal(batch[1], run([1], float32_form=True)[0])  # 4,096 itself: the bf16 form
        assert not torch.equal(batch[2], run([2], float32_form=True)[0])


def test_kernel_refuses_a_context_or_block_outside_its_table_or_pool():
    k = torch.zeros(32, 1, 16, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, 16, dtype=torch.bfloat16)
    for bad in (0, 33):
        with pytest.raises(RuntimeError, match="context_lens out of the block table's range"):
            decode_attention(q, k, k, build_decode_rows([0], [bad], torch.tensor([[0, 1]]), 16, "cpu"), 0.25)
    with pytest.raises(RuntimeError, match="block_table holds a block outside the pool"):  # 2 blocks of 16
        decode_attention(q, k, k, build_decode_rows([0], [20], torch.tensor([[0, 2]]), 16, "cpu"), 0.25)


@pytest.mark.parametrize("float32_form", [False, True], ids=["bf16-form", "float32-form"])
def test_a_nan_key_makes_the_rows_that_see_it_nan(float32_form):
    """A NaN key in a shared block: every row whose context holds it is NaN for that KV head's query
    heads (the exp's clamp used to turn the NaN into a finite weight); the other KV head and a row whose
    context ends before the key keep the bits they had."""
    g = torch.Generator().manual_seed(5)
    k_slots = torch.randn(100 * 16, 2, 32, generator=g).bfloat16()
    v_slots = torch.randn(100 * 16, 2, 32, generator=g).bfloat16()
    q = torch.randn(3, 4, 32, generator=g).bfloat16()
    table = torch.arange(100).repeat(3, 1)  # three rows over the same blocks
    rows = build_decode_rows([0, 1, 2], [1500, 40, 700], table, 16, "cpu")
    clean = decode_attention(q, k_slots, v_slots, rows, 32**-0.5, float32_form)
    k_slots[600, 1] = float("nan")  # position 600, KV head 1 (query heads 2, 3)
    out = decode_attention(q, k_slots, v_slots, rows, 32**-0.5, float32_form)
    for r in (0, 2):  # contexts 1,500 (the NaN in its first segment) and 700
        assert out[r, 2:].isnan().all() and torch.equal(out[r, :2], clean[r, :2])
    assert torch.equal(out[1], clean[1])  # 40 keys: never reaches position 600
