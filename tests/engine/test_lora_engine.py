"""LoRA through the engine on SmolLM2: golden vs peft, mixed batches, adapters keyed by content (C9)."""

from __future__ import annotations

import copy
import random
import shutil

import pytest
import torch

from prefixcache import LoRARequest, SamplingParams
from tests.models.model_testlib import bad_copy, poisoned

peft = pytest.importorskip("peft")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(smollm2, tmp_path_factory):
    """Two random adapters X and Y for SmolLM2, and the transformers+peft models that define them."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2.model_dir, dtype=torch.float32).eval()
    out = {}
    for name, seed in (("x", 1), ("y", 2)):
        torch.manual_seed(seed)
        cfg = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                              target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
        model = peft.get_peft_model(copy.deepcopy(hf), cfg).eval()
        with torch.no_grad():  # PEFT's random init is tiny on this model; make the adapter matter
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.mul_(20)
        path = tmp_path_factory.mktemp(f"smol-adapter-{name}")
        model.save_pretrained(path)
        out[name] = (model, path)
    return hf, out


def prompt_ids(seed, n=37):
    rng = random.Random(seed)
    return [rng.randrange(200, 40000) for _ in range(n)]


def test_adapter_greedy_matches_peft_generate(make_llm, adapters):
    _, ad = adapters
    model, path = ad["x"]
    p = prompt_ids(1)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)[0, len(p):]
    llm = make_llm(num_blocks=64)
    out = llm.generate(p, GREEDY, lora=LoRARequest("x", str(path)), use_tqdm=False)[0]
    assert out.token_ids == ref.tolist()
    base = llm.generate(p, GREEDY, use_tqdm=False)[0]
    assert base.token_ids != out.token_ids  # the adapter changes the answer
    assert base.num_cached_tokens == 0  # the base model never hits the adapter's blocks


def test_mixed_batch_equals_each_alone_and_adapters_isolate(make_llm, adapters):
    _, ad = adapters
    rx, ry = LoRARequest("x", str(ad["x"][1])), LoRARequest("y", str(ad["y"][1]))
    p = prompt_ids(2)
    alone = {}
    for key, lora in (("x", rx), ("y", ry), ("base", None)):
        alone[key] = make_llm(num_blocks=64).generate(p, GREEDY, lora=lora, use_tqdm=False)[0].token_ids
    llm = make_llm(num_blocks=64, enable_partial_block_reuse=False)  # exact full-block counts below
    outs = llm.generate([p, p, p], GREEDY, lora=[rx, None, ry], use_tqdm=False)
    assert [o.token_ids for o in outs] == [alone["x"], alone["base"], alone["y"]]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]  # same tokens, three different keys
    again = llm.generate([p, p, p], GREEDY, lora=[rx, None, ry], use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [32, 32, 32]
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_c9_same_name_other_weights_never_hits(make_llm, adapters, tmp_path):
    _, ad = adapters
    live = tmp_path / "a"
    shutil.copytree(ad["x"][1], live)
    lora = LoRARequest("a", str(live))
    p = prompt_ids(3)
    llm = make_llm(num_blocks=64, enable_partial_block_reuse=False)  # exact full-block counts below
    first = llm.generate(p, GREEDY, lora=lora, use_tqdm=False)[0]
    assert llm.generate(p, GREEDY, lora=lora, use_tqdm=False)[0].num_cached_tokens == 32
    # Same name, same path, new weights (the adapter was retrained in place).
    shutil.rmtree(live)
    shutil.copytree(ad["y"][1], live)
    num_old_blocks = llm.get_metrics().num_blocks_cached
    assert num_old_blocks > 0
    second = llm.generate(p, GREEDY, lora=lora, use_tqdm=False)[0]
    assert second.num_cached_tokens == 0
    # The old weights' blocks were evicted at reload, not left to age out.
    assert llm.get_metrics().evictions_by_reason == {"invalidated": num_old_blocks}
    assert first.token_ids == make_llm(num_blocks=64).generate(p, GREEDY, lora=LoRARequest("x", str(ad["x"][1])),
                                                  use_tqdm=False)[0].token_ids
    assert second.token_ids == make_llm(num_blocks=64).generate(p, GREEDY, lora=LoRARequest("y", str(ad["y"][1])),
                                                   use_tqdm=False)[0].token_ids
    # x's content from another directory: its old blocks were evicted at the reload, so a miss,
    # then its own blocks are hit (keyed by content, not by name or path).
    lora_x = LoRARequest("a", str(ad["x"][1]))
    other = llm.generate(p, GREEDY, lora=lora_x, use_tqdm=False)[0]
    assert other.token_ids == first.token_ids and other.num_cached_tokens == 0
    assert llm.generate(p, GREEDY, lora=lora_x, use_tqdm=False)[0].num_cached_tokens == 32


def test_bad_lora_argument(make_llm, tmp_path):
    llm = make_llm(num_blocks=64)
    with pytest.raises(ValueError, match="lora"):
        llm.generate("hi", GREEDY, lora=LoRARequest("nope", str(tmp_path / "missing")), use_tqdm=False)
    with pytest.raises(ValueError, match="lora"):
        llm.generate("hi", GREEDY, lora="not-a-request", use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.requires_format("bfloat16", "none")
def test_bf16_base_request_same_bits_beside_an_adapter(smollm2, adapters):
    """bf16 runs the fused prompt ops of kernels/prompt_ops.py, and a step with LoRA deltas takes torch's
    ops for RoPE and the K/V write: a base request's tokens and logprobs are the same alone and beside
    an adapter's request."""
    from prefixcache.llm import LLM
    from prefixcache.models.loader import load_model

    loaded = load_model("smollm2-135m", dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    p, rx = prompt_ids(3), LoRARequest("x", str(adapters[1]["x"][1]))

    def make():
        return LLM("smollm2-135m", loaded=loaded, dtype="bfloat16", num_threads=2, num_blocks=64)

    alone = make().generate(p, params, use_tqdm=False)[0]
    mixed = make().generate([p, p], params, lora=[rx, None], use_tqdm=False)
    assert mixed[1].token_ids == alone.token_ids and mixed[1].logprobs == alone.logprobs
    assert mixed[0].token_ids != alone.token_ids  # the adapter's request did run its deltas


# ---------------------------------------------------------------------------- malformed adapters
def _malformed_adapters(good, root):
    """(LoRARequest, message fragment) for adapters made malformed from the good dir ``good``."""
    import json

    def copy_with(name, config=None, tensors=None, weights_bytes=None):
        return LoRARequest("x", str(bad_copy(good, root / name, config, tensors, weights_bytes)))

    config = json.loads((good / "adapter_config.json").read_text())
    return [
        (copy_with("null", config="null"), "adapter_config.json must hold a JSON object, got NoneType"),
        (copy_with("list", config="[1,2]"), "adapter_config.json must hold a JSON object, got list [1, 2]"),
        (copy_with("no-r", config='{"peft_type":"LORA","lora_alpha":8}'), "adapter_config.json has no 'r'"),
        (copy_with("r0", config='{"r":0}'), "'r' (the LoRA rank) must be a positive integer, got 0"),
        (copy_with("r0-rs", config='{"r":0,"use_rslora":true}'), "'r' (the LoRA rank) must be a positive integer"),
        (copy_with("r-null", config='{"r":null}'), "'r' (the LoRA rank) must be a positive integer, got None"),
        (copy_with("alpha-nan-str", config=json.dumps({**config, "lora_alpha": "nan"})),
         "'lora_alpha' must be a finite number, got 'nan'"),
        (copy_with("alpha-nan", config=json.dumps({**config, "lora_alpha": float("nan")})),
         "'lora_alpha' must be a finite number, got nan"),
        (copy_with("garbage", weights_bytes=b"\x00garbage\xff" * 10),
         "adapter_model.safetensors is not a readable safetensors file"),
        (copy_with("nan-weights", tensors=poisoned(float("nan"))), "holds non-finite values (NaN or inf)"),
        (copy_with("inf-weights", tensors=poisoned(float("inf"))), "holds non-finite values (NaN or inf)"),
    ]


def test_malformed_adapters_are_invalid_input_and_leave_the_engine_as_it_was(make_llm, adapters, tmp_path):
    """Each malformed adapter is refused by generate with InvalidInputError(field="lora") naming the
    adapter and the fault (never AttributeError, KeyError, ZeroDivisionError, TypeError,
    SafetensorError, nor output of token 0 from NaN deltas); the engine then generates what it did before."""
    from prefixcache.errors import InvalidInputError

    _, ad = adapters
    good = LoRARequest("x", str(ad["x"][1]))
    p = prompt_ids(4)
    llm = make_llm(num_blocks=64)
    before = [o.token_ids for o in llm.generate([p, p], GREEDY, lora=[good, None], use_tqdm=False)]
    assert before[0] != before[1] and set(before[0]) != {0}
    for lora, fragment in _malformed_adapters(ad["x"][1], tmp_path):
        with pytest.raises(InvalidInputError) as e:
            llm.generate(p, GREEDY, lora=lora, use_tqdm=False)
        message = str(e.value)
        assert e.value.field == "lora", message
        assert message.startswith(f"lora: adapter 'x' at {tmp_path}/"), message
        assert fragment in message, message
        assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidInputError, match="lora: adapter 'x': lora_path must be a non-empty directory") as e:
        llm.generate(p, GREEDY, lora=LoRARequest("x", None), use_tqdm=False)
    assert e.value.field == "lora"
    after = [o.token_ids for o in llm.generate([p, p], GREEDY, lora=[good, None], use_tqdm=False)]
    assert after == before


def test_adapter_made_malformed_after_use_is_refused_then_reloads(make_llm, adapters, tmp_path):
    """An adapter whose files turn malformed after it was loaded is refused (not served from the
    old load, not a raw error); restored, it generates its old tokens again."""
    from prefixcache.errors import InvalidInputError

    _, ad = adapters
    live = tmp_path / "live"
    shutil.copytree(ad["x"][1], live)
    lora = LoRARequest("x", str(live))
    p = prompt_ids(5)
    llm = make_llm(num_blocks=64)
    first = llm.generate(p, GREEDY, lora=lora, use_tqdm=False)[0].token_ids
    good_config = (live / "adapter_config.json").read_bytes()
    (live / "adapter_config.json").write_text('{"r": 0}')
    with pytest.raises(InvalidInputError, match=r"'r' \(the LoRA rank\) must be a positive integer, got 0") as e:
        llm.generate(p, GREEDY, lora=lora, use_tqdm=False)
    assert e.value.field == "lora"
    (live / "adapter_config.json").write_bytes(good_config)
    assert llm.generate(p, GREEDY, lora=lora, use_tqdm=False)[0].token_ids == first
