"""The paged KV pool: one preallocated tensor per layer.

Layout of each layer's tensor: shape = [2, num_blocks, block_size, num_kv_heads, head_dim], index 0 holds
K and index 1 holds V. Token slot `slot = block_id * block_size + offset` addresses
`kv_cache[:, block_id, offset]`; viewed flat, `kv_cache[0].view(num_blocks * block_size, ...)` is indexed
by the slot directly.
"""

import torch

from prefixcache.cache.tiers.entry import KVBlockLayout


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
