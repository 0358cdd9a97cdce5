"""The paged KV pool: one preallocated tensor per layer of a KV-cache group.

Layout of each tensor: shape = [2, num_blocks, block_size, num_kv_heads, head_dim], index 0 holds
K and index 1 holds V. Token slot `slot = block_id * block_size + offset` addresses
`kv_cache[:, block_id, offset]`; viewed flat, `kv_cache[0].view(num_blocks * block_size, ...)` is indexed
by the slot directly.

With one KV-cache group (the Llama family) there is one tensor per layer. With several
(:mod:`prefixcache.cache.kv_cache_groups`: sliding-window layers kept apart) there are
`layers_per_group` tensors: a block holds the K/V of one group's layers while allocated, layer L in
tensor `layer_to_group[L][1]`; so every `num_layers` argument below is `layers_per_group`.
"""

import torch

from prefixcache.cache.kv_cache_groups import (KVCacheGroups, layer_specs_from_config, make_kv_cache_groups,
                                              single_group)
from prefixcache.cache.tiers.entry import KVBlockLayout


def kv_cache_groups_of(model: torch.nn.Module, config: object) -> KVCacheGroups:
    """The KV-cache groups a loaded model runs with.

    A model that takes per-group attention metadata (class attribute ``uses_kv_cache_groups =
    True``, see :mod:`prefixcache.layers.grouped_attention`) gets the groups its config's
    ``layer_types`` / ``sliding_window`` declare; any other model one group of every layer (all its
    layers keep the whole context, as the Llama family's do).

    Args:
        model: the loaded model.
        config: its ``ModelConfig`` (``num_hidden_layers``, optionally ``layer_types``, ``sliding_window``).

    Raises:
        ValueError: malformed ``layer_types`` (see ``layer_specs_from_config``).
    """
    if getattr(model, "uses_kv_cache_groups", False):
        return make_kv_cache_groups(layer_specs_from_config(config))
    return single_group(config.num_hidden_layers)


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, K and V.

    Args:
        num_layers: Decoder layers.
        block_size: Tokens per block.
        num_kv_heads: KV heads per layer.
        head_dim: Dimension per head.
        dtype: Element dtype of the pool.

    Returns:
        2 * num_layers * block_size * num_kv_heads * head_dim * element size, in bytes.
    """
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def kv_block_layout(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> KVBlockLayout:
    """One block's K/V as a KV tier entry holds it: ``shape = [num_layers, 2, block_size,
    num_kv_heads, head_dim]`` in the pool's dtype (what ``ModelRunner.read_blocks`` returns)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return KVBlockLayout(str(dtype).removeprefix("torch."), (num_layers, 2, block_size, num_kv_heads, head_dim), itemsize)


def num_blocks_for_memory(
    kv_cache_memory_bytes: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> int:
    """How many whole blocks fit in a memory budget.

    Args:
        kv_cache_memory_bytes: Budget for the whole pool, in bytes.
        num_layers, block_size, num_kv_heads, head_dim, dtype: As in `kv_cache_bytes_per_block`.

    Returns:
        floor(kv_cache_memory_bytes / bytes per block), at least 1.

    Raises:
        ValueError: The budget holds less than one block.
    """
    bytes_per_block = kv_cache_bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
    num_blocks = kv_cache_memory_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory_bytes={kv_cache_memory_bytes} is less than one KV block "
            f"({bytes_per_block} bytes for block_size={block_size}); raise kv_cache_memory_bytes"
        )
    return num_blocks


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> list[torch.Tensor]:
    """Allocates the zeroed pool.

    Returns:
        num_layers tensors, each shape = [2, num_blocks, block_size, num_kv_heads, head_dim].
    """
    return [
        torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        for _ in range(num_layers)
    ]
