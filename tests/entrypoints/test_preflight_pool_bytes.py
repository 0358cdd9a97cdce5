"""Preflight's bytes per KV block (read from config.json before the load) against the pool the engine
really allocates: the tensors' bytes over the blocks, for a tiny Gemma 3 with KV-cache groups and for
the default model (one group of every layer)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from prefixcache.config import EngineConfig
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.entrypoints.cli.preflight import ModelShape, kv_block_bytes, model_shape
from prefixcache.models import fetch
from prefixcache.models.loader import load_model

NUM_BLOCKS = 12


def allocated_bytes_per_block(engine: LLMEngine) -> int:
    total = sum(t.nbytes for t in engine.runner.kv_caches)
    assert total % engine.num_blocks == 0
    return total // engine.num_blocks


@pytest.fixture(scope="module")
def tiny_gemma_dir(tmp_path_factory):
    """6 layers, local local global local local global: one full group {2, 5}, two sliding groups of
    two; blocks of 2 layers, 1 KV head of 32 dims."""
    out_dir = tmp_path_factory.mktemp("tiny-gemma3-preflight")
    config = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=8,
        query_pre_attn_scalar=24, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        architectures=["Gemma3ForCausalLM"], tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the engine needs a tokenizer
        shutil.copy(fetch.default_model_dir() / name, out_dir / name)
    return out_dir


@pytest.mark.parametrize("block_size", [4, 16])
def test_a_hybrid_models_block_holds_one_groups_layers_as_allocated(tiny_gemma_dir, block_size):
    shape = model_shape(str(tiny_gemma_dir))
    assert (shape.num_layers, shape.layers_per_block, shape.num_kv_heads, shape.head_dim) == (6, 2, 1, 32)
    per_block = kv_block_bytes(shape, block_size, "float32")
    assert per_block == 2 * 2 * block_size * 1 * 32 * 4  # K and V, 2 layers, fp32: not the 6 layers'
    loaded = load_model(str(tiny_gemma_dir))
    engine = LLMEngine(EngineConfig(model=str(tiny_gemma_dir), block_size=block_size, num_blocks=NUM_BLOCKS,
                                    num_threads=1), loaded=loaded)
    assert engine.kv_cache_groups.num_groups == 3 and len(engine.runner.kv_caches) == 2
    assert allocated_bytes_per_block(engine) == per_block == engine.kv_cache_bytes_per_block
    # A memory budget gives the blocks preflight counts on: 10.5 blocks' worth -> 10 blocks.
    budget = 10 * per_block + per_block // 2
    engine = LLMEngine(EngineConfig(model=str(tiny_gemma_dir), block_size=block_size, kv_cache_memory_bytes=budget,
                                    num_threads=1), loaded=loaded)
    assert engine.num_blocks == budget // per_block == 10
    assert allocated_bytes_per_block(engine) == per_block


def test_a_full_attention_model_keeps_every_layer_in_a_block(smollm2):
    shape = model_shape(fetch.DEFAULT_MODEL_NAME)
    if shape is None:
        pytest.skip("the default model is not fetched")
    assert shape.layers_per_block is None and shape.block_layers == shape.num_layers == 30
    engine = LLMEngine(EngineConfig(model=str(smollm2.model_dir), block_size=16, num_blocks=NUM_BLOCKS,
                                    dtype="float32", quantization="none", num_threads=1), loaded=smollm2)
    assert allocated_bytes_per_block(engine) == kv_block_bytes(shape, 16, "float32") == 737280  # 2*30*16*3*64*4


def test_gemma3_270m_blocks_hold_three_layers():
    """The fetched Gemma 3 270M's config (18 layers, full ones 5, 11, 17): six groups of three."""
    path = fetch.builtin_model_dir(fetch.GEMMA3_MODEL_NAME)
    if not fetch.is_complete(path):
        pytest.skip("gemma3-270m is not fetched")
    shape = model_shape(fetch.GEMMA3_MODEL_NAME)
    assert shape == ModelShape(18, 1, 256, 32768, shape.weights_bytes, layers_per_block=3,
                               kv_cache_groups=shape.kv_cache_groups)
    assert [g.layer_ids for g in shape.kv_cache_groups.groups][:2] == [(5, 11, 17), (0, 1, 2)]
    assert shape.kv_cache_groups.sliding_blocks_held(16) == 5 * (32 + 1 + 1)  # 5 sliding groups, window 512
    assert kv_block_bytes(shape, 16, "float32") == 2 * 3 * 16 * 1 * 256 * 4


def test_a_gemma3_config_without_layer_types_takes_the_lower_bound(tmp_path):
    """transformers derives such a config's layers from a pattern; preflight doesn't guess them."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 32, "hidden_size": 64, "max_position_embeddings": 512,
        "sliding_window": 8}))
    assert model_shape(str(tmp_path)) is None


def test_a_pool_the_sliding_groups_would_fill_is_refused_before_the_load_as_the_engine_refuses_it(tiny_gemma_dir):
    """Blocks of 4 tokens, window 8: each of the two sliding groups holds up to ceil(8 / 4) + 2 = 4 blocks for a
    running request, so 8 blocks leave none for the full-attention layers. The command line's check (from
    config.json, before the weights load) refuses it with the engine's words; 9 blocks pass both."""
    from prefixcache.entrypoints.cli.preflight import check_kv_pool
    from prefixcache.errors import InvalidInputError

    shape = model_shape(str(tiny_gemma_dir))
    assert shape.kv_cache_groups.sliding_blocks_held(4) == 8
    per_block = kv_block_bytes(shape, 4, "float32")
    configs = {flag: EngineConfig(model=str(tiny_gemma_dir), block_size=4, num_threads=1, **pool)
               for flag, pool in (("--num-blocks", {"num_blocks": 8}),
                                  ("--kv-cache-memory", {"kv_cache_memory_bytes": 8 * per_block + 1}))}
    for flag, config in configs.items():
        with pytest.raises(ValueError) as refused:
            check_kv_pool(config, shape)
        assert str(refused.value).startswith(f"{flag}: a KV pool of 8 blocks leaves none for a request's "
                                             "full-attention layers"), refused.value
        with pytest.raises(InvalidInputError) as engine_refused:
            LLMEngine(config, loaded=load_model(str(tiny_gemma_dir)))
        assert str(refused.value).split(": ", 1)[1] == str(engine_refused.value).split(": ", 1)[1]
    check_kv_pool(EngineConfig(model=str(tiny_gemma_dir), block_size=4, num_blocks=9, num_threads=1), shape)
