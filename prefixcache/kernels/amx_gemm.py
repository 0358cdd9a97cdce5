"""A bfloat16 model's linear layers on AMX tiles (``csrc/amx_gemm.cpp``), where the CPU has AMX-BF16.

A row's output bits depend only on that row and the weight (the kernel sums each element over the input
features in blocks of 32, in order, one ``TDPBF16PS`` tile product per block), so unlike oneDNN's bf16
GEMM, which :func:`prefixcache.layers.linear.row_tiles` must call in tiles of 2 to 128 rows to get the same,
any number of rows runs as one call and the weight is read once per call. The kernel keeps a column
pair's weights in L1 over the row chunks, 6 feature blocks at a time (the same bits: each element is
still summed over its feature blocks in order), because a tile load costs about as much as a tile
product. ``benchmarks/amx_linear.py`` times it against oneDNN's prepacked product in row tiles;
docs/benchmarks.md has the measurements. oneDNN's own AMX kernel gave the same bits on the shapes checked here, but
nothing promises that across oneDNN versions and CPUs, so the cache key names our kernel for a bf16
model (:func:`prefixcache.layers.attention.numerics.kv_numerics`). Like every AMX product, it reads subnormal bf16
inputs as zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefixcache.kernels.cpu_kernels import amx_ready, load_cpu_kernels


def amx_gemm_supported() -> bool:
    """Whether bf16 linear layers run on AMX tiles here (the CPU has AMX-BF16 and Linux granted the tile
    state; ``PREFIXCACHE_AMX=0`` turns every AMX form off, for A/B measurements). The cache key names
    the choice (:func:`prefixcache.layers.attention.numerics.kv_numerics`)."""
    return amx_ready()


def amx_packable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` [out_features, in_features] takes the AMX layout: bf16, in_features a multiple of 32."""
    return weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 32 == 0


GATE_UP = 1  # amx_linear's modes (csrc/amx_gemm.cpp OutMode): a gate|up weight packed with interleave_gate_up,
SILU_MUL = 2  # written as [gate | up], or as silu(gate) * up (prompt_ops.silu_mul's bits)


def interleave_gate_up(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``weight`` [2 I, K] = [gate; up] (and ``bias`` [2 I]) with its 16-row blocks reordered gate 0, up 0,
    gate 1, up 1, ...: the layout :data:`GATE_UP` and :data:`SILU_MUL` read (I a multiple of 16)."""
    two_i, k = weight.shape
    w = weight.view(2, two_i // 32, 16, k).transpose(0, 1).reshape(two_i, k)
    b = None if bias is None else bias.view(2, two_i // 32, 16).transpose(0, 1).reshape(two_i)
    return w, b


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] bf16 in the kernel's layout: int32 [ceil(N / 16), K / 32, 16, 16], where tile
    (b, c) row i, column n holds the bf16 pair (weight[16 b + n, 32 c + 2 i], weight[16 b + n, 32 c + 2 i + 1])
    (``TDPBF16PS``'s B operand; output columns past N are zero)."""
    n, k = weight.shape
    pairs = F.pad(weight.contiguous().view(torch.int32), (0, 0, 0, -n % 16))  # [N16, K / 2]
    return pairs.view(-1, 16, k // 32, 16).permute(0, 2, 3, 1).contiguous()


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
               mode: int = 0) -> torch.Tensor:
    """``x`` [num_tokens, in_features] bf16 times the packed weight (+ ``bias`` [out_features], in the
    packed order): [num_tokens, out_features] bf16; with :data:`SILU_MUL`, [num_tokens, out_features / 2].

    Raises:
        RuntimeError: shapes or dtypes the kernel doesn't take, or no AMX here.
    """
    return load_cpu_kernels().amx_linear(x, packed, bias, out_features, mode)
