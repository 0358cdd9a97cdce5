"""Shared-prefix (cascade) decode attention equals attention over each decode's whole context."""

import math

import torch
import torch.nn.functional as F

from prefixcache.layers.attention.cascade import merge_attention_states
from prefixcache.layers.attention.metadata import build_attention_metadata
from prefixcache.layers.attention.torch_attention import Attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 32, 16


def _reference(q, k, v, context_len):
    """One decode query over its context with plain softmax attention in float64: [heads, head_dim]."""
    k = k[:context_len].double().repeat_interleave(HEADS // KV_HEADS, dim=1)  # [ctx, heads, hd]
    v = v[:context_len].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("hd,khd->hk", q.double(), k) / math.sqrt(HEAD_DIM)
    return torch.einsum("hk,khd->hd", scores.softmax(-1), v)


def test_cascade_decode_matches_whole_context_attention():
    torch.manual_seed(0)
    shared = list(range(3, 3 + 20))  # 320 shared tokens in consecutive blocks: read as a view
    tails = [[40, 41], [50], [60, 61, 62], [70]]  # each decode's own blocks after the shared run
    lens = [330, 321, 360, 336]
    seqs = [(n - 1, 1, shared + t) for n, t in zip(lens, tails)]
    seqs.append((40, 1, [80, 81, 82]))  # a decode sharing nothing
    lens.append(41)
    cache = torch.randn(2, 100, BLOCK, KV_HEADS, HEAD_DIM)
    md, _ = build_attention_metadata(seqs, BLOCK, "cpu")
    assert [g.members.tolist() for g in md.cascade_groups] == [[0, 1, 2, 3]]
    q = torch.randn(len(seqs), HEADS, HEAD_DIM)
    k_new = torch.stack([cache[0, b[(n - 1) // BLOCK], (n - 1) % BLOCK] for (_, _, b), n in zip(seqs, lens)])
    v_new = torch.stack([cache[1, b[(n - 1) // BLOCK], (n - 1) % BLOCK] for (_, _, b), n in zip(seqs, lens)])
    out = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)(q, k_new, v_new, cache, md).view(-1, HEADS, HEAD_DIM)
    for i, ((_, _, blocks), n) in enumerate(zip(seqs, lens)):
        k = cache[0, blocks].reshape(-1, KV_HEADS, HEAD_DIM)
        v = cache[1, blocks].reshape(-1, KV_HEADS, HEAD_DIM)
        torch.testing.assert_close(out[i].double(), _reference(q[i], k, v, n), atol=2e-6, rtol=1e-5)
    # shuffled (non-consecutive) shared blocks are gathered and give the same result
    perm = shared[::-1]
    cache2 = cache.clone()
    cache2[:, perm] = cache[:, shared]
    seqs2 = [(c, n, perm + b[20:]) if i < 4 else (c, n, b) for i, (c, n, b) in enumerate(seqs)]
    md2, _ = build_attention_metadata(seqs2, BLOCK, "cpu")
    assert md2.cascade_groups[0].block_ids.tolist() == perm
    out2 = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)(q, k_new, v_new, cache2, md2)
    assert torch.equal(out2.view(-1, HEADS, HEAD_DIM), out)


def test_merge_attention_states_is_softmax_over_the_union():
    torch.manual_seed(1)
    scores = torch.randn(3, 2, 10, dtype=torch.float64) * 4  # [tokens, heads, keys]
    values = torch.randn(10, 5, dtype=torch.float64)
    whole = F.softmax(scores, -1) @ values
    a, b = slice(0, 7), slice(7, 10)
    out_a, out_b = F.softmax(scores[..., a], -1) @ values[a], F.softmax(scores[..., b], -1) @ values[b]
    lse_a, lse_b = scores[..., a].logsumexp(-1), scores[..., b].logsumexp(-1)
    merged = merge_attention_states(out_a.float(), lse_a.float(), out_b.float(), lse_b.float())
    torch.testing.assert_close(merged.double(), whole, atol=1e-6, rtol=1e-6)
    # a part with -inf lse (no keys) contributes nothing
    merged = merge_attention_states(out_a.float(), lse_a.float(), torch.zeros_like(out_b).float(),
                                    torch.full_like(lse_b, float("-inf")).float())
    assert torch.equal(merged, out_a.float())
