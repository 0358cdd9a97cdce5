"""The quality report's arithmetic on hand-made values, and perplexity on a tiny model."""

import math

import pytest
import torch

from prefixcache.bench.quality import greedy_agreement, perplexity, weight_format_quality


def test_greedy_agreement_counts_identical_prompts_and_matching_prefixes():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    out = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    assert greedy_agreement(out, ref) == {"identical_prompts": 1, "num_prompts": 3,
                                          "mean_matching_prefix": (1 + 0.5 + 0) / 3}


def test_perplexity_is_exp_of_the_teacher_forced_nll(tiny_llama_loaded):
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    model = tiny_llama_loaded.model
    with torch.inference_mode():  # reference: the float model run the plain way, via the paged driver
        from prefixcache.layers.attention import build_attention_metadata
        from prefixcache.runner.kv_pool import allocate_kv_caches

        cfg = tiny_llama_loaded.config
        kv = allocate_kv_caches(cfg.num_hidden_layers, 64, 16, cfg.num_key_value_heads, cfg.head_dim,
                                torch.float32, "cpu")
        md, pos = build_attention_metadata([(0, 40, list(range(64)))], 16, "cpu")
        logits = model.compute_logits(model(torch.tensor(ids), pos, md, kv)).double()
    nll = -logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).mean()
    assert perplexity(tiny_llama_loaded, ids) == pytest.approx(math.exp(float(nll)), rel=1e-9)


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="formats must be among"):
        weight_format_quality(formats=("int4",))


@pytest.fixture()
def tiny_llama_loaded(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
    from model_testlib import make_tiny_checkpoint

    from prefixcache.models.loader import load_model

    make_tiny_checkpoint(tmp_path, "llama")
    return load_model(str(tmp_path), load_tokenizer=False)
