"""A bf16 model on our paged attention kernel (kernels/prefill_attention.py): the runner's metadata, the
same logits bits whether a prompt runs whole or chunked then decoded (cache on == off at the model),
and close to transformers' float32 model."""

import pytest
import torch
from model_testlib import chunked_then_decoded, make_tiny_checkpoint
from test_llama_vs_transformers import prefill_alone, random_ids, reference_logits

from prefixcache.kernels import prefill_attention
from prefixcache.kernels.prefill_attention import form_supported, prefill_kernel_supported
from prefixcache.models.llama import LlamaDecoderLayer
from prefixcache.models.loader import load_model

LAYER_FORWARD_FUSED = LlamaDecoderLayer.forward_fused

pytestmark = pytest.mark.skipif(not prefill_kernel_supported(4, 2, 32), reason="needs AVX512-BF16 or AVX2")


@pytest.mark.parametrize("form", [None, pytest.param("avx2", marks=pytest.mark.skipif(
    not form_supported("avx2"), reason="needs AVX2"))])  # None: this CPU's own form; "avx2": a Zen 3's
@pytest.mark.parametrize("arch,overrides", [("qwen3", {}), ("llama", {"hidden_size": 128, "num_attention_heads": 2,
                                                                      "num_key_value_heads": 1})])
def test_bf16_model_on_the_kernel_same_bits_chunked_and_close_to_fp32(tmp_path, monkeypatch, arch, overrides, form):
    if form is not None:
        monkeypatch.setattr(prefill_attention, "prefill_form", lambda: form)
    ref = make_tiny_checkpoint(tmp_path, arch, **overrides)
    loaded = load_model(str(tmp_path), dtype=torch.bfloat16, load_tokenizer=False)
    assert loaded.model.paged_attention  # head_dim 32 (qwen3) / 64 (llama here)
    ids = random_ids(45, seed=7)
    whole = prefill_alone(loaded, ids)
    chunked, _ = chunked_then_decoded(loaded, ids)
    assert torch.equal(whole, chunked)
    torch.testing.assert_close(whole, reference_logits(ref, ids), atol=0.1, rtol=0.05)
    # the fused element-wise ops (kernels/prompt_ops.py) go with the kernel; torch's ops round within an ulp of them
    assert loaded.model.model.fused_prompt_ops
    calls = []
    monkeypatch.setattr(LlamaDecoderLayer, "forward_fused",
                        lambda self, *a: calls.append(1) or LAYER_FORWARD_FUSED(self, *a))
    assert torch.equal(prefill_alone(loaded, ids), whole) and len(calls) == loaded.model.config.num_hidden_layers
    loaded.model.model.fused_prompt_ops = False
    torch_ops = prefill_alone(loaded, ids)
    assert len(calls) == loaded.model.config.num_hidden_layers  # the torch layers ran
    torch.testing.assert_close(torch_ops, whole, atol=0.05, rtol=0.02)
    fp32 = load_model(str(tmp_path), load_tokenizer=False)
    assert not fp32.model.paged_attention  # float32 keeps torch's path, and its ops
    prefill_alone(fp32, ids)
    assert len(calls) == loaded.model.config.num_hidden_layers
    # metadata built without the kernel (md.paged None): the torch layers, not the fused ones
    loaded.model.model.fused_prompt_ops = True
    from prefixcache.layers.attention.metadata import build_attention_metadata
    md, positions = build_attention_metadata([(0, len(ids), list(range(4)))], 16, "cpu", batch_invariant=True,
                                             dtype=torch.bfloat16, num_pool_blocks=8)
    assert md.paged is None
    pool = [torch.zeros(2, 8, 16, loaded.model.config.num_key_value_heads, loaded.model.config.head_dim,
                        dtype=torch.bfloat16) for _ in range(loaded.model.config.num_hidden_layers)]
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), positions, md, pool)
    assert hidden.shape == (len(ids), loaded.model.config.hidden_size)
    assert len(calls) == loaded.model.config.num_hidden_layers


@pytest.mark.skipif(not form_supported("avx2"), reason="a float32 pool needs the kernel's AVX2 form")
def test_float32_int8_model_on_the_kernels_float32_form_same_bits_chunked(tmp_path, monkeypatch):
    """float32 with int8 weights is batch-invariant (exact integer products). Where torch's padded flash path
    gives a row other bits by batch (MKL's AVX2 path, as on an AVX2-only CPU: the check is made to say so here)
    it runs the kernel's AVX2 form over its float32 pool: a prompt's logits have the same bits whole and chunked
    then decoded, with torch's element-wise ops (the fused ones are bf16), within float rounding of the same
    model's logits on torch's path."""
    from prefixcache.layers.attention.metadata import torch_attention_batch_invariant
    from prefixcache.models import llama

    make_tiny_checkpoint(tmp_path, "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    loaded = load_model(str(tmp_path), quantization="int8", load_tokenizer=False)
    model = loaded.model
    assert model.batch_invariant and model.paged_attention == (not torch_attention_batch_invariant())
    ids = random_ids(45, seed=7)
    before = prefill_alone(loaded, ids)  # torch's path where it is batch-invariant here, else the kernel
    monkeypatch.setattr(llama, "torch_attention_batch_invariant", lambda: False)
    assert model.paged_attention and model.paged_attention_form == "avx2"
    assert not model.fuses_prompt_ops
    calls = []
    monkeypatch.setattr(LlamaDecoderLayer, "forward_fused",
                        lambda self, *a: calls.append(1) or LAYER_FORWARD_FUSED(self, *a))
    kernel_dtypes = []
    real = prefill_attention.paged_prefill_attention

    def spy(q, *args, **kwargs):
        kernel_dtypes.append(q.dtype)
        return real(q, *args, **kwargs)

    monkeypatch.setattr("prefixcache.layers.attention.torch_attention.paged_prefill_attention", spy)
    whole = prefill_alone(loaded, ids)
    chunked, _ = chunked_then_decoded(loaded, ids)
    assert torch.equal(whole, chunked)
    assert calls == [] and set(kernel_dtypes) == {torch.float32}
    assert len(kernel_dtypes) == model.config.num_hidden_layers * (1 + 2 + len(ids) - 11)
    torch.testing.assert_close(whole, before, atol=1e-4, rtol=1e-4)
