"""Attention of generated tokens (the int4 format) straight from the paged KV pool.

A query row (one token, all heads) attends over its context, keys ``[0, position]`` of its sequence,
read through its block table by our kernel ``paged_decode_attention``
(``prefixcache/kernels/csrc/paged_attention.cpp``, formulas in its header): an online softmax in key
order, a long context in 1,024-key segments at fixed positions (separate work items, so on all
threads) merged in segment order. No keys are gathered or padded and one call serves all of a step's
generated rows. A row's arithmetic depends only on its own query, keys and values (and the pool's
block size), so it gets the same bits in a decode, in a recompute after preemption and in any batch.

On a CPU with AVX512-BF16 (and head_dim a multiple of 32) keys go in blocks of 32 at fixed positions,
32 keys in the lanes of two vectors, both products as bf16 dot products with float32 sums (``p``
rounded to bf16, as the prompt kernel and torch's CPU flash kernel do); elsewhere a float32 form (pieces
of at most 16 keys inside one pool block, ``float32_form=True`` runs it anywhere), which also takes
every row past 4,096 keys (a lone long context reads its K/V faster that way; the row's own length
decides, never its batch). Rows whose contexts
start with the same pool blocks (requests over one system prompt, the samples of an ``n > 1``
request) form one work item: each shared block's K is transposed and its V interleaved once, then every
row of the item does its own arithmetic over it. That is the memory and preparation side of
shared-prefix (cascade) attention (FlashInfer's cascade inference, Ye et al. 2024; vLLM's
``use_cascade_attention``) without its log-sum-exp merge, which would change a row's rounding with its
batch. ``benchmarks/decode_attention.py`` times both forms on SmolLM2's head shape.

It rounds differently from the prompt rows' kernels, so a model uses it only for rows whose K/V no
prompt row ever reuses: the generated tokens of the int4 format, whose blocks are keyed apart
(:class:`prefixcache.cache.hashing.BlockHasher` ``output_block_key``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixcache.kernels.cpu_features import cpu_has
from prefixcache.kernels.cpu_kernels import load_int4_kernels


@dataclass(slots=True)
class DecodeRows:
    """A step's generated-token rows, built by :func:`build_decode_rows`."""

    token_indices: torch.Tensor  # [num_rows] int64: each row's index in the step's batch
    block_table: torch.Tensor  # [num_rows, max_blocks] int32: the row's sequence's blocks
    context_lens: torch.Tensor  # [num_rows] int32: the row's keys, its position + 1
    block_size: int


def build_decode_rows(token_indices: list[int], context_lens: list[int], block_table: torch.Tensor,
                      block_size: int, device: torch.device | str) -> DecodeRows:
    """Args:
        token_indices: each row's index in the batch.
        context_lens: each row's keys: its position + 1 (>= 1).
        block_table: shape = [num_rows, max_blocks] int64 CPU, each row's sequence's blocks (covering
            its context; what follows is ignored).
        block_size: tokens per block.
        device: the model's device.
    """
    return DecodeRows(
        token_indices=torch.tensor(token_indices, dtype=torch.int64, device=device),
        block_table=block_table.to(torch.int32).contiguous(),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_size=block_size,
    )


def decode_attention(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, rows: DecodeRows,
                     scale: float, float32_form: bool = False) -> torch.Tensor:
    """Each row's attention over its context (see the module docstring).

    Args:
        q: shape = [num_rows, num_heads, head_dim] bfloat16, the rows in order, RoPE applied.
        k_slots: this layer's keys by pool slot, shape = [num_slots, num_kv_heads, head_dim] bfloat16
            (the rows' own K already written).
        v_slots: values, the same shape.
        rows: from :func:`build_decode_rows`.
        scale: softmax scale.
        float32_form: run the float32 form also where the CPU has AVX512-BF16 (tests, side-by-side timing).

    Returns:
        shape = [num_rows, num_heads, head_dim] bfloat16.
    """
    kernels = load_int4_kernels()  # AVX-512 or AVX2 build; the AVX2 one has only the float32 form
    float32_form = float32_form or not cpu_has("avx512_bf16")  # also where PREFIXCACHE_KERNELS caps the tier
    fn = kernels.paged_decode_attention_float32 if float32_form else kernels.paged_decode_attention
    return fn(q.contiguous(), k_slots, v_slots, rows.block_table, rows.context_lens, rows.block_size, scale)
