"""vLLM's ``prompt_logprobs`` over HTTP: the engine's entries in vLLM's JSON, served from the cache."""

from __future__ import annotations

import httpx

from prefixcache.sample_texts import SYSTEM_PROMPT
from prefixcache.sampling_params import SamplingParams
from tests.entrypoints.conftest import MODEL


def post(server, path, body):
    return httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=60)


def test_completion_prompt_logprobs_equal_the_engines_and_come_from_the_cache(server, smollm2):
    prompt = smollm2.tokenizer(SYSTEM_PROMPT).input_ids[:60]
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2, "n": 2}
    cold = post(server, "/v1/completions", body).json()
    warm = post(server, "/v1/completions", body).json()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # 3 blocks with their entries
    entries = cold["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 60
    assert cold["choices"][1]["prompt_logprobs"] == entries  # every sample carries them
    assert warm["choices"][0]["prompt_logprobs"][:48] == entries[:48]
    # the same as the engine's own offline answer
    from prefixcache.llm import LLM

    offline = LLM(MODEL, loaded=smollm2, num_threads=2).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    for i in range(1, 60):
        got = entries[i]
        assert set(got) == {str(t) for t in offline.prompt_logprobs[i]}, i
        own = got[str(prompt[i])]
        assert own["rank"] == offline.prompt_logprobs[i][prompt[i]].rank
        assert abs(own["logprob"] - offline.prompt_logprobs[i][prompt[i]].logprob) < 1e-4
        assert own["decoded_token"] == smollm2.tokenizer.decode([prompt[i]])


def test_chat_prompt_logprobs_and_refusals(server):
    messages = [{"role": "user", "content": "Name a colour."}]
    r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0})
    assert r.status_code == 200
    entries = r.json()["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:])  # k = 0: the prompt token alone
    assert len(entries) == r.json()["usage"]["prompt_tokens"]
    for body, field in (({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
                        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                        ({"prompt_logprobs": "1"}, "prompt_logprobs")):
        r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
