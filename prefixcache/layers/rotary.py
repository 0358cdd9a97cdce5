"""Rotary position embedding (RoPE), rotate-half convention, as in transformers' Llama code.

Supported `rope_type`s: "default", "linear" and "llama3". The inverse frequencies are computed once at
construction; cos/sin are computed once per step from the batch's positions (not per layer) and shared
by all layers, so no `[max_position_embeddings, head_dim]` table is kept.
"""

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def compute_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, identical to transformers' rope init functions.

    Args:
        head_dim: Rotated dimension per head (even).
        rope_theta: RoPE base wavelength.
        rope_scaling: None for plain RoPE, else a dict with "rope_type" ("default", "linear" or "llama3")
            and that type's parameters ("factor"; for llama3 also "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings").

    Returns:
        float32 CPU tensor, shape = [head_dim // 2].

    Raises:
        ValueError: Unsupported `rope_parameters.rope_type`, or a missing scaling parameter.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / head_dim
    inv_freq = 1.0 / (rope_theta**exponent)
    rope_type = "default" if rope_scaling is None else rope_scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_parameters.rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return inv_freq
    try:
        factor = float(rope_scaling["factor"])
        if rope_type == "linear":
            return inv_freq / factor
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        old_context_len = rope_scaling["original_max_position_embeddings"]
    except KeyError as e:
        raise ValueError(f"rope_parameters of rope_type {rope_type!r} lacks the field {e.args[0]!r}") from None
    # llama3: keep high frequencies, divide low frequencies by `factor`, interpolate in between.
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor) -> torch.Tensor:
    """Rotates `x` by the per-token angles: ``x * cos + rotate_half(x) * sin`` (transformers'
    ``rotate_half`` maps the halves (x1, x2) to (-x2, x1)), computed as
    ``x * cos + roll(x, half) * sin_rot`` with ``sin_rot = (-sin1, sin2)`` (three fewer ops per call;
    the same bits: ``(-a) * b == a * (-b)`` exactly).

    Args:
        x: shape = [num_tokens, num_heads, head_dim].
        cos: shape = [num_tokens, 1, head_dim], same dtype as `x`.
        sin_rot: shape = [num_tokens, 1, head_dim], same dtype as `x`: sin with its first half negated
            (`RotaryEmbedding.forward`'s second output).

    Returns:
        shape = [num_tokens, num_heads, head_dim].
    """
    return (x * cos) + (x.roll(x.shape[-1] // 2, dims=-1) * sin_rot)


class RotaryEmbedding(nn.Module):
    """Computes the per-token cos/sin of RoPE.

    Args:
        head_dim: Rotated dimension per head.
        rope_theta: RoPE base wavelength.
        rope_scaling: See `compute_inv_freq`.

    Raises:
        ValueError: Unsupported rope type (see `compute_inv_freq`).
    """

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None) -> None:
        super().__init__()
        # A plain attribute, not a buffer: it is never in a checkpoint and must survive `to_empty()`.
        self.inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling).to("cpu")

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position.

        Args:
            positions: int64, shape = [num_tokens].
            dtype: Output dtype (the model's activation dtype).

        Returns:
            (cos, sin_rot), each shape = [num_tokens, 1, head_dim]; sin_rot is sin with its first half
            negated, as `apply_rotary_emb` takes it.
        """
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq  # [num_tokens, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
        sin = emb.sin().to(dtype)
        sin_rot = torch.cat((-sin[:, : freqs.shape[1]], sin[:, freqs.shape[1] :]), dim=-1)
        return emb.cos().to(dtype)[:, None, :], sin_rot[:, None, :]
