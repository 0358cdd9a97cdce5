"""RMSNorm (layers/norm.py) gives transformers' LlamaRMSNorm's bits, and with ``unit_offset``
Gemma3RMSNorm's, in float32 and bfloat16, for inputs of small, unit and large magnitude."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from prefixcache.layers.norm import RMSNorm

DTYPES = [torch.float32, torch.bfloat16]
SCALES = [1e-3, 1.0, 1e3]  # the input's magnitude: the mean square spans 1e-6 to 1e6


def same_weight_and_input(ours: torch.nn.Module, ref: torch.nn.Module, shape: tuple[int, ...], dtype: torch.dtype,
                          scale: float, weight_std: float, seed: int) -> torch.Tensor:
    """Gives ``ours`` and ``ref`` one random weight (normal, ``weight_std``) and returns an input of ``shape``
    (normal times ``scale``), both in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(shape[-1], generator=g) * weight_std).to(dtype)
    ours.weight.data.copy_(weight)
    ref.weight.data.copy_(weight)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (5, 9, 64), (130, 1536)])
def test_rms_norm_has_transformers_bits(dtype, shape, scale):
    ours, ref = RMSNorm(shape[-1], eps=1e-5).to(dtype), LlamaRMSNorm(shape[-1], eps=1e-5).to(dtype)
    x = same_weight_and_input(ours, ref, shape, dtype, scale, weight_std=1.0, seed=sum(shape))
    got = ours(x)
    assert got.dtype == dtype and torch.equal(got, ref(x))


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 640), (37, 256), (5, 9, 64)])
def test_unit_offset_has_gemma3_bits(dtype, shape, scale):
    """Gemma's weights are stored as w - 1; the product is taken in float32 before the cast, so a
    bfloat16 output differs from Llama's form (cast, then multiply by 1 + w) somewhere."""
    ours, ref = RMSNorm(shape[-1], eps=1e-6, unit_offset=True).to(dtype), Gemma3RMSNorm(shape[-1], eps=1e-6).to(dtype)
    assert torch.equal(ours.weight, torch.zeros(shape[-1], dtype=dtype))  # w - 1 of the identity norm
    x = same_weight_and_input(ours, ref, shape, dtype, scale, weight_std=0.3, seed=sum(shape) + 1)
    got = ours(x)
    assert got.dtype == dtype and torch.equal(got, ref(x))
    if dtype == torch.bfloat16:  # the product's order matters: Llama's order gives other bits
        llama_order = (1.0 + ours.weight) * F.rms_norm(x.float(), (shape[-1],), None, 1e-6).to(dtype)
        assert not torch.equal(got, llama_order)
