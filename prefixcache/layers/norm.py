"""RMSNorm, computed in float32 and cast back, in the same op order as transformers' LlamaRMSNorm."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension.

    Args:
        hidden_size: Size of the normalized (last) dimension.
        eps: Added to the mean square before the reciprocal square root.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalizes `x`.

        Args:
            x: shape = [..., hidden_size], any float dtype.

        Returns:
            Same shape and dtype as `x`.
        """
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
