"""Int8 weights × int8 activations (W8A8) for the linear layers, exact and batch-invariant.

Weights are quantized once, per output channel (symmetric, ``scale = max|w_row| / 127``);
activations are quantized on the fly, per token (per row, ``scale = max|x_row| / 127``), the
"per-token dynamic" scheme of LLM.int8() (Dettmers et al., 2022) and SmoothQuant (Xiao et al.,
2023) without their outlier handling. The product ``x_q @ w_q^T`` is accumulated in int32 by
``torch._int_mm`` (oneDNN's VNNI / AMX int8 kernels on x86 CPUs), then rescaled per row and column.

Why this scheme: integer accumulation is exact, so the sum does not depend on the kernel's
reduction order, its tiling or the number of rows in the call; with per-row activation scales,
every output row depends only on its own input row. A token's result is therefore the same in
any batch, which is what keeps "prefix cache on" and "off" giving identical tokens (vLLM's
batch-invariant mode and Thinking Machines' "Defeating Nondeterminism in LLM Inference" describe
the problem that per-tensor activation scales or batch-size-dependent float kernels cause).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixcache.config import QUANTIZATIONS

__all__ = ["QUANTIZATIONS", "Int8Weight", "concat_weights", "int8_linear", "quantize_activations", "quantize_weight"]
_QMAX = 127.0
_MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros instead of dividing by 0


@dataclass(slots=True)
class Int8Weight:
    """A linear layer's weight in int8.

    Attributes:
        qweight: shape = [in_features, out_features] int8 (transposed: ``_int_mm``'s right operand).
        scale: shape = [out_features] float32, per output channel.
        bias: shape = [out_features] float32, or None.
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]


def quantize_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Weight:
    """Per-output-channel symmetric int8 quantization.

    Args:
        weight: shape = [out_features, in_features], any float dtype.
        bias: shape = [out_features], or None.
    """
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / _QMAX).clamp(min=_MIN_SCALE)  # [out_features]
    q = torch.round(w / scale[:, None]).clamp(-_QMAX, _QMAX).to(torch.int8)  # [out, in]
    return Int8Weight(
        qweight=q.t().contiguous(),
        scale=scale,
        bias=None if bias is None else bias.detach().float().clone(),
    )


def concat_weights(parts: list[Int8Weight]) -> Int8Weight:
    """One weight whose output columns are ``parts``' in order (q, k, v → qkv). Exact: each column's
    int32 sum is the same whichever matrix it sits in."""
    biases = [p.bias for p in parts]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        biases = [torch.zeros(p.out_features) if b is None else b for p, b in zip(parts, biases)]
    return Int8Weight(
        qweight=torch.cat([p.qweight for p in parts], dim=1).contiguous(),
        scale=torch.cat([p.scale for p in parts]),
        bias=None if biases[0] is None else torch.cat(biases),
    )


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 quantization.

    Args:
        x: shape = [num_tokens, in_features], any float dtype.

    Returns:
        (x_q [num_tokens, in_features] int8, scale [num_tokens, 1] float32).
    """
    x = x.float()
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
    acc = torch._int_mm(x_q, weight.qweight)  # [num_tokens, out_features] int32, exact
    y = torch.mul(acc, x_scale).mul_(weight.scale)  # int32 -> float32 inside the first multiply
    if weight.bias is not None:
        y.add_(weight.bias)
    return y if out_dtype == torch.float32 else y.to(out_dtype)
