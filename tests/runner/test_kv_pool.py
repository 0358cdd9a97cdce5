"""KV pool sizing and allocation, with exact numbers."""

import pytest
import torch

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
