"""Everything that changes K/V is in the cache key: weights, tokenizer, chat template (case C2)."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from prefixcache import LLM, SamplingParams
from prefixcache.models.loader import load_model

pytestmark = pytest.mark.slow  # private copies of the default model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LAYER = "model.layers.3.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def own_model():
    """A private copy of the default model: these tests change its weights in place."""
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def pristine_model():
    """The default model as loaded, its weights never replaced (so its key is the files' own)."""
    return load_model("smollm2-135m")


def test_c2_new_weights_never_reuse_old_kv(own_model):
    rng = random.Random(2)
    p = [rng.randrange(200, 40000) for _ in range(2 * 16 + 7)]
    llm = LLM(loaded=own_model, num_threads=2, num_blocks=64, enable_partial_block_reuse=False)
    before = llm.generate(p, GREEDY, use_tqdm=False)[0]
    assert llm.generate(p, GREEDY, use_tqdm=False)[0].num_cached_tokens == 32
    old_key = llm.engine.root_key()

    original = dict(own_model.model.named_parameters())[LAYER].detach().clone()
    llm.load_weights({LAYER: original * 1.5})
    assert llm.engine.root_key() != old_key
    assert llm.get_metrics().num_blocks_cached == 0  # old entries dropped at once, not aged out
    after = llm.generate(p, GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0
    cold = LLM(loaded=own_model, num_threads=2, num_blocks=64, enable_prefix_caching=False)
    assert after.token_ids == cold.generate(p, GREEDY, use_tqdm=False)[0].token_ids
    assert llm.generate(p, GREEDY, use_tqdm=False)[0].num_cached_tokens == 32  # new weights cache anew

    # Loading a checkpoint directory (the original weights) also invalidates, and restores the outputs.
    llm.load_weights(own_model.model_dir)
    restored = llm.generate(p, GREEDY, use_tqdm=False)[0]
    assert restored.num_cached_tokens == 0 and restored.token_ids == before.token_ids


def test_load_weights_publishes_the_dropped_blocks_at_once(own_model):
    """Found by a review (2026-12-02): the blocks load_weights drops reached KV-event subscribers
    only at the next step or metrics read; a router kept routing to a cache that was gone."""
    pytest.importorskip("zmq")
    from tests.cache.kv_events_test_utils import Follower, engine_hashes

    config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
              "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"}
    llm = LLM(loaded=own_model, num_threads=2, num_blocks=32, kv_events_config=json.dumps(config))
    follower = Follower(llm.engine.kv_event_publisher, "kv")
    original = dict(own_model.model.named_parameters())[LAYER].detach().clone()
    try:
        follower.join_live()
        llm.generate(list(range(300, 340)), GREEDY, use_tqdm=False)
        follower.catch_up()
        assert len(follower.view.hashes) == 3 == len(engine_hashes(llm.engine.kv_cache_manager.block_pool))
        llm.load_weights({LAYER: original * 1.5})
        follower.catch_up()
        assert follower.view.hashes == set() == engine_hashes(llm.engine.kv_cache_manager.block_pool)
    finally:
        llm.load_weights({LAYER: original})
        follower.close()
        llm.engine.close()


def test_load_weights_refused_while_requests_run(own_model):
    llm = LLM(loaded=own_model, num_threads=2, num_blocks=64)
    rid = llm.engine.add_request("Hello there", GREEDY)
    with pytest.raises(ValueError, match="in flight"):
        llm.load_weights({})
    llm.engine.abort_request(rid)
    with pytest.raises(ValueError, match="unknown parameter"):
        llm.load_weights({"no.such.weight": next(own_model.model.parameters()).detach()})


def test_load_weights_refuses_bad_values_before_copying_anything(own_model):
    """Found by a review (2026-12-02): a mapping whose second value was a numpy array (or a meta
    tensor) raised only after the first tensor was copied, leaving zeroed embeddings behind."""
    llm = LLM(loaded=own_model, num_threads=2, num_blocks=32)
    params = dict(own_model.model.named_parameters())
    before_tokens = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].token_ids
    before = {n: p.detach().clone() for n, p in params.items()}
    norm = "model.layers.0.input_layernorm.weight"
    good = {"model.embed_tokens.weight": torch.zeros_like(before["model.embed_tokens.weight"])}
    nan = before[norm].clone()
    nan[3] = float("nan")
    cases = [(before[norm].numpy().copy(), "must be a floating-point torch.Tensor, got ndarray"),
             ([1.0, 2.0], "must be a floating-point torch.Tensor, got list"),
             (torch.empty(before[norm].shape, device="meta"), "got a meta tensor \\(no data\\)"),
             (torch.ones(before[norm].shape, dtype=torch.int64), "got a torch.int64 tensor"),
             (nan, "holds NaN or infinite values")]
    for value, message in cases:
        with pytest.raises(ValueError, match=f"load_weights: '{norm}' .*{message}"):
            llm.load_weights({**good, norm: value})
    assert all(torch.equal(p, before[n]) for n, p in params.items())  # nothing copied
    assert llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].token_ids == before_tokens


@pytest.mark.parametrize("change", ["chat_template", "tokenizer"])
def test_c2_changed_template_or_tokenizer_changes_the_key(pristine_model, tmp_path, change):
    src = pristine_model.model_dir
    dst = tmp_path / "model"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    if change == "chat_template":
        template = dst / "chat_template.jinja"
        template.write_text(template.read_text().replace("You are a helpful AI assistant", "You are an AI"))
    else:
        cfg = json.loads((dst / "tokenizer_config.json").read_text())
        cfg["clean_up_tokenization_spaces"] = not cfg.get("clean_up_tokenization_spaces", False)
        (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    other = load_model(str(dst))
    a = LLM(loaded=pristine_model, num_threads=2, num_blocks=8, hash_seed=1)
    b = LLM(loaded=other, num_threads=2, num_blocks=8, hash_seed=1)
    assert a.engine.root_key() != b.engine.root_key()
    # Sanity: an identical copy gives the identical key.
    same = LLM(loaded=load_model(str(src)), num_threads=2, num_blocks=8, hash_seed=1)
    assert same.engine.root_key() == a.engine.root_key()


def test_weights_reloaded_from_files_with_the_same_sampled_fingerprint_get_a_new_key(own_model, tmp_path):
    """The files' fingerprint samples each safetensors file's ends only; loading a checkpoint that
    differs in a middle tensor must still re-key (the key is chained to the previous one), and a
    load that fails half-way re-keys too."""
    import torch
    from safetensors.torch import load_file, save_file

    src = own_model.model_dir
    same_files, partial = tmp_path / "same", tmp_path / "partial"
    for d in (same_files, partial):
        d.mkdir()
        for f in src.iterdir():
            if f.is_file() and (d is same_files or f.suffix != ".safetensors"):
                (d / f.name).symlink_to(f)
    llm = LLM(loaded=own_model, num_threads=2, num_blocks=16)
    key = llm.engine.root_key()
    llm.load_weights(same_files)  # the same files: same sampled fingerprint, still a new key
    assert llm.engine.root_key() != key
    key = llm.engine.root_key()
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(f))
    tensors.pop("model.norm.weight")  # a checkpoint that lacks a tensor: refused half-way
    save_file(tensors, partial / "model.safetensors")
    with pytest.raises(ValueError, match="lacks"):
        llm.load_weights(partial)
    assert llm.engine.root_key() != key and llm.get_metrics().num_blocks_cached == 0
    llm.load_weights(src)  # back to the original weights
    assert torch.equal(dict(own_model.model.named_parameters())["model.layers.0.mlp.up_proj.weight"],
                       tensors["model.layers.0.mlp.up_proj.weight"].to(torch.float32))
