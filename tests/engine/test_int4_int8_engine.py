"""quantization="int4-int8" end to end on the default model: prompt tokens run int8's W8A8 products
(the same bits as a bf16 + int8 engine), generated tokens int4's C++ decoder (4-bit layers, Q8_0
lm_head); batch-invariant, cache on == cache off, keyed apart from every other format."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_int4_engine import check_batched_equals_alone_and_cache_off_across_turns

from prefixcache.llm import LLM
from prefixcache.sample_texts import QUESTIONS, SYSTEM_PROMPT
from prefixcache.sampling_params import SamplingParams

pytestmark = pytest.mark.requires_format("bfloat16", "int4-int8")  # skipped where this CPU cannot run it

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2_int4_int8(smollm2):  # depends on smollm2: marked slow, loaded after the fp32 copy is cached
    from prefixcache.models.loader import load_model

    return load_model("smollm2-135m", dtype=torch.bfloat16, quantization="int4-int8")


def make(loaded, quantization="int4-int8", **options):
    return LLM("smollm2-135m", loaded=loaded, dtype="bfloat16", quantization=quantization, num_threads=2, **options)


def chat(llm, question):
    return list(llm.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                         {"role": "user", "content": question}]))


def test_int4_int8_batched_equals_alone_and_cache_off_across_turns(smollm2_int4_int8):
    check_batched_equals_alone_and_cache_off_across_turns(lambda **options: make(smollm2_int4_int8, **options))


def test_int4_int8_prompt_rows_are_int8s_and_generated_rows_int4s(smollm2_int4_int8, monkeypatch):
    """The first token and its logprobs equal a bf16 + int8 engine's exactly (the last prompt row runs
    the same W8A8 products and int8 lm_head); after it, no int8 product runs (every generated row's
    layers are one C++ decoder call per step, its logits the Q8_0 lm_head's), and the logprobs that
    follow are int4's decoder's, which differ from int8's."""
    import prefixcache.layers.quant as quant
    import prefixcache.models.llama as llama
    from prefixcache.layers.decode_layers import DecodeLayers
    from prefixcache.models.loader import load_model

    int8 = make(load_model("smollm2-135m", dtype=torch.bfloat16, quantization="int8"), quantization="int8")
    combo = make(smollm2_int4_int8)
    prompt = chat(combo, QUESTIONS[2])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    ref = int8.generate([prompt], params, use_tqdm=False)[0]
    rows, runs, q8 = [], [], []
    int8_linear, run, group_int8_linear = quant.int8_linear, DecodeLayers.run, llama.group_int8_linear

    def recording_int8(x_q, scale, weight, out_dtype):
        rows.append(x_q.shape[0])
        return int8_linear(x_q, scale, weight, out_dtype)

    def recording_run(self, hidden, gen, kv_caches, begin=0, end=None):
        runs.append((hidden.shape[0], begin, end))
        return run(self, hidden, gen, kv_caches, begin, end)

    def recording_q8(x, weight, out_dtype):
        q8.append(x.shape[0])
        return group_int8_linear(x, weight, out_dtype)

    monkeypatch.setattr(quant, "int8_linear", recording_int8)  # every int8 product (quant.int8_product)
    monkeypatch.setattr(DecodeLayers, "run", recording_run)
    monkeypatch.setattr(llama, "group_int8_linear", recording_q8)
    out = combo.generate([prompt], params, use_tqdm=False)[0]
    assert out.token_ids[0] == ref.token_ids[0] and out.logprobs[0] == ref.logprobs[0]
    # the prompt's step only: 30 layers x (q|k|v, o, gate|up, down) over the prompt rows, then the lm_head's last row
    assert rows == [len(prompt)] * 120 + [1]
    assert runs == [(1, 0, None)] * 15 and q8 == [1] * 15  # tokens 2..16
    assert out.logprobs[1:] != ref.logprobs[1:]  # int4's layers from the second token on: other logprobs


def test_int4_int8_is_keyed_apart_and_refuses_lora(smollm2_int4_int8, tmp_path):
    """K/V computed by int8's or int4's prompt products is never served to int4-int8 (nor the other
    way); an adapter is refused up front, naming the field, and the engine goes on serving."""
    from prefixcache.config import EngineConfig
    from prefixcache.errors import InvalidInputError
    from prefixcache.layers.lora import LoRARequest

    combo = make(smollm2_int4_int8)
    processor, loaded = combo.engine.input_processor, smollm2_int4_int8
    keys = {processor.model_key}
    for quantization in ("int8", "int4", "none"):  # the same weights and kernels under another format's name
        processor.loaded = SimpleNamespace(fingerprint=loaded.fingerprint, dtype=loaded.dtype, model=loaded.model,
                                           quantization=quantization)
        keys.add(processor.model_key)
    processor.loaded = loaded
    assert len(keys) == 4 and processor.model_key in keys
    with pytest.raises(InvalidInputError, match="lora: adapters need quantization 'none' or 'int8'; 'int4-int8'"):
        combo.engine.add_request([1, 2, 3], GREEDY, lora=LoRARequest("mine", str(tmp_path)))
    assert not combo.engine.scheduler.requests
    from prefixcache.entrypoints.openai.api_server import build_app

    with pytest.raises(ValueError, match="lora_modules: adapters need quantization 'none' or 'int8'; 'int4-int8'"):
        build_app(combo.engine, "m", lora_modules={"mine": str(tmp_path)})  # not a server that 400s each use
    assert len(combo.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                              use_tqdm=False)[0].token_ids) == 2
    with pytest.raises(InvalidInputError, match="quantization='int4-int8' runs a bfloat16 model") as e:
        EngineConfig(quantization="int4-int8").validate()
    assert e.value.field == "quantization"
