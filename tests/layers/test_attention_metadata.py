"""Per-step attention metadata (positions, slots, prefill/decode groups), with exact numbers."""

import pytest

from prefixcache.layers.attention import build_attention_metadata


def test_metadata_positions_slots_and_groups():
    # seq0: prefill 3 tokens in block 2; seq1: decode at position 5 (blocks 7, 4); seq2: chunk of 2 after 3
    # cached tokens (blocks 1, 6).
    md, positions = build_attention_metadata([(0, 3, [2]), (5, 1, [7, 4]), (3, 2, [1, 6, 9])], 4, "cpu")
    assert positions.tolist() == [0, 1, 2, 5, 3, 4]
    assert md.slot_mapping.tolist() == [8, 9, 10, 17, 7, 24]
    assert md.num_tokens == 6
    assert [(p.token_start, p.token_end) for p in md.prefills] == [(0, 3), (4, 6)]
    assert md.prefills[0].attn_mask is None  # nothing cached: plain causal
    assert (md.prefills[0].context_len, md.prefills[0].block_ids.tolist()) == (3, [2])
    assert (md.prefills[1].context_len, md.prefills[1].block_ids.tolist()) == (5, [1, 6])  # block 9 unused
    assert md.prefills[1].attn_mask.tolist() == [[True, True, True, True, False], [True] * 5]
    assert md.decode_token_indices.tolist() == [3]
    assert md.decode_block_table.tolist() == [[7, 4]]
    assert md.decode_attn_mask.reshape(1, 8).tolist() == [[True] * 6 + [False] * 2]  # 6 of 8 block slots


def test_metadata_decode_only_batch_pads_and_masks():
    md, positions = build_attention_metadata([(2, 1, [3]), (4, 1, [6, 5])], 4, "cpu")
    assert positions.tolist() == [2, 4]
    assert md.slot_mapping.tolist() == [14, 20]
    assert md.prefills == [] and md.decode_token_indices is None
    assert md.decode_block_table.tolist() == [[3, 0], [6, 5]]  # padded with block 0
    assert md.decode_attn_mask.reshape(2, 8).tolist() == [[True] * 3 + [False] * 5, [True] * 5 + [False] * 3]
    md, _ = build_attention_metadata([(3, 1, [3]), (3, 1, [6])], 4, "cpu")
    assert md.decode_attn_mask is None  # both contexts fill their blocks exactly


@pytest.mark.parametrize("seqs", [[], [(0, 0, [1])], [(3, 2, [1])]])
def test_metadata_rejects_bad_input(seqs):
    with pytest.raises(ValueError):
        build_attention_metadata(seqs, 4, "cpu")
