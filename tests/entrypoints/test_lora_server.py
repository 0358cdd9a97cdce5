"""LoRA adapters on the server: `--lora-modules name=path`, selected by the request's `model` field."""

from __future__ import annotations

import copy

import httpx
import pytest
import torch
from tests.entrypoints.conftest import MODEL, start_server, stop_server

from prefixcache import LLM, LoRARequest, SamplingParams
from prefixcache.entrypoints.cli.serve import parse_lora_modules

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


# ---------------------------------------------------------------------------- malformed adapters
MALFORMED_CONFIGS = [  # (adapter_config.json text, message fragment)
    ("null", "adapter_config.json must hold a JSON object, got NoneType None"),
    ('{"peft_type": "LORA", "lora_alpha": 8}', "adapter_config.json has no 'r' (the LoRA rank)"),
    ('{"r": 0}', "'r' (the LoRA rank) must be a positive integer, got 0"),
    ('{"r": 8, "lora_alpha": "nan"}', "'lora_alpha' must be a finite number, got 'nan'"),
]


def malformed_copy(adapter_dir, dst, config):
    import shutil

    shutil.copytree(adapter_dir, dst)
    (dst / "adapter_config.json").write_text(config)
    return dst


@pytest.mark.parametrize("config,fragment", MALFORMED_CONFIGS, ids=["null", "no-r", "r0", "alpha-nan"])
def test_malformed_adapter_stops_startup_with_one_line(smollm2, adapter_dir, tmp_path, monkeypatch, capsys,
                                                      config, fragment):
    """`prefixcache serve --lora-modules legal=DIR` with a malformed adapter_config.json exits 2 with
    `prefixcache serve: error: LoRA adapter legal=...: lora: ...`, as a rank mismatch does (not a traceback)."""
    from prefixcache.engine import llm_engine
    import prefixcache.entrypoints.cli.main as cli
    from prefixcache.entrypoints.openai import launcher, server_log

    bad = malformed_copy(adapter_dir, tmp_path / "bad-adapter", config)
    real_engine = llm_engine.LLMEngine

    def serve_http(*args, **kwargs):
        raise AssertionError("serve started with a malformed adapter")

    monkeypatch.setattr(llm_engine, "LLMEngine", lambda config: real_engine(config, loaded=smollm2))
    monkeypatch.setattr(launcher, "serve_http", serve_http)
    # serve's stderr log handler would outlive this test's captured stderr (and log into it closed)
    monkeypatch.setattr(server_log, "configure_logging", lambda level: None)
    argv = ["serve", "--port", "0", "--num-blocks", "8", "--num-threads", "2", "--lora-modules", f"legal={bad}",
            "--dtype", "float32", "--quantization", "none"]  # the format of the model handed in (serve's default: auto)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"prefixcache serve: error: LoRA adapter legal={bad}: lora: adapter 'legal' at "), err
    assert err.endswith("\nrun 'prefixcache serve --help' for all options\n") and err.count("\n") == 2, err
    assert fragment in err, err


def test_adapter_malformed_after_startup_is_a_400_on_lora(smollm2, adapter_dir, tmp_path):
    """An adapter whose config turns malformed while the server runs: 400 with param "lora" naming
    the fault (not a 500); the base model and, once restored, the adapter answer as before."""
    live = tmp_path / "live"
    malformed_copy(adapter_dir, live, (adapter_dir / "adapter_config.json").read_text())
    server = start_server(smollm2, lora_modules={"legal": str(live)}, num_blocks=64)
    try:
        want_lora, want_base = complete(server, "legal").json(), complete(server, MODEL).json()
        good_config = (live / "adapter_config.json").read_bytes()
        for config, fragment in MALFORMED_CONFIGS:
            (live / "adapter_config.json").write_text(config)
            r = complete(server, "legal")
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "lora" and error["message"].startswith("lora: adapter 'legal' at "), error
            assert fragment in error["message"], error
            assert complete(server, MODEL).json()["choices"] == want_base["choices"]
        (live / "adapter_config.json").write_bytes(good_config)
        again = complete(server, "legal")
        assert again.status_code == 200 and again.json()["choices"] == want_lora["choices"]
    finally:
        stop_server(server)
