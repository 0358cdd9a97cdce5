"""Random paged decode-attention inputs shared by the kernel build tests (the AVX2 / AVX-512 builds and the
aarch64 build checked against the x86 build): rows of given context lengths over a shuffled block pool."""

import torch


def random_paged_decode_inputs(seed: int, lens: list[int], heads: int = 6, kv_heads: int = 2, head_dim: int = 64,
                               block: int = 16, q_scale: float = 1.0, nan_key: bool = False):
    """Rows of context lengths ``lens`` whose blocks sit at shuffled places of a pool with 3 spare blocks, so a
    kernel that reads the pool in order instead of through the block table gets other keys.

    Args:
        q_scale: multiplies the queries before rounding to bfloat16 (large: softmax close to one-hot).
        nan_key: key 5 of row 0, KV head 0 made NaN: that row's query heads of KV head 0 get NaN outputs.

    Returns:
        ``(q, k, v, block_table, context_lens)``: ``q`` bfloat16 ``[len(lens), heads, head_dim]``; ``k``, ``v``
        bfloat16 ``[num_blocks * block, kv_heads, head_dim]`` (slot = block id x block + offset);
        ``block_table`` int32 ``[len(lens), max blocks of a row]`` (unused entries 0); ``context_lens`` int32
        ``[len(lens)]``.
    """
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // block) for n in lens) + 3
    pool = torch.randn(2, blocks * block, kv_heads, head_dim, generator=g)
    order = torch.randperm(blocks, generator=g).tolist()
    width = max(-(-n // block) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for r, n in enumerate(lens):
        for b in range(-(-n // block)):
            table[r, b] = order.pop()
    if nan_key:
        pool[0, int(table[0, 0]) * block + 5, 0, 3] = float("nan")
    k, v = pool.to(torch.bfloat16).unbind(0)
    q = (torch.randn(len(lens), heads, head_dim, generator=g) * q_scale).to(torch.bfloat16)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32)
