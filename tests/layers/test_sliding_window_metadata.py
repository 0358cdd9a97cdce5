"""The local layers' metadata (``build_attention_metadata(sliding_window=...)``): masks of the window
that counts the query itself (transformers' convention), keys before it not read."""

import pytest
import torch

from prefixcache.layers.attention.metadata import build_attention_metadata, build_sliding_attention_metadata
from prefixcache.layers.attention.torch_attention import Attention


def test_prefill_tile_masks_and_skips_keys_before_the_window():
    # 10 cached + 6 new tokens, window 4: query at position p attends to p - 3 .. p
    md, _ = build_attention_metadata([(10, 6, list(range(4)))], 4, "cpu", sliding_window=4)
    assert md.sliding is not None and md.prefills[0].tiles[0].key_start == 0  # global layers: unchanged
    tile = md.sliding.prefills[0].tiles[0]
    assert (tile.key_start, tile.num_keys) == (7, 16)  # the first query (position 10) reaches back to 7
    attend = tile.key_bias.eq(0)  # [6 queries, keys 7..15]
    for row, pos in enumerate(range(10, 16)):
        assert [7 + k for k in attend[row].nonzero().flatten().tolist()] == list(range(pos - 3, pos + 1))


def test_batch_invariant_tiles_read_whole_key_blocks():
    md, _ = build_attention_metadata([(1000, 30, list(range(70)))], 16, "cpu", batch_invariant=True, sliding_window=300)
    tile = md.sliding.prefills[0].tiles[0]
    assert (tile.key_start, tile.num_keys) == (512, 1536)  # 701 rounded down to a multiple of 512


def test_decode_reads_only_the_blocks_its_window_reaches():
    # contexts of 21 and 3 tokens (block size 4), window 6: keys 15..20 and 0..2
    md, _ = build_attention_metadata([(20, 1, [9, 8, 7, 6, 5, 4]), (2, 1, [3])], 4, "cpu", sliding_window=6)
    sliding = md.sliding
    assert sliding.cascade_groups == [] and sliding.decode_first_block is None
    assert sliding.decode_block_table.tolist() == [[6, 5, 4], [3, 0, 0]]  # from block 3 (keys 12..) on
    mask = sliding.decode_attn_mask[:, 0, 0]
    assert mask[0].nonzero().flatten().tolist() == [3, 4, 5, 6, 7, 8]  # keys 15..20
    assert mask[1].nonzero().flatten().tolist() == [0, 1, 2]


def test_windowed_attention_equals_a_dense_masked_reference():
    torch.manual_seed(0)
    heads, kv_heads, hd, bs, window = 4, 1, 8, 4, 5
    kv = torch.zeros(2, 16, bs, kv_heads, hd)
    attn = Attention(heads, kv_heads, hd, scale=hd**-0.5)
    q, k, v = torch.randn(17, heads, hd), torch.randn(17, kv_heads, hd), torch.randn(17, kv_heads, hd)
    blocks = [11, 2, 7, 5, 0]
    md, _ = build_attention_metadata([(0, 9, blocks)], bs, "cpu", sliding_window=window)
    first = attn(q[:9], k[:9], v[:9], kv, md.sliding)  # prefill of 9
    md, _ = build_attention_metadata([(9, 8, blocks)], bs, "cpu", sliding_window=window)
    rest = attn(q[9:], k[9:], v[9:], kv, md.sliding)  # a chunk on top of the cached 9
    pos = torch.arange(17)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)  # [17, 17]
    scores = torch.einsum("qhd,kd->hqk", q, k[:, 0]) * hd**-0.5
    expected = torch.einsum("hqk,kd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v[:, 0])
    torch.testing.assert_close(torch.cat([first, rest]), expected.reshape(17, -1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kwargs", [dict(sliding_window=0), dict(sliding_window=4, num_prompt_tokens=[3])])
def test_bad_window_arguments_are_refused(kwargs):
    with pytest.raises(ValueError, match="sliding_window"):
        build_attention_metadata([(0, 3, [0])], 4, "cpu", batch_invariant=True, **kwargs)
    with pytest.raises(ValueError, match="sliding_window"):
        build_sliding_attention_metadata([(0, 3, [0])], 4, "cpu", batch_invariant=True, **kwargs)


def _tensors(md) -> list:
    """Every tensor of a metadata, in a fixed order (prefills' tiles included)."""
    out = [md.slot_mapping, md.decode_token_indices, md.decode_block_table, md.decode_attn_mask, md.decode_key_bias]
    for p in md.prefills:
        out += [p.block_ids] + [t.key_bias for t in p.tiles]
    return out


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_the_window_alone_is_the_sliding_part_of_the_full_build(batch_invariant):
    """A sliding KV-cache group builds only its window's metadata: the same tensors, tiles and
    positions as the ``sliding`` part of the build that makes both."""
    seqs = [(20, 1, [9, 8, 7, 6, 5, 4]), (10, 6, [1, 2, 3, 10]), (2, 1, [3])]
    both, pos_both = build_attention_metadata(seqs, 4, "cpu", batch_invariant=batch_invariant, sliding_window=6)
    alone, pos_alone = build_sliding_attention_metadata(seqs, 4, "cpu", 6, batch_invariant=batch_invariant)
    assert alone.sliding is None and pos_alone.tolist() == pos_both.tolist() == [20, 10, 11, 12, 13, 14, 15, 2]
    ref = both.sliding
    assert [(t.start, t.end, t.num_keys, t.key_start) for p in alone.prefills for t in p.tiles] == \
        [(t.start, t.end, t.num_keys, t.key_start) for p in ref.prefills for t in p.tiles]
    assert (alone.num_decode_keys, alone.num_decode_rows, alone.decode_first_block) == \
        (ref.num_decode_keys, ref.num_decode_rows, ref.decode_first_block)
    for a, b in zip(_tensors(alone), _tensors(ref), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)

