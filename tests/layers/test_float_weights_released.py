"""Each weight held once: a format that multiplies by its own copy (prepacked bf16, int8, int4 over those)
releases the projections' float weights (``load_model(keep_float_weights=False)``, the engine's load), with
the same logits bit for bit, LoRA included; a read of a released weight raises; the weights load again."""

import json

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

from prefixcache.layers.attention.metadata import build_attention_metadata
from prefixcache.layers.linear import linear_method
from prefixcache.layers.lora import LoRABatch, load_lora_adapter
from prefixcache.models.loader import load_model
from prefixcache.runner.kv_pool import allocate_kv_caches
from tests.models.model_testlib import make_tiny_checkpoint

BLOCK = 4
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Llama checkpoint with its own lm_head (not tied: the head's weight is released too)."""
    out = tmp_path_factory.mktemp("released-llama")
    make_tiny_checkpoint(out, "llama", seed=4)
    return out


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """A rank-4 PEFT adapter on layer 0's q_proj and layer 1's down_proj of the tiny model."""
    out = tmp_path_factory.mktemp("released-lora")
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    g = torch.Generator().manual_seed(9)
    tensors = {}
    for module, (n_in, n_out) in {"model.layers.0.self_attn.q_proj": (64, 64),
                                  "model.layers.1.mlp.down_proj": (128, 64)}.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(4, n_in, generator=g) * 0.2
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(n_out, 4, generator=g) * 0.2
    safetensors.torch.save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def projections(model):
    return [getattr(block, name) for layer in model.model.layers
            for block in (layer.self_attn, layer.mlp) for name in PROJECTIONS if hasattr(block, name)]


def run(loaded, ids, lora_dir=None, decode: int = 0) -> torch.Tensor:
    """Logits [len(ids), vocab]: a prefill of ``ids[:len(ids) - decode]`` then one step per remaining token
    (generated rows: the int4 formats' decoder), on scattered blocks, optionally under a LoRA adapter."""
    model, cfg = loaded.model, loaded.config
    dtype = next(model.parameters()).dtype
    kv = allocate_kv_caches(cfg.num_hidden_layers, 32, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype, "cpu")
    table = [7, 3, 19, 11, 25, 1, 30, 14]
    prompt = len(ids) - decode
    adapter = None if lora_dir is None else load_lora_adapter(lora_dir, model, "a")
    out = []
    for start, n in [(0, prompt)] + [(p, 1) for p in range(prompt, len(ids))]:
        md, positions = build_attention_metadata(
            [(start, n, table)], BLOCK, "cpu", batch_invariant=model.batch_invariant, dtype=dtype,
            num_pool_blocks=32, num_prompt_tokens=[prompt], paged_kernel=model.paged_attention)
        lora = None if adapter is None else LoRABatch([(0, n, adapter)])
        with torch.inference_mode():
            hidden = model(torch.tensor(ids[start : start + n]), positions, md, kv, lora)
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


IDS = [5, 77, 31, 200, 9, 14, 160, 42, 3, 99, 18, 250, 61]


def test_int8_holds_no_float_projection_weight_and_computes_the_same_bits(llama_dir, adapter_dir):
    kept = load_model(str(llama_dir), load_tokenizer=False, quantization="int8")
    released = load_model(str(llama_dir), load_tokenizer=False, quantization="int8", keep_float_weights=False)
    model = released.model
    for module in projections(model) + [model.lm_head]:  # the tiny Llama's lm_head is its own matrix
        assert module.weight.numel() == 0 and module.weight.dtype == torch.float32
        assert module.weight.untyped_storage().nbytes() == 0
    assert all(m.weight.numel() > 0 for m in projections(kept.model))
    assert len(model.released_weight_names()) == 2 * 7 + 1 and model.model.embed_tokens.weight.numel() == 256 * 64
    assert released.model.quantization_key == kept.model.quantization_key  # the same calibration, then released
    assert torch.equal(run(released, IDS), run(kept, IDS))
    with_lora = run(released, IDS, adapter_dir)
    assert torch.equal(with_lora, run(kept, IDS, adapter_dir))  # LoRA reads the adapter, never the base weights
    assert not torch.equal(with_lora, run(kept, IDS))


def test_a_read_of_a_released_weight_raises(llama_dir):
    loaded = load_model(str(llama_dir), load_tokenizer=False, quantization="int8", keep_float_weights=False)
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    with pytest.raises(RuntimeError):
        F.linear(torch.ones(2, 64), q_proj.weight)  # an empty tensor: a size mismatch, not garbage
    with pytest.raises(RuntimeError, match="float weights were released after loading"):
        loaded.model.quantize("none")
    assert loaded.model.linear_method.name == "int8"  # refused before anything changed
    with pytest.raises(RuntimeError, match=r"3 float weight\(s\) of this layer were released"):
        loaded.model.model.layers[0].self_attn.qkv.set_method(linear_method(torch.float32, "int8"))


def test_released_weights_load_again_from_a_directory_and_a_whole_mapping(llama_dir, tmp_path):
    kept = load_model(str(llama_dir), load_tokenizer=False, quantization="int8")
    released = load_model(str(llama_dir), load_tokenizer=False, quantization="int8", keep_float_weights=False)
    expected = run(kept, IDS)
    name = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(ValueError, match=r"15 projection float weights were released .*missing 14, "):
        released.replace_weights({name: torch.ones(128, 64)})
    assert len(released.model.released_weight_names()) == 15 and torch.equal(run(released, IDS), expected)
    other = tmp_path / "other"
    make_tiny_checkpoint(other, "llama", seed=5)
    released.replace_weights(str(other))  # every weight restored, loaded, quantized, released again
    assert len(released.model.released_weight_names()) == 15
    assert torch.equal(run(released, IDS), run(load_model(str(other), load_tokenizer=False, quantization="int8"), IDS))
    whole = {k: v.detach().clone() for k, v in kept.model.named_parameters()}  # the released ones among them
    released.replace_weights(whole)  # back to the first weights, named one by one
    assert torch.equal(run(released, IDS), expected)


def test_float32_and_the_row_tiled_method_keep_their_one_copy(llama_dir, monkeypatch):
    """Dense and row-tiled products multiply by the modules' weights: nothing to release."""
    import prefixcache.layers.linear as linear

    fp32 = load_model(str(llama_dir), load_tokenizer=False, keep_float_weights=False)
    assert fp32.model.released_weight_names() == [] and fp32.model.release_float_weights() == 0
    monkeypatch.setattr(linear, "prepacked_linear_supported", lambda: False)
    tiled = load_model(str(llama_dir), load_tokenizer=False, dtype=torch.bfloat16, keep_float_weights=False)
    assert tiled.model.linear_method.name == "bf16-row-tiled" and tiled.model.released_weight_names() == []


def test_a_tied_lm_head_keeps_the_embeddings_matrix(tmp_path):
    make_tiny_checkpoint(tmp_path, "qwen2", seed=6)  # tied embeddings, q/k/v biases
    kept = load_model(str(tmp_path), load_tokenizer=False, quantization="int8")
    released = load_model(str(tmp_path), load_tokenizer=False, quantization="int8", keep_float_weights=False)
    model = released.model
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.numel() == 256 * 64
    assert "lm_head.weight" not in model.released_weight_names() and len(model.released_weight_names()) == 14
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.numel() == 0 and q_proj.bias.shape == (64,)  # biases stay (a row each)
    assert torch.equal(run(released, IDS), run(kept, IDS))


@pytest.mark.requires_format("bfloat16", "none")
def test_bf16_prepacked_holds_the_prepacked_copy_only(llama_dir, adapter_dir):
    kept = load_model(str(llama_dir), load_tokenizer=False, dtype=torch.bfloat16)
    released = load_model(str(llama_dir), load_tokenizer=False, dtype=torch.bfloat16, keep_float_weights=False)
    if released.model.linear_method.name != "bf16-prepacked":
        pytest.skip("oneDNN's prepacked bf16 ops don't run here (row-tiled: the modules' weights are its copy)")
    assert all(m.weight.numel() == 0 and m.weight.dtype == torch.bfloat16
               for m in projections(released.model) + [released.model.lm_head])
    assert released.model.paged_attention == kept.model.paged_attention  # read from the head's dtype and device
    assert torch.equal(run(released, IDS), run(kept, IDS))
    assert torch.equal(run(released, IDS, adapter_dir), run(kept, IDS, adapter_dir))


@pytest.mark.parametrize("quantization", [pytest.param(q, marks=pytest.mark.requires_format("bfloat16", q))
                                          for q in ("int4", "int4-int8")])
def test_int4_formats_hold_their_prompt_and_4_bit_copies_only(llama_dir, quantization):
    kept = load_model(str(llama_dir), load_tokenizer=False, dtype=torch.bfloat16, quantization=quantization)
    released = load_model(str(llama_dir), load_tokenizer=False, dtype=torch.bfloat16, quantization=quantization,
                          keep_float_weights=False)
    names = released.model.released_weight_names()
    if released.model.linear_method.reads_module_weights:  # int4 over row-tiled bf16: its prompt rows read them
        assert names == []
    else:
        assert len(names) == 15 and all(m.weight.numel() == 0 for m in projections(released.model))
    assert torch.equal(run(released, IDS, decode=4), run(kept, IDS, decode=4))  # 4 generated rows: the decoder


@pytest.mark.requires_isa("avx2")  # our AVX2 int8 kernel
def test_int8_on_our_avx2_kernel_holds_its_packed_layout_only(llama_dir, monkeypatch):
    """Where int8 products run our AVX2 kernel (no VNNI / AMX-INT8; forced here), ``qweight`` is a second
    int8 copy beside the kernel's layout: released with the float weights, the same bits after."""
    import prefixcache.layers.quant as quant

    monkeypatch.setattr(quant, "uses_avx2_int8_gemm", lambda: True)
    kept = load_model(str(llama_dir), load_tokenizer=False, quantization="int8")
    released = load_model(str(llama_dir), load_tokenizer=False, quantization="int8", keep_float_weights=False)
    weights = released.model._int8_weights()
    assert len(weights) == 2 * 4 + 1
    assert all(w.qweight.numel() == 0 and w.avx2_packed is not None for w in weights)
    assert weights[0].out_features == 64 + 2 * 32  # q|k|v: 4 heads x 16, then k and v: 2 kv heads x 16 each
    assert all(w.qweight.numel() > 0 for w in kept.model._int8_weights())
    assert torch.equal(run(released, IDS), run(kept, IDS))
