"""Our paged model against transformers' own classes on tiny random checkpoints (fp32)."""

import pytest
import torch
from model_testlib import PagedDriver, chunked_then_decoded, make_tiny_checkpoint

from prefixcache.layers.rotary import compute_inv_freq
from prefixcache.models.loader import load_model

ATOL = 1e-4


def reference_logits(ref: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return ref(torch.tensor([ids])).logits[0].float()  # [len(ids), vocab]


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_alone(loaded, ids: list[int]) -> torch.Tensor:
    driver = PagedDriver(loaded)
    driver.add("a", len(ids))
    return driver.step([("a", ids)])["a"]


def test_prefill_matches_transformers(tiny):
    ref, loaded = tiny
    ids = random_ids(23, seed=1)
    logits = prefill_alone(loaded, ids)
    torch.testing.assert_close(logits, reference_logits(ref, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_matches_transformers(tiny):
    ref, loaded = tiny
    ids = random_ids(19, seed=2)
    expected = reference_logits(ref, ids)
    got, block_table = chunked_then_decoded(loaded, ids)
    assert block_table != sorted(block_table)  # non-contiguous, shuffled
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_mixed_batch_equals_each_alone(tiny):
    """Prefill chunks (with and without a cached prefix) and decodes of different lengths in one forward."""
    _, loaded = tiny
    prompts = {s: random_ids(n, seed=10 + i) for i, (s, n) in enumerate({"a": 14, "b": 9, "c": 7, "d": 12}.items())}
    shared = random_ids(8, seed=20)
    prompts["e"] = shared + random_ids(5, seed=21)  # shares 2 full blocks with "f"
    prompts["f"] = shared + random_ids(3, seed=22)

    def run(batched: bool) -> dict[str, torch.Tensor]:
        driver = PagedDriver(loaded, seed=5)
        for s, p in prompts.items():
            if s != "f":
                driver.add(s, len(p) + 1)
        # Earlier steps: a's first chunk, c and d's prompts, e's prompt.
        driver.step([("a", prompts["a"][:5])])
        driver.step([("c", prompts["c"]), ("d", prompts["d"])])
        driver.step([("e", prompts["e"])])
        # f reuses e's first two cached blocks.
        driver.add("f", len(prompts["f"]), shared_blocks=driver.block_tables["e"][:2], num_computed=8)
        batch = [
            ("c", [7]),  # decode
            ("a", prompts["a"][5:]),  # prefill chunk after a cached prefix
            ("d", [9]),  # decode, longer context
            ("b", prompts["b"]),  # full prefill
            ("f", prompts["f"][8:]),  # prefill on shared cached blocks
            ("e", [11]),  # decode on the shared blocks
        ]
        if batched:
            return driver.step(batch)
        return {s: driver.step([(s, toks)])[s] for s, toks in batch}

    batched, alone = run(True), run(False)
    for s in alone:
        torch.testing.assert_close(batched[s], alone[s], atol=1e-5, rtol=0, msg=f"sequence {s}")


def test_reads_blocks_written_in_the_same_step(tiny):
    """b claims as computed a block that a writes in this very step: K/V must be written before attention."""
    ref, loaded = tiny
    ids = random_ids(8, seed=30)
    driver = PagedDriver(loaded, seed=6)
    driver.add("a", 8)
    driver.add("b", 8, shared_blocks=driver.block_tables["a"][:1], num_computed=4)
    out = driver.step([("b", ids[4:]), ("a", ids)])
    expected = reference_logits(ref, ids)
    torch.testing.assert_close(out["a"], expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(out["b"], expected[4:], atol=ATOL, rtol=0)


def test_greedy_matches_generate(tiny):
    ref, loaded = tiny
    prompt = random_ids(10, seed=40)
    with torch.inference_mode():
        expected = ref.generate(
            torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    driver = PagedDriver(loaded, seed=7)
    driver.add("a", len(prompt) + 16)
    tokens = prompt
    got = []
    for _ in range(16):
        next_id = int(driver.step([("a", tokens)])["a"][-1].argmax())
        got.append(next_id)
        tokens = [next_id]
    assert got == expected


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        {
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
    ids=["linear", "llama3"],
)
def test_rope_scaling_matches_transformers(tmp_path, rope_parameters):
    ref = make_tiny_checkpoint(tmp_path, "llama", rope_parameters=dict(rope_parameters), num_hidden_layers=1)
    loaded = load_model(str(tmp_path), load_tokenizer=False)
    assert loaded.config.rope_scaling["rope_type"] == rope_parameters["rope_type"]
    torch.testing.assert_close(
        compute_inv_freq(loaded.config.head_dim, loaded.config.rope_theta, loaded.config.rope_scaling),
        ref.model.rotary_emb.inv_freq,
        atol=0,
        rtol=0,
    )
    ids = random_ids(150, seed=50)
    logits = prefill_alone(loaded, ids)
    torch.testing.assert_close(logits, reference_logits(ref, ids), atol=ATOL, rtol=0)


def test_bfloat16_close_to_transformers_bfloat16(tiny_llama_dir):
    ref = load_model(str(tiny_llama_dir), load_tokenizer=False)
    loaded = load_model(str(tiny_llama_dir), dtype=torch.bfloat16, load_tokenizer=False)
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    ids = random_ids(20, seed=60)
    bf16 = prefill_alone(loaded, ids)
    fp32 = prefill_alone(ref, ids)
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16, fp32, atol=0.1, rtol=0.05)
