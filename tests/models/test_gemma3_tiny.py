"""Our Gemma 3 against transformers' Gemma3ForCausalLM on a tiny random checkpoint (fp32, eager
attention), with a 5-token sliding window so that short prompts run well past it."""

import pytest
import torch
from model_testlib import PagedDriver, chunked_then_decoded, tiny_gemma3_config
from transformers import AutoModelForCausalLM

from prefixcache.models.loader import load_model

ATOL = 1e-4  # the Llama family's tiny-checkpoint tolerance (test_llama_vs_transformers.py)
WINDOW = 5


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """(transformers model, our loaded model) of a 4-layer Gemma 3: local, local, global, local."""
    out_dir = tmp_path_factory.mktemp("tiny-gemma3")
    config = tiny_gemma3_config(["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                                WINDOW, final_logit_softcapping=30.0, initializer_range=0.1,
                                attn_implementation="eager")
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # Gemma's norm weights start at 0 (a factor 1): make them matter
        for name, param in ref.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    ref.save_pretrained(out_dir)
    return ref, load_model(str(out_dir), load_tokenizer=False)


def reference_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return ref(torch.tensor([ids])).logits[0].float()  # [len(ids), vocab]


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_config_parsed(tiny_gemma):
    _, loaded = tiny_gemma
    cfg = loaded.config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.sliding_window == WINDOW
    assert cfg.layer_types == ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 24.0)
    assert cfg.final_logit_softcapping == 30.0 and cfg.hidden_act == "gelu_pytorch_tanh"


@pytest.mark.parametrize("n", [23, 300])  # 300: two query tiles, the second reading only its window's keys
def test_prefill_past_the_window_matches_transformers(tiny_gemma, n):
    ref, loaded = tiny_gemma
    ids = random_ids(n, seed=1)
    driver = PagedDriver(loaded, num_blocks=4 * 76)  # 4 KV-cache groups (1 full, 3 sliding)
    driver.add("a", len(ids))
    torch.testing.assert_close(driver.step([("a", ids)])["a"], reference_logits(ref, ids), atol=ATOL, rtol=0)


def test_window_changes_the_result(tiny_gemma):
    """Positions past the window differ from full attention's (the mask is really applied), those
    within it don't."""
    ref, loaded = tiny_gemma
    ids = random_ids(12, seed=2)
    driver = PagedDriver(loaded)
    driver.add("a", len(ids))
    windowed = driver.step([("a", ids)])["a"]
    ref.config.sliding_window = 10_000
    try:
        full = reference_logits(ref, ids)
    finally:
        ref.config.sliding_window = WINDOW
    torch.testing.assert_close(windowed[:WINDOW], full[:WINDOW], atol=ATOL, rtol=0)
    assert (windowed[WINDOW:] - full[WINDOW:]).abs().max() > 1e-2


def test_chunked_prefill_then_decode_matches_transformers(tiny_gemma):
    ref, loaded = tiny_gemma
    ids = random_ids(19, seed=3)
    got, block_table = chunked_then_decoded(loaded, ids)
    assert block_table != sorted(block_table)  # non-contiguous, shuffled
    torch.testing.assert_close(got, reference_logits(ref, ids), atol=ATOL, rtol=0)


def test_mixed_batch_equals_each_alone(tiny_gemma):
    """Prefill chunks (with and without a cached prefix) and decodes past the window in one forward."""
    _, loaded = tiny_gemma
    prompts = {s: random_ids(n, seed=10 + i) for i, (s, n) in enumerate({"a": 14, "b": 9, "c": 7, "d": 12}.items())}
    shared = random_ids(8, seed=20)
    prompts["e"] = shared + random_ids(5, seed=21)
    prompts["f"] = shared + random_ids(3, seed=22)

    def run(batched: bool) -> dict[str, torch.Tensor]:
        driver = PagedDriver(loaded, seed=5)
        for s, p in prompts.items():
            if s != "f":
                driver.add(s, len(p) + 1)
        driver.step([("a", prompts["a"][:5])])
        driver.step([("c", prompts["c"]), ("d", prompts["d"])])
        driver.step([("e", prompts["e"])])
        driver.add("f", len(prompts["f"]), shared_blocks=driver.block_tables["e"][:2], num_computed=8)
        batch = [("c", [7]), ("a", prompts["a"][5:]), ("d", [9]), ("b", prompts["b"]), ("f", prompts["f"][8:]),
                 ("e", [11])]
        if batched:
            return driver.step(batch)
        return {s: driver.step([(s, toks)])[s] for s, toks in batch}

    batched, alone = run(True), run(False)
    for s in alone:
        torch.testing.assert_close(batched[s], alone[s], atol=1e-5, rtol=0, msg=f"sequence {s}")


def test_greedy_matches_generate(tiny_gemma):
    """transformers' generate keeps window - 1 past keys per local layer in its cache; ours masks."""
    ref, loaded = tiny_gemma
    prompt = random_ids(10, seed=40)
    with torch.inference_mode():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                pad_token_id=0)[0, len(prompt):].tolist()
    driver = PagedDriver(loaded, seed=7)
    driver.add("a", len(prompt) + 16)
    tokens, got = prompt, []
    for _ in range(16):
        next_id = int(driver.step([("a", tokens)])["a"][-1].argmax())
        got.append(next_id)
        tokens = [next_id]
    assert got == expected


@pytest.mark.parametrize(("dtype", "quantization", "field"),
                         [(torch.float16, "none", "dtype 'float16'"), (torch.float32, "int4", "quantization 'int4'")])
def test_other_formats_refused(tiny_gemma, tmp_path, dtype, quantization, field):
    """float16 (its products' batch invariance is not established) and int4 without bf16; the formats
    that run are tests/models/test_gemma3_formats.py's."""
    _, loaded = tiny_gemma
    with pytest.raises(ValueError, match=f"{field} is not supported for Gemma3ForCausalLM"):
        load_model(str(loaded.model_dir), dtype=dtype, quantization=quantization, load_tokenizer=False)


def test_metadata_without_window_refused(tiny_gemma):
    from prefixcache.layers.attention.metadata import build_attention_metadata

    _, loaded = tiny_gemma
    driver = PagedDriver(loaded)
    driver.add("a", 4)
    md, positions = build_attention_metadata([(0, 4, driver.block_tables["a"])], 4, "cpu")
    with pytest.raises(RuntimeError, match="sliding_window"), torch.inference_mode():
        loaded.model(torch.tensor([5, 6, 7, 8]), positions, md, driver.kv_caches)
