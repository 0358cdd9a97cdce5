"""LoRA adapters: our forward with an adapter == transformers + peft on the same adapter."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from model_testlib import make_tiny_checkpoint

from prefixcache.layers.attention import build_attention_metadata
from prefixcache.layers.lora import LoRABatch, load_lora_adapter
from prefixcache.models.loader import load_model
from prefixcache.runner.kv_pool import allocate_kv_caches

peft = pytest.importorskip("peft")

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(hf_model, out_dir, seed, targets=ALL_TARGETS, r=4, alpha=8, **extra):
    """Random (non-zero B) PEFT adapter saved to out_dir; returns the peft model."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **extra)
    model = peft.get_peft_model(copy.deepcopy(hf_model), cfg).eval()
    model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    base_dir = tmp_path_factory.mktemp(f"lora-{request.param}")
    hf = make_tiny_checkpoint(base_dir, request.param)
    ours = load_model(str(base_dir), load_tokenizer=False)
    adapters = {}
    for name, seed, kwargs in [("x", 1, {}), ("y", 2, {"targets": ["q_proj", "v_proj"], "r": 2, "use_rslora": True})]:
        adir = tmp_path_factory.mktemp(f"adapter-{name}")
        adapters[name] = (make_adapter(hf, adir, seed, **kwargs), adir)
    return hf, ours, adapters


def run_ours(loaded, batch):
    """One forward of several fresh sequences [(token_ids, adapter or None)] → logits per sequence."""
    block_size = 4
    blocks = iter(range(64))
    seqs = []
    for ids, _ in batch:
        seqs.append((0, len(ids), [next(blocks) for _ in range(-(-len(ids) // block_size))]))
    cfg = loaded.config
    kv = allocate_kv_caches(cfg.num_hidden_layers, 64, block_size, cfg.num_key_value_heads, cfg.head_dim,
                            torch.float32, "cpu")
    md, positions = build_attention_metadata(seqs, block_size, "cpu")
    segments, start = [], 0
    for ids, adapter in batch:
        if adapter is not None:
            segments.append((start, start + len(ids), adapter))
        start += len(ids)
    input_ids = torch.tensor([t for ids, _ in batch for t in ids])
    with torch.inference_mode():
        h = loaded.model(input_ids, positions, md, kv, LoRABatch(segments) if segments else None)
        logits = loaded.model.compute_logits(h)
    out, start = [], 0
    for ids, _ in batch:
        out.append(logits[start : start + len(ids)])
        start += len(ids)
    return out


def ref_logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def test_adapter_logits_match_peft_in_a_mixed_batch(setup):
    hf, ours, adapters = setup
    (px, dx), (py, dy) = adapters["x"], adapters["y"]
    ax = load_lora_adapter(dx, ours.model, "x")
    ay = load_lora_adapter(dy, ours.model, "y")
    assert (ax.rank, ax.scaling, len(ax.weights)) == (4, 2.0, 7 * 2)
    assert (ay.rank, ay.scaling, len(ay.weights)) == (2, 8 / 2**0.5, 2 * 2)
    p1, p2, p3 = [5, 9, 17, 33, 2, 8, 100], [7, 7, 3, 200, 45], [11, 12, 13, 14, 15, 16]
    got = run_ours(ours, [(p1, ax), (p2, None), (p3, ay)])
    torch.testing.assert_close(got[0], ref_logits(px, p1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], ref_logits(hf, p2), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[2], ref_logits(py, p3), atol=1e-4, rtol=1e-4)
    # The adapter really changes the output (else the test above could not fail).
    assert not torch.allclose(ref_logits(px, p1), ref_logits(hf, p1), atol=1e-3)


def test_adapter_digest_is_content_not_name_or_path(setup, tmp_path):
    _, ours, adapters = setup
    dx, dy = adapters["x"][1], adapters["y"][1]
    copy_dir = tmp_path / "copy"
    shutil.copytree(dx, copy_dir)
    assert load_lora_adapter(copy_dir, ours.model, "other").digest == load_lora_adapter(dx, ours.model, "x").digest
    assert load_lora_adapter(dy, ours.model, "x").digest != load_lora_adapter(dx, ours.model, "x").digest


def test_bad_adapters_raise_value_error(setup, tmp_path):
    _, ours, adapters = setup
    with pytest.raises(ValueError, match="adapter_config.json"):
        load_lora_adapter(tmp_path, ours.model)
    bad = tmp_path / "dora"
    shutil.copytree(adapters["x"][1], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        load_lora_adapter(bad, ours.model)
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "r": 3}))
    with pytest.raises(ValueError, match="lora_A"):
        load_lora_adapter(bad, ours.model)
