"""The int8 (W8A8) model path on tiny random checkpoints: close to fp32, exact where it must be."""

import pytest
import torch
from model_testlib import PagedDriver, chunked_then_decoded

from prefixcache.models.loader import load_model


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(loaded, ids):
    driver = PagedDriver(loaded)
    driver.add("a", len(ids))
    return driver.step([("a", ids)])["a"]


@pytest.fixture()
def tiny_pair(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), load_tokenizer=False), load_model(
        str(tiny_llama_dir), load_tokenizer=False, quantization="int8")


def test_int8_is_close_to_fp32(tiny_pair):
    fp32, int8 = tiny_pair
    ids = random_ids(40, seed=1)
    ref, got = prefill(fp32, ids), prefill(int8, ids)
    assert int8.quantization == "int8" and fp32.quantization == "none"
    assert ((got - ref).norm() / ref.norm()) < 0.05
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_back_to_none_is_the_float_model_exactly(tiny_pair):
    fp32, int8 = tiny_pair
    ids = random_ids(12, seed=2)
    int8.model.quantize("none")
    assert torch.equal(prefill(int8, ids), prefill(fp32, ids))
    with pytest.raises(ValueError, match="quantization must be one of"):
        int8.model.quantize("int3")
    with pytest.raises(ValueError, match="'int4' needs a bfloat16 model"):
        int8.model.quantize("int4")


def test_int8_chunked_prefill_and_decode_equal_one_prefill(tiny_pair):
    _, int8 = tiny_pair
    ids = random_ids(19, seed=3)
    expected = prefill(int8, ids)
    got, _ = chunked_then_decoded(int8, ids)
    assert torch.equal(got, expected)  # bit for bit: exact int8 sums, padded attention


def test_int8_mixed_batch_is_bitwise_each_alone(tiny_pair):
    _, int8 = tiny_pair
    prompts = {s: random_ids(n, seed=10 + i) for i, (s, n) in enumerate({"a": 14, "b": 9, "c": 40}.items())}

    def run(batched: bool) -> dict:
        driver = PagedDriver(int8, seed=5)
        for s, p in prompts.items():
            driver.add(s, len(p) + 1)
        driver.step([("a", prompts["a"][:5])])
        driver.step([("c", prompts["c"])])
        batch = [("c", [7]), ("a", prompts["a"][5:]), ("b", prompts["b"])]
        if batched:
            return driver.step(batch)
        return {s: driver.step([(s, toks)])[s] for s, toks in batch}

    batched, alone = run(True), run(False)
    for s in alone:
        assert torch.equal(batched[s], alone[s]), s


def test_replace_weights_requantizes(tiny_pair):
    _, int8 = tiny_pair
    name = "model.layers.0.mlp.down_proj.weight"
    before = int8.model.model.layers[0].mlp.down_proj.int8.qweight.clone()
    new = torch.full_like(dict(int8.model.named_parameters())[name], 0.5)
    int8.replace_weights({name: new})
    after = int8.model.model.layers[0].mlp.down_proj.int8
    assert not torch.equal(after.qweight, before)
    assert after.qweight.unique().tolist() == [127] and torch.allclose(after.scale, torch.tensor(0.5 / 127))


def test_int4_is_refused_without_oneDNNs_prepacked_linear(tiny_llama_dir, monkeypatch):
    """Its row split runs in the fused q|k|v and gate|up products, which exist only prepacked: without
    them a bf16 model must not silently run some projections of generated tokens in bf16."""
    import prefixcache.models.llama as llama
    from prefixcache.layers.cpu_kernels import CpuKernelsUnavailable

    bf16 = load_model(str(tiny_llama_dir), load_tokenizer=False, dtype=torch.bfloat16)
    monkeypatch.setattr(llama, "prepacked_linear_supported", lambda: False)
    with pytest.raises(CpuKernelsUnavailable, match="prepacked bf16 linear"):
        bf16.model.quantize("int4")
