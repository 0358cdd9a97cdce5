"""Attention of a step's prompt rows (prefill chunks and bf16 decodes) straight from the paged KV pool.

Our kernel ``paged_prefill_attention`` (``prefixcache/kernels/csrc/prefill_attention.cpp``, AVX512-BF16):
each sequence's new tokens attend causally to their context through its block table, in one call for
the whole step; no keys are gathered, copied or padded. Rows (token, query head of one KV head) lie
across vector lanes, keys are taken in blocks of 32 at fixed positions, scores and ``p @ v`` are bf16
dot products with float32 sums, the softmax is online in float32 (FlashAttention-2's order, Dao
2023; ``p`` rounded to bf16 for the second product as torch's CPU flash kernel does).

A row's arithmetic depends only on its own query and its keys and values at their absolute positions,
so it gets the same bits in a prefill of any length after any cached prefix, in a decode and in any
batch, without the query and key padding that :mod:`prefixcache.layers.attention.metadata` needs to get the
same from torch's flash kernel. ``benchmarks/prefill_attention.py`` times it against that path;
docs/benchmarks.md has the measurements.

Where the CPU has AMX-BF16 tiles (Intel Sapphire Rapids and later), the kernel runs both products as
tile products instead (``TDPBF16PS``, scores as K . q^T with K's rows read straight from the pool, the
output as V^T . p^T) around an online softmax of the same order with fewer instructions (the max
on the raw sums, ``p = 2^(s * scale - m)``, a -inf score making its row NaN like NaN and +inf); a tile product's element depends only on its own row and column, so the batch invariance
above holds, but its sums and 2^x differ from the AVX-512 form's, so the cache key names the form.

A model uses it when it is batch-invariant in bfloat16 (``bfloat16``, ``int4``'s prompt rows, ``int8``
with a bf16 model), its head shape fits (:func:`prefill_kernel_supported`) and the CPU has
AVX512-BF16; its rounding differs from the torch path's, so the cache key names which one computed
the K/V (:func:`prefixcache.layers.attention.numerics.kv_numerics`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from prefixcache.kernels.cpu_features import cpu_has
from prefixcache.kernels.cpu_kernels import CpuKernelsUnavailable, amx_ready, load_cpu_kernels

MAX_HEADS_PER_KV_HEAD = 48  # rows of one work item
MAX_HEAD_DIM = 256


@dataclass(slots=True)
class PagedRows:
    """A step's sequences as the kernel reads them, built once per step by :func:`build_paged_rows`."""

    block_table: torch.Tensor  # [num_seqs, max_blocks] int32: each sequence's context blocks, in order
    query_start: torch.Tensor  # [num_seqs + 1] int32: sequence i's new tokens are rows query_start[i:i + 2]
    num_computed: torch.Tensor  # [num_seqs] int32: the position of each sequence's first new token


def build_paged_rows(num_computed: list[int], num_new: list[int], block_table: torch.Tensor) -> PagedRows:
    """Args: per sequence its cached and new tokens; block_table [num_seqs, max_blocks] int64 covering
    each one's context (validated by the caller)."""
    starts = [0]
    for n in num_new:
        starts.append(starts[-1] + n)
    return PagedRows(block_table=block_table.to(torch.int32).contiguous(),
                     query_start=torch.tensor(starts, dtype=torch.int32),
                     num_computed=torch.tensor(num_computed, dtype=torch.int32))


@cache
def prefill_kernel_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel runs this head shape here: head_dim a multiple of 32 up to 256, at most 48
    query heads per KV head, a CPU with AVX512-BF16 and AVX512-VNNI, the extension built. (False,
    not an error: the model then keeps the torch path.)"""
    if head_dim % 32 or head_dim > MAX_HEAD_DIM or num_heads % num_kv_heads:
        return False
    if num_heads // num_kv_heads > MAX_HEADS_PER_KV_HEAD or not cpu_has("avx512_bf16"):
        return False
    try:
        load_cpu_kernels()
    except CpuKernelsUnavailable:
        return False
    return True


def prefill_amx_supported() -> bool:
    """Whether the kernel runs its products on AMX tiles here (Intel Sapphire Rapids and later: AMX-TILE
    and AMX-BF16, and Linux's grant of the tile state to this process), which it then always does:
    the AMX form rounds differently from the AVX-512 form, so a machine keeps one form and the cache
    key names it (:func:`prefixcache.layers.attention.numerics.kv_numerics`). ``PREFIXCACHE_AMX=0`` keeps the
    AVX-512 form (and oneDNN's GEMMs: every AMX form off, for A/B measurements)."""
    return amx_ready()


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, rows: PagedRows, scale: float,
                            amx: bool | None = None) -> torch.Tensor:
    """Causal attention of every new token over its sequence's context in the pool.

    Args:
        q: shape = [num_tokens, num_heads, head_dim] bf16, RoPE applied, sequences laid out in
            ``rows``' order.
        kv_cache: one layer's pool, shape = [2, num_blocks, block_size, num_kv_heads, head_dim] bf16,
            the step's K/V already written.
        rows: the step's :class:`PagedRows`.
        scale: softmax scale.
        amx: the products on AMX tiles; None: where :func:`prefill_amx_supported` (tests pass False to
            compare the forms).

    Returns:
        shape = [num_tokens, num_heads, head_dim] bf16.

    Raises:
        RuntimeError: shapes or dtypes the kernel doesn't take, or a block id outside the pool.
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    slots = (num_blocks * block_size, num_kv_heads, head_dim)
    return load_cpu_kernels().paged_prefill_attention(
        q.contiguous(), kv_cache[0].view(slots), kv_cache[1].view(slots), rows.block_table, rows.query_start,
        rows.num_computed, block_size, scale, prefill_amx_supported() if amx is None else amx)
