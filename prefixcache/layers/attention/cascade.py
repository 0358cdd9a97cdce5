"""Shared-prefix (cascade) decode attention: decodes whose contexts start with the same pool blocks
(requests over one system prompt, the samples of an ``n > 1`` request) attend to that shared run
once: one call for all their queries over the run's keys, read in place when the blocks are
consecutive in the pool, then each decode's own tail in one padded call, the two merged by their
log-sum-exp. This is FlashInfer's cascade inference (Ye et al., "Cascade Inference: Memory
Bandwidth Efficient Shared Prefix Batch Decoding", 2024) and vLLM's cascade attention
(vllm/v1/attention/backends/flash_attn.py, ``use_cascade_attention``), written over torch's CPU
flash kernel, which returns the log-sum-exp. It changes rounding (the softmax is summed in two
parts), so it is used only without ``batch_invariant``
(:func:`prefixcache.layers.attention.metadata.build_attention_metadata` forms no group then, nor for a
local layer's window, which a group's shared run may lie outside).
"""

from dataclasses import dataclass

import torch

MIN_CASCADE_KEYS = 128  # shared keys below which a separate shared-prefix call does not pay


@dataclass(slots=True)
class CascadeGroup:
    """Decodes whose contexts start with the same run of pool blocks (see the module docstring)."""

    members: torch.Tensor  # [num_members] int64: indices into the step's decodes, >= 2 of them
    block_ids: torch.Tensor | None  # [num_shared_blocks] int64: the shared run; None when consecutive
    first_block: int  # the run's first block (read as a view when block_ids is None)
    num_keys: int  # shared tokens: num_shared_blocks * block_size


def common_run_length(ids: torch.Tensor) -> int:
    """Leading columns of ``ids`` [num_rows, n] on which every row agrees: the rows' common run of
    blocks (the cascade groups')."""
    same = (ids == ids[0]).all(0)  # [n]
    return ids.shape[1] if bool(same.all()) else int(same.to(torch.int8).argmin())


def is_consecutive(blocks: torch.Tensor) -> bool:
    """Whether block ids [n] are first, first + 1, ...: readable as one view of the pool."""
    return bool((blocks == blocks[0] + torch.arange(blocks.shape[0])).all())


def build_cascade_groups(
    seqs: list[tuple[int, int, list[int]]],
    block_table: torch.Tensor,
    decode_rows: list[int],
    block_size: int,
    device: torch.device | str,
) -> list[CascadeGroup]:
    """Groups of >= 2 decodes whose contexts start with the same >= MIN_CASCADE_KEYS tokens of pool
    blocks (their longest common run of block ids, only blocks before each one's last token)."""
    by_first_block: dict[int, list[int]] = {}
    for d, row in enumerate(decode_rows):
        if (seqs[row][0] + seqs[row][1] - 1) // block_size > 0:  # a full block before its last token
            by_first_block.setdefault(int(block_table[row, 0]), []).append(d)
    groups = []
    for members in by_first_block.values():
        if len(members) < 2:
            continue
        rows = [decode_rows[d] for d in members]
        num_full = min((seqs[r][0] + seqs[r][1] - 1) // block_size for r in rows)
        ids = block_table[rows, :num_full]  # [num_members, num_full]
        num_shared = common_run_length(ids)
        if num_shared * block_size < MIN_CASCADE_KEYS:
            continue
        run = ids[0, :num_shared]
        consecutive = is_consecutive(run)
        groups.append(CascadeGroup(
            members=torch.tensor(members, dtype=torch.int64, device=device),
            block_ids=None if consecutive else run.to(device),
            first_block=int(run[0]),
            num_keys=num_shared * block_size,
        ))
    return groups


def shared_prefix_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: CascadeGroup, num_kv_heads: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A cascade group's queries over its shared blocks, in one call.

    Args:
        q: shape = [num_members, num_heads, head_dim].
        k_cache, v_cache: one layer's pool, each shape = [num_blocks, block_size, num_kv_heads, head_dim].
        g: the group (its shared run of blocks).
        num_kv_heads: KV heads; divides num_heads.
        scale: the softmax scale.

    Returns:
        (out, lse): shape = [num_members, num_heads, head_dim] and [num_members, num_heads] float32.
    """
    num_members, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    kv_shape = (g.num_keys, num_kv_heads, head_dim)
    if g.block_ids is None:  # consecutive blocks: a view of the pool, no copy
        num_blocks = g.num_keys // k_cache.shape[1]
        k = k_cache[g.first_block : g.first_block + num_blocks].view(kv_shape)
        v = v_cache[g.first_block : g.first_block + num_blocks].view(kv_shape)
    else:
        k = k_cache.index_select(0, g.block_ids).view(kv_shape)
        v = v_cache.index_select(0, g.block_ids).view(kv_shape)
    q_rows = q.view(num_members, num_kv_heads, group, head_dim).transpose(0, 1)
    q_rows = q_rows.reshape(1, num_kv_heads, num_members * group, head_dim)  # members' heads as rows
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_rows, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale
    )[:2]  # [1, kv_heads, num_members * group, head_dim], [1, kv_heads, num_members * group]
    out = out.reshape(num_kv_heads, num_members, group, head_dim).transpose(0, 1)
    lse = lse.reshape(num_kv_heads, num_members, group).transpose(0, 1)
    return (out.reshape(num_members, num_heads, head_dim),
            lse.reshape(num_members, num_heads))


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over keys A ∪ B from attention over A and over B (disjoint), by their log-sum-exp.

    ``out = (out_a * exp(lse_a - m) + out_b * exp(lse_b - m)) / (exp(lse_a - m) + exp(lse_b - m))``
    with ``m = max(lse_a, lse_b)`` (the merge of FlashInfer's cascade inference and of vLLM's
    ``merge_attn_states``), in float32.

    Args:
        out_a, out_b: shape = [num_tokens, num_heads, head_dim].
        lse_a, lse_b: shape = [num_tokens, num_heads], natural-log sums of exp(scores).

    Returns:
        shape = [num_tokens, num_heads, head_dim], out_a's dtype.
    """
    m = torch.maximum(lse_a, lse_b)
    w_a = torch.exp(lse_a - m).unsqueeze(-1)  # [num_tokens, num_heads, 1]
    w_b = torch.exp(lse_b - m).unsqueeze(-1)
    merged = (out_a.float() * w_a + out_b.float() * w_b) / (w_a + w_b)
    return merged.to(out_a.dtype)
