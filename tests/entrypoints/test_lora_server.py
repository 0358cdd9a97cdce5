"""LoRA adapters on the server: `--lora-modules name=path`, selected by the request's `model` field."""

from __future__ import annotations

import copy

import httpx
import pytest
import torch
from tests.entrypoints.conftest import MODEL, start_server, stop_server

from prefixcache import LLM, LoRARequest, SamplingParams
from prefixcache.entrypoints.cli_args import parse_lora_modules

peft = pytest.importorskip("peft")

PROMPT = [3906, 6202, 5762, 23862, 11281, 20394, 16687, 39911, 1410, 904, 2273, 785, 19, 4012, 873, 28, 4921, 22]


@pytest.fixture(scope="module")
def adapter_dir(smollm2, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2.model_dir, dtype=torch.float32).eval()
    torch.manual_seed(5)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=["q_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(copy.deepcopy(hf), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20)
    path = tmp_path_factory.mktemp("server-adapter")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def lora_server(smollm2, adapter_dir):
    s = start_server(smollm2, lora_modules={"legal": str(adapter_dir)}, num_blocks=64)
    yield s
    stop_server(s)


def complete(server, model):
    r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                   json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    return r


def test_model_field_selects_the_adapter(lora_server, smollm2, adapter_dir):
    models = httpx.get(lora_server.base_url + "/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [(MODEL, None), ("legal", MODEL)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(loaded=smollm2, num_blocks=64, num_threads=2)
    want_lora = llm.generate(PROMPT, params, lora=LoRARequest("legal", str(adapter_dir)), use_tqdm=False)[0]
    want_base = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert want_lora.token_ids != want_base.token_ids
    r = complete(lora_server, "legal")
    assert r.status_code == 200 and r.json()["model"] == "legal"
    assert r.json()["choices"][0]["text"] == want_lora.text
    base = complete(lora_server, MODEL).json()
    assert base["choices"][0]["text"] == want_base.text
    assert base["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # adapter blocks are not the base's
    again = complete(lora_server, "legal").json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    missing = complete(lora_server, "nope")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_parse_lora_modules():
    assert parse_lora_modules(["a=/x", "b=/y=z"]) == {"a": "/x", "b": "/y=z"}
    for bad in (["a"], ["=/x"], ["a="], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)
