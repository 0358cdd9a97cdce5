"""The real built-in model, checked against transformers on the same directory.

Uses the session fixture `smollm2` of tests/conftest.py (`load_model("smollm2-135m")`, which fetches the
model on first use; CI fetches it beforehand with `prefixcache fetch`).
"""

import pytest
import torch
from model_testlib import PagedDriver
from transformers import AutoModelForCausalLM

from prefixcache.models.fetch import fetch_default_model, is_complete
from prefixcache.models.loader import resolve_model_dir

pytestmark = pytest.mark.slow


def test_fetched_dir_is_complete_and_resolves_by_name(smollm2):
    assert fetch_default_model() == smollm2.model_dir  # already complete: no download
    assert is_complete(smollm2.model_dir)
    assert resolve_model_dir("smollm2-135m") == smollm2.model_dir


def test_smollm2_config(smollm2):
    cfg = smollm2.config
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert (cfg.head_dim, cfg.hidden_size, cfg.vocab_size) == (64, 576, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_scaling is None
    assert smollm2.max_model_len == 8192
    assert 2 in smollm2.eos_token_ids
    assert smollm2.tokenizer.chat_template


def test_smollm2_logits_match_transformers(smollm2):
    text = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    ids = smollm2.tokenizer(text).input_ids
    ref = AutoModelForCausalLM.from_pretrained(smollm2.model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = ref(torch.tensor([ids])).logits[0]
    del ref
    driver = PagedDriver(smollm2, block_size=16, num_blocks=8)
    driver.add("a", len(ids))
    got = driver.step([("a", ids[:20])])["a"]
    got = torch.cat([got, driver.step([("a", ids[20:])])["a"]])
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
    assert got[-1].argmax() == expected[-1].argmax()
