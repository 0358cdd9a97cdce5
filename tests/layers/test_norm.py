"""RMSNorm (layers/norm.py) gives transformers' LlamaRMSNorm's bits, in float32 and bfloat16."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from prefixcache.layers.norm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (5, 9, 64), (130, 1536)])
def test_rms_norm_has_transformers_bits(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    ours, ref = RMSNorm(shape[-1], eps=1e-5).to(dtype), LlamaRMSNorm(shape[-1], eps=1e-5).to(dtype)
    weight = torch.randn(shape[-1], generator=g).to(dtype)
    ours.weight.data.copy_(weight)
    ref.weight.data.copy_(weight)
    for scale in (1e-3, 1.0, 1e3):
        x = (torch.randn(*shape, generator=g) * scale).to(dtype)
        got = ours(x)
        assert got.dtype == dtype and torch.equal(got, ref(x))
