"""RMSNorm (layers/norm.py) gives transformers' LlamaRMSNorm's bits, and with ``unit_offset``
Gemma3RMSNorm's, in float32 and bfloat16."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 640), (37, 256), (5, 9, 64)])
def test_unit_offset_has_gemma3_bits(dtype, shape):
    """Gemma's weights are stored as w - 1; the product is taken in float32 before the cast, so a
    bfloat16 output differs from Llama's form (cast, then multiply by 1 + w) somewhere."""
    g = torch.Generator().manual_seed(sum(shape) + 1)
    ours, ref = RMSNorm(shape[-1], eps=1e-6, unit_offset=True).to(dtype), Gemma3RMSNorm(shape[-1], eps=1e-6).to(dtype)
    assert torch.equal(ours.weight, torch.zeros(shape[-1], dtype=dtype))  # w - 1 of the identity norm
    weight = (torch.randn(shape[-1], generator=g) * 0.3).to(dtype)
    ours.weight.data.copy_(weight)
    ref.weight.data.copy_(weight)
    for scale in (1e-3, 1.0, 1e3):
        x = (torch.randn(*shape, generator=g) * scale).to(dtype)
        got = ours(x)
        assert got.dtype == dtype and torch.equal(got, ref(x))
    if dtype == torch.bfloat16:  # the product's order matters: Llama's order gives other bits
        llama_order = (1.0 + weight) * F.rms_norm(x.float(), (shape[-1],), None, 1e-6).to(dtype)
        assert not torch.equal(got, llama_order)
