"""Int8 weights × int8 activations (W8A8) for the linear layers, exact and batch-invariant.

Weights are quantized once, per output channel (symmetric, ``scale = max|w_row| / 127``);
activations are quantized on the fly, per token (per row, ``scale = max|x_row| / 127``), the
"per-token dynamic" scheme of LLM.int8() (Dettmers et al., 2022) and SmoothQuant (Xiao et al.,
2023), with SmoothQuant's outlier handling: each input channel j of a layer is divided by
``s_j = max|X_j|^0.5 / max|W_j|^0.5`` before the activations are quantized and the weights' column
j multiplied by it (exact in real arithmetic; :func:`smooth_factors`, ``max|X_j|`` from a
calibration prefill of a fixed text, ``LlamaForCausalLM.quantize``), which moves the activations'
outlier channels into the weights, where per-channel scales absorb them. The product ``x_q @ w_q^T``
is accumulated in int32 by ``torch._int_mm`` (oneDNN's VNNI / AMX int8 kernels on x86 CPUs), then
rescaled per row and column.

Why this scheme: integer accumulation is exact, so the sum does not depend on the kernel's
reduction order, its tiling or the number of rows in the call; with per-row activation scales,
every output row depends only on its own input row. A token's result is therefore the same in
any batch, which is what keeps "prefix cache on" and "off" giving identical tokens (vLLM's
batch-invariant mode and Thinking Machines' "Defeating Nondeterminism in LLM Inference" describe
the problem that per-tensor activation scales or batch-size-dependent float kernels cause).

``quantization="int4"`` (a bfloat16 model) runs its generated tokens on the same idea with
llama.cpp's block formats: layer weights on Q4_1's grid (4 bits per weight, a scale and a min per 32
input features), the lm_head on Q8_0's (8 bits, a scale per 32), activations quantized per row and
per 32 features to int8, each group's sum exact in int32 and the groups added in a fixed order
(``kernels/csrc/qgemm.cpp``, built for AVX512-VNNI by :mod:`prefixcache.kernels.cpu_kernels` and for AVX2 by
:mod:`prefixcache.kernels.avx2_kernels`, the same bits; ``load_int4_kernels`` picks), in the layers of
:mod:`prefixcache.layers.decode_layers`; its prompt tokens stay bf16 (and their logits rows:
:class:`RowSplit`). ``quantization="int4-int8"`` runs int4's generated tokens and this module's W8A8
products for every other row (its prompt rows' logits on the int8 lm_head).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from functools import cache

import torch

from prefixcache.config import QUANTIZATIONS
from prefixcache.kernels.avx2_kernels import (int8_gemm_avx2, int8_gemm_vnni, int8_linear_avx2, int8_linear_vnni,
                                              int8_product_avx2, int8_product_vnni, pack_weight, pack_weight_vnni,
                                              uses_avx2_int8_gemm, uses_vnni_int8_gemm)
from prefixcache.kernels.cpu_kernels import CpuKernelsUnavailable, load_cpu_kernels, load_int4_kernels

__all__ = ["INT4_GROUP", "INT4_OUTPUT_KEY", "QUANTIZATIONS", "GroupInt8Weight", "Int4Weight", "Int8Weight",
           "group_int8_linear", "int4_linear", "int8_linear", "int8_product", "int8_rows_to_float_torch",
           "quantize_activations", "quantize_activations_torch", "recording_activation_amax", "smooth_factors",
           "quantize_weight", "quantize_weight_group_int8", "quantize_weight_int4", "split_rows",
           "stacked_weight_and_bias"]
_QMAX = 127.0
_MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros instead of dividing by 0
SMOOTH_ALPHA = 0.5  # SmoothQuant's migration strength (its paper's default; 0.3-0.8 measured here, 0.5 best)


@dataclass(slots=True)
class Int8Weight:
    """A linear layer's weight in int8.

    Attributes:
        qweight: shape = [in_features, out_features] int8 (transposed: ``_int_mm``'s right operand); empty
            once released where ``avx2_packed`` or ``vnni_packed`` is the copy the products read
            (:meth:`release_qweight`).
        scale: shape = [out_features] float32, per output channel.
        bias: shape = [out_features] float32, or None.
        act_mul: shape = [in_features] float32, ``1 / s`` of :func:`smooth_factors` (the activations are
            multiplied by it before they are quantized; the weight was quantized times ``s``), or None.
        avx2_packed: ``qweight`` in :func:`~prefixcache.kernels.avx2_kernels.pack_weight`'s layout where the
            products run our AVX2 kernel (AVX2 without VNNI or AMX-INT8: ``uses_avx2_int8_gemm``), else None.
        vnni_packed: ``qweight`` in :func:`~prefixcache.kernels.avx2_kernels.pack_weight_vnni`'s layout (the
            packed matrix and its column sums) where the products run our AVX-VNNI kernel (AVX-VNNI without
            AVX512-VNNI or AMX-INT8: ``uses_vnni_int8_gemm``), else None.
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    act_mul: torch.Tensor | None = None
    avx2_packed: torch.Tensor | None = None
    vnni_packed: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def out_features(self) -> int:
        return self.scale.shape[0]

    def release_qweight(self) -> int:
        """Drops ``qweight`` where the products read ``avx2_packed`` or ``vnni_packed`` only (our AVX2 or
        AVX-VNNI kernel), so the int8 matrix is held once; an empty tensor after, so a read by mistake raises.
        Returns the bytes released."""
        if (self.avx2_packed is None and self.vnni_packed is None) or self.qweight.numel() == 0:
            return 0
        released = self.qweight.numel()
        self.qweight = self.qweight.new_empty(0, 0)
        return released


def quantize_weight(weight: torch.Tensor, bias: torch.Tensor | None = None,
                    smooth: torch.Tensor | None = None) -> Int8Weight:
    """Per-output-channel symmetric int8 quantization of ``weight`` (times ``smooth`` per input column).

    Args:
        weight: shape = [out_features, in_features], any float dtype.
        bias: shape = [out_features], or None.
        smooth: shape = [in_features], :func:`smooth_factors`, or None (no smoothing).
    """
    w = weight.detach().float()
    if smooth is not None:
        w = w * smooth.float()  # [out, in] * [in]
    scale = (w.abs().amax(dim=1) / _QMAX).clamp(min=_MIN_SCALE)  # [out_features]
    q = torch.round(w / scale[:, None]).clamp(-_QMAX, _QMAX).to(torch.int8)  # [out, in]
    return Int8Weight(
        qweight=q.t().contiguous(),
        scale=scale,
        bias=None if bias is None else bias.detach().float().clone(),
        act_mul=None if smooth is None else torch.reciprocal(smooth.float()).contiguous(),
        avx2_packed=pack_weight(q.t()) if uses_avx2_int8_gemm() else None,
        vnni_packed=pack_weight_vnni(q.t()) if uses_vnni_int8_gemm() else None,
    )


def smooth_factors(act_amax: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` (Xiao et
    al., 2023, eq. 4; the weight's maxima and ``s`` clamped to >= 1e-5 as its reference code does), with
    ``max|X_j|`` first raised to the channels' median: a channel quiet in calibration is never
    amplified more than a typical one (without the floor, a channel all-zero in calibration gets a
    huge multiplier and a large error when a later input uses it; docs/benchmarks.md has the floor's
    perplexity on texts unlike the calibration text, on which it was chosen).

    Args:
        act_amax: shape = [in_features], the largest ``|x_j|`` seen in calibration (finite).
        weight: shape = [out_features, in_features] (every matrix that reads the same input, stacked).

    Returns:
        shape = [in_features] float32.
    """
    w = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)  # [in_features]
    a = act_amax.detach().float()
    a = torch.maximum(a, a.median()).clamp(min=1e-5)
    return (a.pow(alpha) / w.pow(1 - alpha)).clamp(min=1e-5)


def stacked_weight_and_bias(modules: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights of linear layers stacked by output rows (q, k, v → qkv), [sum(out), in], detached,
    and their biases stacked likewise (zeros for a layer without one; None when none has one).

    Raises:
        RuntimeError: a layer's weight is no [out, in] matrix (released after loading:
            ``layers.linear.release_weight``), rather than deriving a copy from nothing.
    """
    weights = [m.weight.detach() for m in modules]
    if any(w.dim() != 2 for w in weights):
        raise RuntimeError("a linear layer's float weight was released after loading (an empty tensor): "
                           "load the weights again before deriving a copy from them")
    biases = [m.bias for m in modules]
    bias = None if all(b is None for b in biases) else torch.cat(
        [torch.zeros(m.out_features, dtype=m.weight.dtype) if b is None else b.detach() for m, b in zip(modules, biases)])
    return (weights[0] if len(weights) == 1 else torch.cat(weights)), bias


@cache
def _fused_int8_rows():
    """Our kernels' fused element-wise halves (``kernels/csrc/int8_rows.cpp``, the same bits as the torch ops
    below), or None where they can't run (the torch ops then)."""
    if os.environ.get("PREFIXCACHE_INT8_FUSED", "1") == "0":  # the torch ops, for A/B measurements
        return None
    try:
        return load_cpu_kernels()
    except CpuKernelsUnavailable:
        return None


def quantize_activations(x: torch.Tensor, mul: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 quantization of ``x' = float(x) * mul`` (``x`` without ``mul``):
    ``s = max(max|x'_row| / 127, 1e-12)``, ``q = round(x' / s)`` (half to even), in one pass per row
    where our kernels run (:func:`quantize_activations_torch`'s bits for finite rows; a row with a
    NaN or an infinity gets a NaN scale).

    Args:
        x: shape = [num_tokens, in_features], any float dtype.
        mul: shape = [in_features] float32 (``Int8Weight.act_mul``), or None.

    Returns:
        (x_q [num_tokens, in_features] int8, scale [num_tokens, 1] float32).
    """
    kernels = _fused_int8_rows()
    if kernels is not None and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float32):
        return kernels.quantize_rows_int8(x, mul)
    return quantize_activations_torch(x, mul)


def quantize_activations_torch(x: torch.Tensor, mul: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_activations` in torch ops (the reference; the path where our kernels can't run)."""
    x = x.float()
    if mul is not None:
        x = x * mul
    scale = (x.abs().amax(dim=-1, keepdim=True) / _QMAX).clamp_(min=_MIN_SCALE)  # [num_tokens, 1]
    # |x / scale| <= 127 * (1 + 2**-23): it rounds to at most 127, no clamp needed
    return torch.div(x, scale).round_().to(torch.int8), scale


def int8_linear(
    x_q: torch.Tensor, x_scale: torch.Tensor, weight: Int8Weight, out_dtype: torch.dtype
) -> torch.Tensor:
    """``x @ w^T + b`` from the quantized operands.

    Args:
        x_q: shape = [num_tokens, in_features] int8 (from :func:`quantize_activations`).
        x_scale: shape = [num_tokens, 1] float32.
        weight: the layer's int8 weight.
        out_dtype: dtype of the result.

    Returns:
        shape = [num_tokens, out_features]: int32 accumulation × row scale × column scale (+ bias).
    """
    fused = out_dtype == torch.float32 and x_scale.is_contiguous()  # our kernels' rescale: the same bits
    if weight.vnni_packed is not None:  # AVX-VNNI only: our kernel, the same bits as torch._int_mm's
        if fused:
            return int8_linear_vnni(x_q, x_scale, weight.vnni_packed, weight.scale, weight.bias)
        acc = int8_gemm_vnni(x_q, weight.vnni_packed, weight.out_features)
    elif weight.avx2_packed is not None:  # no VNNI: our AVX2 kernel, the same bits
        if fused:
            return int8_linear_avx2(x_q, x_scale, weight.avx2_packed, weight.scale, weight.bias)
        acc = int8_gemm_avx2(x_q, weight.avx2_packed, weight.out_features)
    else:
        acc = torch._int_mm(x_q, weight.qweight)  # [num_tokens, out_features] int32, exact
    kernels = _fused_int8_rows()
    if kernels is not None and out_dtype in (torch.bfloat16, torch.float32) and x_scale.is_contiguous():
        return kernels.int8_rows_to_float(acc, x_scale, weight.scale, weight.bias, out_dtype)  # the bits below
    return int8_rows_to_float_torch(acc, x_scale, weight, out_dtype)


def int8_product(x: torch.Tensor, weight: Int8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """``x @ w^T + b`` on the int8 weight: :func:`quantize_activations` (with the weight's
    ``act_mul``) then :func:`int8_linear`, in one call of our AVX-VNNI or AVX2 kernel where the weight is packed
    for it (``int8_product_vnni`` / ``int8_product_avx2``: the same bits, the quantization being
    ``quantize_rows_int8``'s). Inside :class:`recording_activation_amax` it also records
    ``max|x_j|`` per input channel under ``id(weight)``, over the rows without a NaN or an infinity.

    Args:
        x: shape = [num_tokens, in_features], bfloat16 or float32.

    Returns:
        shape = [num_tokens, out_features], ``out_dtype``.
    """
    stats = getattr(_THREAD, "act_amax", None)
    if stats is not None:
        finite = x.detach()[torch.isfinite(x).all(dim=1)]  # a row that overflowed tells nothing about scales
        if finite.shape[0]:
            seen = finite.abs().amax(dim=0).float()  # [in_features]
            key = id(weight)
            stats[key] = seen if key not in stats else torch.maximum(stats[key], seen)
    if x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float32) and out_dtype in (torch.bfloat16, torch.float32):
        # both halves fused into our AVX-VNNI or AVX2 kernel (the same bits as the two calls below)
        if weight.vnni_packed is not None:
            return int8_product_vnni(x, weight.act_mul, weight.vnni_packed, weight.scale, weight.bias, out_dtype)
        if weight.avx2_packed is not None:
            return int8_product_avx2(x, weight.act_mul, weight.avx2_packed, weight.scale, weight.bias, out_dtype)
    return int8_linear(*quantize_activations(x, weight.act_mul), weight, out_dtype)


# Per thread (each engine steps in its own thread; several engines may share a process and a model):
# ``act_amax``, the calibration's maxima (recording_activation_amax); ``split``, the running step's RowSplit.
_THREAD = threading.local()


class recording_activation_amax:  # noqa: N801 (a context manager used like a function)
    """``with recording_activation_amax() as amax: model(...)``: ``amax[id(weight)]`` = the largest
    ``|x_j|`` per input channel [in_features] that :func:`int8_product` saw for that weight (a
    calibration pass, in this thread only)."""

    def __enter__(self) -> dict[int, torch.Tensor]:
        _THREAD.act_amax = {}
        return _THREAD.act_amax

    def __exit__(self, *exc) -> None:
        _THREAD.act_amax = None


def int8_rows_to_float_torch(
    acc: torch.Tensor, x_scale: torch.Tensor, weight: Int8Weight, out_dtype: torch.dtype
) -> torch.Tensor:
    """``float(acc) * x_scale * weight.scale (+ bias)`` in torch ops, rounded after each, then
    ``out_dtype``: :func:`int8_linear`'s second half (the reference of ``int8_rows_to_float``)."""
    y = torch.mul(acc, x_scale).mul_(weight.scale)  # int32 -> float32 inside the first multiply
    if weight.bias is not None:
        y.add_(weight.bias)
    return y if out_dtype == torch.float32 else y.to(out_dtype)


INT4_GROUP = 32  # input features per scale (llama.cpp's Q4_1 / Q8_0 block size; also the activations')
# Block-hash key of K/V computed by generated rows. Their attention's form (kernels/csrc/paged_attention.cpp)
# follows the CPU's AVX512-BF16 like the prompt kernel's, which the model key names (kv_numerics in
# layers/attention/numerics.py);
# this names the forms' versions and which rows take which, so K/V computed under an earlier rule in a tier
# is not reused (rows past 4,096 keys take the float32 form).
INT4_OUTPUT_KEY = b"int4-generated:decoder-f32-residual|decode-attention:bf16-keys32|f32-past-4096"


@dataclass(slots=True)
class Int4Weight:
    """A linear layer's weight in 4 bits, for ``int4_mm`` (:func:`~prefixcache.kernels.cpu_kernels.load_int4_kernels`).

    ``w[n, k] = q[n, k] * scale[n // 16, k // 32, n % 16] + min[n // 16, k // 32, n % 16]`` with ``q``
    in 0..15: an asymmetric grid per group of :data:`INT4_GROUP` input features (llama.cpp's Q4_1:
    ``w = q * d + m``, d and m float16).

    Attributes:
        packed: shape = [out_features // 16, in_features // 8, 64] uint8: for a block of 16 outputs and
            8 inputs, byte ``4 j + i`` holds ``q[j, i]`` in its low and ``q[j, 4 + i]`` in its high nibble.
        scale: shape = [out_features // 16, in_features // 32, 16] float16 (a block's groups in order).
        min: the same shape, float16.
        bias: shape = [out_features] float32, or None.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    bias: torch.Tensor | None


@dataclass(slots=True)
class GroupInt8Weight:
    """A linear layer's weight in 8 bits with a scale per group of 32 input features (llama.cpp's
    Q8_0: ``w[n, k] = q[n, k] * scale[n // 16, k // 32, n % 16]``, q in -127..127), for ``int8_mm``.

    Attributes:
        packed: shape = [out_features // 16, in_features // 4, 64] int8: for a block of 16 outputs and
            4 inputs, byte ``4 j + i`` is ``q[j, i]``.
        scale: shape = [out_features // 16, in_features // 32, 16] float16.
        correction: the same shape, int32: ``-128 * sum(q)`` over the group (the AVX-512 kernel multiplies
            ``q`` with activations offset by +128; the AVX2 one keeps them signed and doesn't read it).
    """

    packed: torch.Tensor
    scale: torch.Tensor
    correction: torch.Tensor


def _check_grouped_shape(weight: torch.Tensor, name: str) -> tuple[int, int]:
    n, k = weight.shape
    if k % INT4_GROUP or n % 16:
        raise ValueError(f"{name} needs in_features % {INT4_GROUP} == 0 and out_features % 16 == 0, got [{n}, {k}]")
    return n, k


def quantize_weight_int4(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Weight:
    """Groups of 32 input features on a 16-level grid from the group's min to its max (Q4_1's rule).

    A weight that already lies on such a grid (SmolLM2's layers: the Q4_1 GGUF dequantized) gets its
    levels back exactly; ``scale`` and ``min`` are rounded to float16 (the GGUF's own precision for them).

    Args:
        weight: shape = [out_features, in_features], any float dtype.
        bias: shape = [out_features], or None.

    Raises:
        ValueError: ``in_features`` not a multiple of 32 or ``out_features`` not of 16 (the kernel's).
    """
    n, k = _check_grouped_shape(weight, "int4")
    w = weight.detach().float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = w.amin(-1), w.amax(-1)  # [n, groups]
    scale = (hi - lo) / 15
    q = torch.round((w - lo[..., None]) / torch.where(scale > 0, scale, 1.0)[..., None]).clamp_(0, 15)
    q = q.to(torch.uint8).view(n // 16, 16, k // 8, 2, 4).permute(0, 2, 1, 3, 4)  # [block, 8 inputs, j, half, i]
    packed = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(n // 16, k // 8, 64)
    return Int4Weight(
        packed=packed.contiguous(),
        scale=_by_block(scale),
        min=_by_block(lo),
        bias=None if bias is None else bias.detach().float().clone(),
    )


def quantize_weight_group_int8(weight: torch.Tensor) -> GroupInt8Weight:
    """Groups of 32 input features, symmetric 8-bit (Q8_0's rule: ``scale = max|w| / 127``). A weight
    that lies on such a grid (SmolLM2's embedding / lm_head: the GGUF's Q8_0 dequantized) gets its
    levels back, up to its own bfloat16 rounding.

    Args:
        weight: shape = [out_features, in_features], any float dtype.

    Raises:
        ValueError: ``in_features`` not a multiple of 32 or ``out_features`` not of 16.
    """
    n, k = _check_grouped_shape(weight, "group int8")
    w = weight.detach().float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    scale = w.abs().amax(-1) / _QMAX  # [n, groups]
    q = torch.round(w / torch.where(scale > 0, scale, 1.0)[..., None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return GroupInt8Weight(
        packed=q.reshape(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).reshape(n // 16, k // 4, 64).contiguous(),
        scale=_by_block(scale),
        correction=_by_block(-128 * q.sum(-1, dtype=torch.int32), torch.int32),
    )


def _by_block(t: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """[n, groups] -> [n // 16, groups, 16]: the kernel reads a block of 16 outputs' groups in order."""
    n, groups = t.shape
    return t.reshape(n // 16, 16, groups).transpose(1, 2).to(dtype).contiguous()


def int4_linear(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """``x @ w^T + b`` with the 4-bit weight and int8 activations (``int4_mm``: each row quantized
    per group of 32 inputs, exact int32 sums per group; llama.cpp's Q4_1 x Q8_1 dot product). A
    row's bits do not depend on what shares its call (``tests/layers/test_quant_int4.py``), nor on which build
    runs it (AVX512-VNNI or AVX2: :func:`~prefixcache.kernels.cpu_kernels.load_int4_kernels`). Reads an
    eighth of float32's weight bytes; ``benchmarks/int4_linear.py`` times it against bf16.

    Args:
        x: shape = [num_tokens, in_features], float32 or bfloat16.

    Returns:
        shape = [num_tokens, out_features], x's dtype.
    """
    return load_int4_kernels().int4_mm(x, weight.packed, weight.scale, weight.min, weight.bias, x.dtype)


def group_int8_linear(x: torch.Tensor, weight: GroupInt8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """``x @ w^T`` with the grouped 8-bit weight and int8 activations (``int8_mm``; llama.cpp's Q8_0 x
    Q8_0 dot product), row-invariant like :func:`int4_linear`.

    Args:
        x: shape = [num_tokens, in_features], float32 or bfloat16.

    Returns:
        shape = [num_tokens, out_features], ``out_dtype``.
    """
    return load_int4_kernels().int8_mm(x, weight.packed, weight.scale, weight.correction, None, out_dtype)


@dataclass(slots=True)
class RowSplit:
    """Which logits rows of a step run the 8-bit lm_head (generated tokens) and which the prompt rows'
    one (a prompt's last token; bf16, int8 for ``"int4-int8"``), for a model with ``quantization="int4"``
    or ``"int4-int8"``. A token's rows are chosen by what the token is, never by what shares its batch:
    the format stays batch-invariant.

    Attributes:
        int4_rows: shape = [num_int4] int64, ascending.
        dense_rows: shape = [num_dense] int64, ascending.
    """

    int4_rows: torch.Tensor
    dense_rows: torch.Tensor


class row_split:  # noqa: N801 (a context manager used like a function)
    """``with row_split(split): model.compute_logits(...)``: the int4 model's lm_head reads ``split``
    (None: all rows dense) for the duration of the call, in this thread only: with one process-wide
    split, another engine's prompt logprobs, whose rows are all dense, would run on this step's split
    while it lasted."""

    def __init__(self, split: RowSplit | None) -> None:
        self.split = split
        self.outer: RowSplit | None = None

    def __enter__(self) -> None:
        self.outer = getattr(_THREAD, "split", None)
        _THREAD.split = self.split

    def __exit__(self, *exc) -> None:
        _THREAD.split = self.outer


def split_rows(x: torch.Tensor, dense, quantized) -> torch.Tensor:
    """``dense`` for the running :class:`RowSplit`'s dense rows (all rows without one), ``quantized``
    for its int4 rows, stitched back in row order: shape = [num_tokens, out_features]."""
    split = getattr(_THREAD, "split", None)
    if split is None or split.int4_rows.numel() == 0:
        return dense(x)
    if split.dense_rows.numel() == 0:
        return quantized(x)
    y4 = quantized(x.index_select(0, split.int4_rows))
    yd = dense(x.index_select(0, split.dense_rows))
    y = yd.new_empty(x.shape[0], yd.shape[1])
    y.index_copy_(0, split.int4_rows, y4.to(yd.dtype))
    return y.index_copy_(0, split.dense_rows, yd)
