"""LoRA adapters: our forward with an adapter == transformers + peft on the same adapter."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from model_testlib import bad_copy, make_tiny_checkpoint, poisoned

from prefixcache.layers.attention.metadata import build_attention_metadata
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


# ---------------------------------------------------------------------------- malformed adapters
CONFIG_CASES = [  # (adapter_config.json text, message fragment)
    ("null", "adapter_config.json must hold a JSON object, got NoneType None"),
    ("[1, 2]", "adapter_config.json must hold a JSON object, got list [1, 2]"),
    ('"LORA"', "adapter_config.json must hold a JSON object, got str"),
    ('{"peft_type": "LORA", "lora_alpha": 8}', "adapter_config.json has no 'r' (the LoRA rank)"),
    ('{"r": 0}', "'r' (the LoRA rank) must be a positive integer, got 0"),
    ('{"r": 0, "use_rslora": true}', "'r' (the LoRA rank) must be a positive integer, got 0"),
    ('{"r": -4}', "'r' (the LoRA rank) must be a positive integer, got -4"),
    ('{"r": null}', "'r' (the LoRA rank) must be a positive integer, got None"),
    ('{"r": true}', "'r' (the LoRA rank) must be a positive integer, got True"),
    ('{"r": 4.0}', "'r' (the LoRA rank) must be a positive integer, got 4.0"),
    ('{"r": "4"}', "'r' (the LoRA rank) must be a positive integer, got '4'"),
    ('{"r": 4, "lora_alpha": "nan"}', "'lora_alpha' must be a finite number, got 'nan'"),
    ('{"r": 4, "lora_alpha": NaN}', "'lora_alpha' must be a finite number, got nan"),
    ('{"r": 4, "lora_alpha": Infinity}', "'lora_alpha' must be a finite number, got inf"),
    ('{"r": 4, "lora_alpha": -1e999}', "'lora_alpha' must be a finite number, got -inf"),
    ('{"r": 4, "lora_alpha": 1' + "0" * 400 + "}", "'lora_alpha' must be a finite number, got 1000"),
    ('{"r": 4, "lora_alpha": null}', "'lora_alpha' must be a finite number, got None"),
    ('{"r": 4, "lora_alpha": false}', "'lora_alpha' must be a finite number, got False"),
    ('{"r": 4, "use_rslora": "false"}', "'use_rslora' must be true or false, got 'false'"),
    ('{"r": 4, "peft_type": null}', "'peft_type' must be a string, got None"),
    ('{"r": 4, "peft_type": "PREFIX_TUNING"}', "is a PREFIX_TUNING adapter, only LORA is supported"),
    ('{"r": 4, "lora_bias": true}', "adapter option 'lora_bias' is not supported"),
    ("{not json", "adapter_config.json is not valid JSON"),
    ("[" * 100_000, "adapter_config.json is not valid JSON"),
    (b"\xff\xfe\xff".decode("latin-1"), "adapter_config.json is not valid JSON"),
]


@pytest.mark.parametrize("config,fragment", CONFIG_CASES, ids=[f"config{i}" for i in range(len(CONFIG_CASES))])
def test_malformed_config_is_invalid_input(setup, tmp_path, config, fragment):
    from prefixcache.errors import InvalidInputError

    _, ours, adapters = setup
    bad = bad_copy(adapters["x"][1], tmp_path / "bad", config=config)
    with pytest.raises(InvalidInputError, match=r"^lora: adapter 'x' at .*/bad") as e:
        load_lora_adapter(bad, ours.model, "x")
    assert e.value.field == "lora" and fragment in str(e.value), str(e.value)


WEIGHTS_CASES = [  # (bad_copy keywords, message fragment)
    ({"weights_bytes": b"garbage bytes, not a safetensors file"},
     "adapter_model.safetensors is not a readable safetensors file"),
    ({"weights_bytes": b""}, "adapter_model.safetensors is not a readable safetensors file"),
    ({"weights_bytes": b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}       "},
     "adapter_model.safetensors is not a readable safetensors file"),
    ({"tensors": poisoned(float("nan"))}, "holds non-finite values (NaN or inf)"),
    ({"tensors": poisoned(float("inf"), "lora_A")}, "holds non-finite values (NaN or inf)"),
    ({"tensors": poisoned(float("-inf"))}, "holds non-finite values (NaN or inf)"),
    ({"tensors": lambda t: {k: v.to(torch.int32) for k, v in t.items()}}, "must be floating point, got torch.int32"),
    ({"tensors": lambda t: {}}, "adapter_model.safetensors holds no LoRA tensors"),
    ({"tensors": lambda t: {**t, "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
                            torch.ones(4)}}, "unexpected tensor"),
    ({"tensors": lambda t: {**t, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight":
                            torch.ones(4, 4)}}, "are the same LoRA matrix"),
]


@pytest.mark.parametrize("kwargs,fragment", WEIGHTS_CASES, ids=[f"weights{i}" for i in range(len(WEIGHTS_CASES))])
def test_malformed_weights_are_invalid_input(setup, tmp_path, kwargs, fragment):
    from prefixcache.errors import InvalidInputError

    _, ours, adapters = setup
    bad = bad_copy(adapters["x"][1], tmp_path / "bad", **kwargs)
    with pytest.raises(InvalidInputError, match=r"^lora: adapter 'x' at .*/bad") as e:
        load_lora_adapter(bad, ours.model, "x")
    assert e.value.field == "lora" and fragment in str(e.value), str(e.value)


def test_weights_beyond_the_model_dtype_are_invalid_input(tmp_path):
    """A finite fp32 adapter value that a float16 model can't hold (inf once converted) is refused."""
    from safetensors.torch import save_file

    from prefixcache.errors import InvalidInputError

    model = torch.nn.Module()
    model.q_proj = torch.nn.Linear(8, 8, dtype=torch.float16)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
    a = torch.zeros(2, 8)
    a[0, 0] = 1e6  # float16's largest is 65504
    save_file({"base_model.model.q_proj.lora_A.weight": a, "base_model.model.q_proj.lora_B.weight": torch.zeros(8, 2)},
              tmp_path / "adapter_model.safetensors")
    with pytest.raises(InvalidInputError, match="beyond the range of the model's dtype torch.float16") as e:
        load_lora_adapter(tmp_path, model, "x")
    assert e.value.field == "lora"
    a[0, 0] = 1.0
    save_file({"base_model.model.q_proj.lora_A.weight": a, "base_model.model.q_proj.lora_B.weight": torch.zeros(8, 2)},
              tmp_path / "adapter_model.safetensors")
    assert load_lora_adapter(tmp_path, model, "x").weights["q_proj"][0].dtype == torch.float16


@pytest.mark.parametrize("path", [None, 3, b"/tmp", "", "a\0b"])
def test_lora_request_path_must_be_a_path(path):
    from prefixcache import LoRARequest
    from prefixcache.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="lora: adapter 'x': lora_path must be a non-empty directory path") as e:
        LoRARequest("x", path)
    assert e.value.field == "lora"
    with pytest.raises(InvalidInputError, match="lora: lora_name must be a str, got NoneType"):
        LoRARequest(None, "/tmp")


def test_lora_request_accepts_path_objects(setup):
    from pathlib import Path

    from prefixcache import LoRARequest

    _, _, adapters = setup
    assert LoRARequest("x", Path(adapters["x"][1])).lora_path == Path(adapters["x"][1])


def test_valid_adapter_loads_the_same_after_malformed_ones(setup, tmp_path):
    """Refusing malformed adapters leaves nothing behind: the good adapter's weights, scaling and
    digest are those it had before."""
    _, ours, adapters = setup
    before = load_lora_adapter(adapters["x"][1], ours.model, "x")
    for i, (config, _) in enumerate(CONFIG_CASES[:6]):
        with pytest.raises(ValueError):
            load_lora_adapter(bad_copy(adapters["x"][1], tmp_path / f"bad{i}", config=config), ours.model, "x")
    after = load_lora_adapter(adapters["x"][1], ours.model, "x")
    assert (after.digest, after.rank, after.scaling) == (before.digest, before.rank, before.scaling)
    assert all(torch.equal(after.weights[k][0], before.weights[k][0]) and torch.equal(after.weights[k][1],
               before.weights[k][1]) for k in before.weights)
