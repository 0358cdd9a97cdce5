"""RMSNorm (Llama's, and Gemma's offset form), computed in float32 and cast back, with the same bits
as transformers' LlamaRMSNorm and Gemma3RMSNorm."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension.

    Args:
        hidden_size: Size of the normalized (last) dimension.
        eps: Added to the mean square before the reciprocal square root.
        unit_offset: Gemma's form: the weight is stored as an offset from 1 (``x_normed * (1 +
            weight)``, the weight starting at 0) and the product is taken in float32 before the cast
            back, as transformers' ``Gemma3RMSNorm`` does; without it, Llama's: the normed ``x`` is cast
            first, then multiplied by the weight (``LlamaRMSNorm``). The two round differently.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalizes `x`.

        Args:
            x: shape = [..., hidden_size], any float dtype.

        Returns:
            Same shape and dtype as `x`.
        """
        # ``x * rsqrt(mean(x^2) + eps)`` in float32 as one op instead of five: the same bits as
        # transformers' form (tests/layers/test_norm.py).
        normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), None, self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}" + (", unit_offset=True" if self.unit_offset else "")
