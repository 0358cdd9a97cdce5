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
    with pytest.raises(ValueError, match="'int4-int8' needs a bfloat16 model"):
        int8.model.quantize("int4-int8")


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
    before = int8.model.model.layers[0].mlp.down.weight.qweight.clone()
    new = torch.full_like(dict(int8.model.named_parameters())[name], 0.5)
    int8.model.int8_smoothing = False  # the plain per-channel rule: every weight the row's max
    int8.replace_weights({name: new})
    after = int8.model.model.layers[0].mlp.down.weight
    assert not torch.equal(after.qweight, before) and after.act_mul is None
    assert after.qweight.unique().tolist() == [127] and torch.allclose(after.scale, torch.tensor(0.5 / 127))
    int8.model.int8_smoothing = True
    int8.replace_weights({name: new})  # smoothed: q * scale / s gives the new weight back within half a step
    after = int8.model.model.layers[0].mlp.down.weight
    restored = after.qweight.t().float() * after.scale[:, None] * after.act_mul[None, :]
    assert after.act_mul.unique().numel() > 1
    half_step = 0.5 * after.scale[:, None] * after.act_mul[None, :]  # [out, in]: the step is per row of W * s
    assert ((restored - new.float()).abs() <= half_step * (1 + 1e-5)).all()


def test_int8_smoothing_calibrates_every_int8_matrix_deterministically(tiny_llama_dir):
    """Each int8 matrix (q|k|v, o, gate|up, down, lm_head) gets SmoothQuant's multipliers from a
    calibration prefill (no tokenizer here: CALIBRATION_LENGTH fixed pseudo-random ids); two loads give
    the same bits and the same quantization_key, which names the rule and the calibration tokens; with
    smoothing off there is neither."""
    from prefixcache.models.llama import CALIBRATION_LENGTH

    a, b = (load_model(str(tiny_llama_dir), load_tokenizer=False, quantization="int8") for _ in range(2))

    def matrices(loaded):
        return loaded.model._int8_weights()  # q|k|v, o, gate|up, down per layer, then lm_head

    assert all(m.act_mul is not None and m.act_mul.shape == (m.qweight.shape[0],) for m in matrices(a))
    for ma, mb in zip(matrices(a), matrices(b)):
        assert torch.equal(ma.qweight, mb.qweight) and torch.equal(ma.act_mul, mb.act_mul)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.config.vocab_size, (CALIBRATION_LENGTH,), generator=gen)
    import hashlib

    digest = hashlib.sha256(ids.numpy().tobytes())  # the calibration tokens, then every multiplier
    for m in matrices(a):
        digest.update(m.act_mul.numpy().tobytes())
    key = f"int8-smooth:sq-alpha=0.5-median-floor:{digest.hexdigest()[:32]}"
    assert a.model.quantization_key == b.model.quantization_key == key
    a.model.int8_smoothing = False
    a.model.quantize("int8")
    assert all(m.act_mul is None for m in matrices(a)) and a.model.quantization_key == ""


class _all_inf_amax:
    """A recording_activation_amax whose maxima of every input as wide as ``weight``'s (in the tiny
    model: the down_proj inputs only) start with an infinity."""

    def __init__(self, weight, recording) -> None:
        self.inner, self.shape = recording(), weight.qweight.shape[0]

    def __enter__(self):
        self.amax = self.inner.__enter__()
        return self.amax

    def __exit__(self, *exc):
        for key, value in self.amax.items():
            if value.shape[0] == self.shape:  # the down_proj inputs (the only width-`shape` matrices)
                value[0] = float("inf")
        return self.inner.__exit__(*exc)


def test_int8_calibration_skips_ids_the_model_lacks_and_non_finite_maxima(tiny_llama_dir, monkeypatch):
    """Review (2026-12-03): a tokenizer with more ids than the model's vocabulary made the int8 load fail
    with a bare IndexError; an input that overflowed in calibration made every multiplier of its matrix
    0 or NaN (every later token 0, logprob NaN). Ids out of the vocabulary are left out of the
    calibration (none left: the fixed pseudo-random ids); a matrix with a non-finite maximum stays
    unsmoothed; and a failed calibration leaves the plain rule under the plain key."""
    import prefixcache.layers.quant as quant
    from prefixcache.models.llama import CALIBRATION_LENGTH

    loaded = load_model(str(tiny_llama_dir), load_tokenizer=False, quantization="int8")
    vocab = loaded.config.vocab_size
    random_key = loaded.model.quantization_key
    loaded.model.calibration_ids = [vocab, vocab + 7, -1]  # nothing usable: the pseudo-random ids' key
    loaded.model.quantize("int8")
    assert loaded.model.quantization_key == random_key and CALIBRATION_LENGTH <= loaded.config.max_position_embeddings
    loaded.model.calibration_ids = [5, vocab + 1, 9, 11]
    loaded.model.quantize("int8")
    key = loaded.model.quantization_key
    loaded.model.calibration_ids = [5, 9, 11]
    loaded.model.quantize("int8")
    assert loaded.model.quantization_key == key != random_key  # the same three ids calibrated
    layers = loaded.model.model.layers
    down = layers[0].mlp.down.weight
    import prefixcache.models.llama as llama

    recording = quant.recording_activation_amax
    monkeypatch.setattr(llama, "recording_activation_amax", lambda: _all_inf_amax(down, recording))
    loaded.model.quantize("int8")  # a maximum that is not finite after all: that matrix stays unsmoothed
    assert all(layer.mlp.down.weight.act_mul is None and layer.mlp.gate_up.weight.act_mul is not None
               for layer in layers)

    def failing(*a, **k):
        raise RuntimeError("calibration failed")

    monkeypatch.setattr(loaded.model, "_dense_logits", failing)
    with pytest.raises(RuntimeError, match="calibration failed"):
        loaded.model.quantize("int8")
    assert loaded.model.quantization_key == "" and layers[0].self_attn.qkv.weight.act_mul is None


@pytest.mark.requires_isa("avx2")  # int4's C++ decoder (its AVX2 or AVX-512 build)
def test_int4_runs_without_oneDNNs_prepacked_linear(tiny_llama_dir, monkeypatch):
    """Generated rows run the C++ decoder whatever torch offers; prompt rows fall back to the plain
    row-tiled products (before 2026-12-01 int4 was refused here: its row split lived in the fused
    prepacked products)."""
    import prefixcache.layers.linear as linear

    bf16 = load_model(str(tiny_llama_dir), load_tokenizer=False, dtype=torch.bfloat16)
    monkeypatch.setattr(linear, "prepacked_linear_supported", lambda: False)
    bf16.model.quantize("int4")
    assert bf16.model.model.decode_layers is not None
    assert bf16.model.model.layers[0].self_attn.qkv.weight is None and bf16.model.head.weight is None


@pytest.mark.requires_isa("avx2")  # int4's C++ decoder (its AVX2 or AVX-512 build)
def test_int4_refuses_a_shape_its_decoder_cannot_run(tmp_path):
    """A model whose heads the paged kernel can't serve (head_dim 8) is refused at quantize, with the
    reason, not at its first generated token."""
    from model_testlib import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path, "llama", num_attention_heads=8, num_key_value_heads=2)  # head_dim 64 / 8 = 8
    with pytest.raises(RuntimeError, match="head_dim a multiple of 16"):
        load_model(str(tmp_path), load_tokenizer=False, dtype=torch.bfloat16, quantization="int4")
