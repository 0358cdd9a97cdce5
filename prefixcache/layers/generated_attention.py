"""Attention of generated tokens (the int4 format) straight from the paged KV pool.

A query row (one token, all heads) attends over its context, keys ``[0, position]`` of its sequence,
read through its block table by our kernel ``paged_decode_attention``
(``prefixcache/layers/csrc/paged_attention.cpp``): online softmax in float32 over pieces of at most
16 keys inside one pool block, in key order, a long context in 1,024-key segments at fixed positions
(separate work items, so on all threads) merged in segment order. No keys are gathered or padded and
one call serves all of a step's generated rows. A row's arithmetic depends
only on its own query, keys and values (and the pool's block size), so it gets the same bits in a
decode, in a recompute after preemption and in any batch.

Rows whose contexts share prefix blocks (requests over one system prompt, the samples of an ``n > 1``
request) are processed one after another per kv head and segment on the same thread, so a shared block is read
from memory once and from cache by the next rows: the memory side of shared-prefix (cascade)
attention (FlashInfer's cascade inference, Ye et al. 2024; vLLM's ``use_cascade_attention``) without
changing any row's arithmetic. (Before 2026-12-01 this module split contexts into fixed 256-key
chunks of torch's flash kernel merged by log-sum-exp, computing shared chunks once: same invariance,
more calls and copies.)

It rounds differently from the one-call flash form prompt rows use, so a model uses it only for rows
whose K/V no prompt row ever reuses: the generated tokens of the int4 format, whose blocks are keyed
apart (:class:`prefixcache.cache.hashing.BlockHasher` ``output_block_key``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixcache.layers.cpu_kernels import load_cpu_kernels


@dataclass(slots=True)
class GeneratedRows:
    """A step's generated-token rows, built by :func:`build_generated_rows`."""

    token_indices: torch.Tensor  # [num_rows] int64: each row's index in the step's batch
    block_table: torch.Tensor  # [num_rows, max_blocks] int32: the row's sequence's blocks
    context_lens: torch.Tensor  # [num_rows] int32: the row's keys, its position + 1
    block_size: int


def build_generated_rows(token_indices: list[int], context_lens: list[int], block_table: torch.Tensor,
                         block_size: int, device: torch.device | str) -> GeneratedRows:
    """Args:
        token_indices: each row's index in the batch.
        context_lens: each row's keys: its position + 1 (>= 1).
        block_table: shape = [num_rows, max_blocks] int64 CPU, each row's sequence's blocks (covering
            its context; what follows is ignored).
        block_size: tokens per block.
        device: the model's device.
    """
    return GeneratedRows(
        token_indices=torch.tensor(token_indices, dtype=torch.int64, device=device),
        block_table=block_table.to(torch.int32).contiguous(),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_size=block_size,
    )


def generated_attention(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, rows: GeneratedRows,
                        scale: float) -> torch.Tensor:
    """Each row's attention over its context (see the module docstring).

    Args:
        q: shape = [num_rows, num_heads, head_dim] bfloat16, the rows in order, RoPE applied.
        k_slots: this layer's keys by pool slot, shape = [num_slots, num_kv_heads, head_dim] bfloat16
            (the rows' own K already written).
        v_slots: values, the same shape.
        rows: from :func:`build_generated_rows`.
        scale: softmax scale.

    Returns:
        shape = [num_rows, num_heads, head_dim] bfloat16.
    """
    return load_cpu_kernels().paged_decode_attention(q.contiguous(), k_slots, v_slots, rows.block_table,
                                                     rows.context_lens, rows.block_size, scale)
