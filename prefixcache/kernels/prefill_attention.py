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

On a CPU without AVX512-BF16 (AMD Zen 2 and 3, Intel client cores) the kernel's AVX2 form runs instead
(``prefixcache/kernels/csrc/prefill_attention_avx2.cpp``, in the AVX2 extension): the same work items and
32-key blocks, rows across 8 lanes, bf16 widened to float32 and every product a float32 FMA in dim or key
order, ``p`` kept in float32; batch-invariant by the same argument, with its own bits, which the cache key
names too. Only this form takes a float32 pool (the same arithmetic, nothing to widen, float32 out) and a
sliding window (a row at position p reads keys p - window + 1 .. p), so a float32 model (float32 + int8) and a
model with sliding-window layers run it (:func:`kernel_form`) where torch's padded flash path gives a row other
bits by batch (MKL's AVX2 path: an AVX2-only CPU); on AVX-512 CPUs they keep that path, batch-invariant there
and the faster for those pools (``benchmarks/prefill_attention.py --dtype float32``, ``--window 512``).
A model with ``attention_dtype="int8"`` runs the AVX2 form's int8 products instead (:data:`INT8_FORM`: q, K, p and
V rounded to int8 with scales of their own, exact integer sums; :mod:`prefixcache.layers.attention.attention_dtype`),
on any CPU that runs the AVX2 form, with its own bits and its own name in the cache key.

A model uses it when it is batch-invariant (``bfloat16``, ``int4``'s prompt rows, ``int8``; float32 with
``int8`` and Gemma 3 in every format as above), its head shape fits (:func:`prefill_kernel_supported`) and the CPU
runs the form its pool needs; its rounding differs from the torch path's, so the cache key names which one
computed the K/V (:func:`prefixcache.layers.attention.numerics.kv_numerics`), and which form. Where it runs
no form (ARM, CPUs without AVX2, ``PREFIXCACHE_KERNELS=reference``), torch's flash path runs, padded so that
it is batch-invariant on MKL's AVX-512 path (:func:`prefixcache.layers.attention.metadata.torch_attention_batch_invariant`
checks that on the machine's own kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from prefixcache.kernels.avx2_kernels import Avx2KernelsUnavailable, load_avx2_kernels
from prefixcache.kernels.cpu_features import TIERS, cpu_has
from prefixcache.kernels.cpu_kernels import CpuKernelsUnavailable, amx_ready, load_cpu_kernels

MAX_HEADS_PER_KV_HEAD = 48  # rows of one work item
MAX_HEAD_DIM = 256
FORMS = ("amx", "avx512", "avx2")  # the kernel's forms, fastest first: AMX tiles, AVX512-BF16, AVX2 + FMA
# The AVX2 form with int8 products (q, K, p and V rounded to int8 with scales of their own): never a machine's
# choice (it costs quality), a model's where asked (``attention_dtype="int8"``), on any CPU that runs the AVX2 form.
INT8_FORM = "avx2-int8"


@dataclass(slots=True)
class PagedRows:
    """A step's sequences as the kernel reads them, built once per step by :func:`build_paged_rows`."""

    block_table: torch.Tensor  # [num_seqs, max_blocks] int32: each sequence's context blocks, in order
    query_start: torch.Tensor  # [num_seqs + 1] int32: sequence i's new tokens are rows query_start[i:i + 2]
    num_computed: torch.Tensor  # [num_seqs] int32: the position of each sequence's first new token
    window: int = 0  # 0: causal only; else each row reads only the last `window` positions, its own included


def build_paged_rows(num_computed: list[int], num_new: list[int], block_table: torch.Tensor,
                     window: int = 0) -> PagedRows:
    """Args: per sequence its cached and new tokens; block_table [num_seqs, max_blocks] int64 covering
    each one's context (validated by the caller; with a window, blocks wholly before every row's window may
    be block 0); window: a sliding window's size, 0 for none."""
    starts = [0]
    for n in num_new:
        starts.append(starts[-1] + n)
    return PagedRows(block_table=block_table.to(torch.int32).contiguous(),
                     query_start=torch.tensor(starts, dtype=torch.int32),
                     num_computed=torch.tensor(num_computed, dtype=torch.int32), window=window)


@cache
def prefill_kernel_supported(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16,
                             windowed: bool = False, int8: bool = False) -> bool:
    """Whether the kernel runs this head shape here: head_dim a multiple of 32 up to 256, at most 48
    query heads per KV head, and a form for a ``dtype`` pool (with a window where ``windowed``, with int8
    products where ``int8``) runs on this CPU (:func:`kernel_form`). (False, not an error: the model then keeps
    the torch path.)"""
    if head_dim % 32 or head_dim > MAX_HEAD_DIM or num_heads % num_kv_heads:
        return False
    return num_heads // num_kv_heads <= MAX_HEADS_PER_KV_HEAD and kernel_form(dtype, windowed, int8) is not None


def kernel_form(dtype: torch.dtype = torch.bfloat16, windowed: bool = False, int8: bool = False) -> str | None:
    """The form that runs a model's attention here: with ``int8`` products, :data:`INT8_FORM` wherever the
    AVX2 form runs; for a bf16 pool without a window, this machine's fastest (:func:`prefill_form`); for a
    float32 pool or a sliding window, "avx2", the only form that takes them, wherever it runs; None where no
    form does, or for another dtype. (Whether a model takes the kernel is the model's choice:
    ``LlamaForCausalLM.paged_attention``.)"""
    if dtype not in (torch.bfloat16, torch.float32):
        return None
    if dtype == torch.bfloat16 and not windowed and not int8:
        return prefill_form()
    if not form_supported("avx2"):
        return None
    return INT8_FORM if int8 else "avx2"


def form_supported(form: str) -> bool:
    """Whether ``form`` (one of :data:`FORMS` or :data:`INT8_FORM`) runs here: "amx" where
    :func:`prefill_amx_supported`, "avx512" on a CPU with AVX512-BF16 and AVX512-VNNI, "avx2" and "avx2-int8" on
    one with AVX2, FMA and F16C, each with its extension built (as ``PREFIXCACHE_KERNELS`` caps the CPU).

    Raises:
        ValueError: ``form`` is not one of :data:`FORMS` or :data:`INT8_FORM`.
    """
    if form == INT8_FORM:
        form = "avx2"
    if form not in FORMS:
        raise ValueError(f"form must be one of {(*FORMS, INT8_FORM)}, got {form!r}")
    if form == "amx":
        return prefill_amx_supported()
    try:
        if form == "avx512":
            return cpu_has("avx512_bf16") and bool(load_cpu_kernels())
        return cpu_has(*TIERS["avx2"]) and bool(load_avx2_kernels())
    except (CpuKernelsUnavailable, Avx2KernelsUnavailable):
        return False


@cache
def prefill_form() -> str | None:
    """The form this machine runs, the first of :data:`FORMS` that :func:`form_supported` here; None where
    none does (then no model uses the kernel). One per machine: the forms round differently, and the cache
    key names this one (:func:`prefixcache.layers.attention.numerics.kv_numerics`)."""
    return next((form for form in FORMS if form_supported(form)), None)


def prefill_amx_supported() -> bool:
    """Whether the kernel runs its products on AMX tiles here (Intel Sapphire Rapids and later: AMX-TILE
    and AMX-BF16, and Linux's grant of the tile state to this process), which it then always does:
    the AMX form rounds differently from the AVX-512 form, so a machine keeps one form and the cache
    key names it (:func:`prefixcache.layers.attention.numerics.kv_numerics`). ``PREFIXCACHE_AMX=0`` keeps the
    AVX-512 form (and oneDNN's GEMMs: every AMX form off, for A/B measurements)."""
    return amx_ready()


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, rows: PagedRows, scale: float,
                            form: str | None = None) -> torch.Tensor:
    """Causal attention of every new token over its sequence's context in the pool.

    Args:
        q: shape = [num_tokens, num_heads, head_dim] bf16 (float32: the "avx2" forms only), RoPE applied,
            sequences laid out in ``rows``' order.
        kv_cache: one layer's pool, shape = [2, num_blocks, block_size, num_kv_heads, head_dim] of q's
            dtype, the step's K/V already written.
        rows: the step's :class:`PagedRows` (a window: the "avx2" forms only).
        scale: softmax scale.
        form: one of :data:`FORMS` or :data:`INT8_FORM`; None: :func:`kernel_form` for q's dtype and the window
            (a model names its own; tests and benchmarks name one to compare the forms).

    Returns:
        shape = [num_tokens, num_heads, head_dim], q's dtype.

    Raises:
        ValueError: ``form`` is not one of :data:`FORMS` or :data:`INT8_FORM`, or takes no float32 q or window.
        RuntimeError: shapes or dtypes the kernel doesn't take, a block id outside the pool, or a form this
            CPU can't run.
    """
    form = kernel_form(q.dtype, rows.window > 0) if form is None else form
    if form is None:
        raise RuntimeError("no form of the paged prompt-attention kernel runs on this CPU for this pool (it needs "
                           "AVX2, FMA and F16C, or AVX512-BF16 for a bf16 pool without a window, and its extension "
                           "built); prefill_kernel_supported() says so first")
    if form not in FORMS and form != INT8_FORM:
        raise ValueError(f"form must be one of {(*FORMS, INT8_FORM)}, got {form!r}")
    if form not in ("avx2", INT8_FORM) and (q.dtype != torch.bfloat16 or rows.window > 0):
        raise ValueError(f"form {form!r} takes a bf16 pool without a window; the 'avx2' forms take float32 pools and "
                         "sliding windows")
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    slots = (num_blocks * block_size, num_kv_heads, head_dim)
    args = (q.contiguous(), kv_cache[0].view(slots), kv_cache[1].view(slots), rows.block_table, rows.query_start,
            rows.num_computed, block_size, scale)
    if form in ("avx2", INT8_FORM):
        return load_avx2_kernels().paged_prefill_attention_avx2(*args, rows.window, form == INT8_FORM)
    return load_cpu_kernels().paged_prefill_attention(*args, form == "amx")
