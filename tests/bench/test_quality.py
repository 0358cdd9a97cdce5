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


def test_perplexity_equals_transformers_on_a_tiny_model(tiny_llama):
    ref, loaded = tiny_llama
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        logits = ref(torch.tensor([ids])).logits[0].double()  # [40, vocab], transformers' own forward
    nll = -logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).mean()
    assert perplexity(loaded, ids) == pytest.approx(math.exp(float(nll)), rel=1e-4)


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="formats must be among"):
        weight_format_quality(formats=("int3",))


@pytest.fixture()
def tiny_llama(tmp_path):
    """(transformers model, our loaded model) of one tiny random Llama checkpoint."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
    from model_testlib import make_tiny_checkpoint

    from prefixcache.models.loader import load_model

    ref = make_tiny_checkpoint(tmp_path, "llama")
    return ref, load_model(str(tmp_path), load_tokenizer=False)
