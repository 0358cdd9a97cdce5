"""KV pool sizing and per-step attention metadata, with exact numbers."""

import pytest
import torch

from prefixcache.layers.attention import build_attention_metadata
from prefixcache.runner.kv_pool import allocate_kv_caches, kv_cache_bytes_per_block, num_blocks_for_memory


def test_bytes_per_block_exact():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, block_size 16: 2 * 30 * 16 * 3 * 64 elements.
    assert kv_cache_bytes_per_block(30, 16, 3, 64, torch.float32) == 737_280
    assert kv_cache_bytes_per_block(30, 16, 3, 64, torch.bfloat16) == 368_640
    assert kv_cache_bytes_per_block(1, 1, 1, 1, torch.float16) == 4


def test_num_blocks_for_memory_floors():
    assert num_blocks_for_memory(737_280 * 10 + 737_279, 30, 16, 3, 64, torch.float32) == 10
    assert num_blocks_for_memory(737_280, 30, 16, 3, 64, torch.float32) == 1


def test_num_blocks_for_memory_too_small_names_the_budget():
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        num_blocks_for_memory(737_279, 30, 16, 3, 64, torch.float32)


def test_allocate_kv_caches_shapes_and_zeros():
    caches = allocate_kv_caches(3, 5, 4, 2, 8, torch.bfloat16, "cpu")
    assert len(caches) == 3
    assert len({c.data_ptr() for c in caches}) == 3
    for c in caches:
        assert c.shape == (2, 5, 4, 2, 8) and c.dtype == torch.bfloat16
        assert not c.any()


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
