"""The real Gemma 3 270M (``gemma3-270m``, float32) against transformers' Gemma3ForCausalLM on the
same converted directory (eager attention), on prompts shorter than and past its 512-token window.

The model is fetched by ``scripts/setup.sh`` (``python -m prefixcache fetch --model gemma3-270m``);
without it these tests skip, naming that command.
"""

import pytest
import torch
from model_testlib import PagedDriver
from transformers import AutoModelForCausalLM

from prefixcache.bench.texts import FEW_SHOT_EXAMPLES, RAG_DOCUMENT, SUPPORT_POLICY
from prefixcache.layers.attention import build_attention_metadata
from prefixcache.llm import LLM
from prefixcache.models.fetch import GEMMA3_MODEL_NAME, builtin_model_dir, is_complete
from prefixcache.models.loader import load_model
from prefixcache.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

LOGITS_ATOL = 1e-3  # the real-model tolerance of test_smollm2.py (fp32, 18 layers, SDPA vs eager sums)
LONG_LENGTHS = (600, 1200, 2000)  # prompt tokens, all past the 512-token window


@pytest.fixture(scope="module")
def gemma3():
    if not is_complete(builtin_model_dir(GEMMA3_MODEL_NAME)):
        pytest.skip("gemma3-270m is not fetched: run `python -m prefixcache fetch --model gemma3-270m` "
                    "(scripts/setup.sh does)")
    return load_model(GEMMA3_MODEL_NAME)


@pytest.fixture(scope="module")
def reference(gemma3):
    return AutoModelForCausalLM.from_pretrained(gemma3.model_dir, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def long_ids(gemma3, n: int) -> list[int]:
    """The first ``n`` tokens of natural English text (the bench's documents), starting with <bos>."""
    ids = gemma3.tokenizer(SUPPORT_POLICY + "\n\n" + RAG_DOCUMENT + "\n\n" + FEW_SHOT_EXAMPLES).input_ids
    assert len(ids) >= n, len(ids)
    return ids[:n]


def chat_ids(gemma3, question: str) -> list[int]:
    return gemma3.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]


def reference_greedy(reference, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def make_llm(gemma3, **options) -> LLM:
    # 256 blocks of 16 tokens: room for every test's requests, and no 1 GiB default pool to fault in
    return LLM(GEMMA3_MODEL_NAME, loaded=gemma3, num_threads=2, dtype="float32", quantization="none",
               num_blocks=256, **options)


@pytest.fixture(scope="module")
def llm_off(gemma3):
    """One engine without prefix caching for the tests that compare generated tokens."""
    return make_llm(gemma3, enable_prefix_caching=False)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def test_config_and_chat_template(gemma3):
    cfg = gemma3.config
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (18, 4, 1, 256)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.sliding_window) == (640, 262144, 512)
    assert cfg.layer_types.count("full_attention") == 3 and cfg.layer_types[5] == "full_attention"
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 256.0)
    end_of_turn = gemma3.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert {1, end_of_turn} <= set(gemma3.eos_token_ids)
    text = gemma3.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Hi"}],
                                                tokenize=False, add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_logits_past_the_window_match_transformers(gemma3, reference):
    """A 1,100-token prompt as a 700-token chunk, the rest on top of it, then 3 decodes: the logits at
    positions before, at and past the window edge, against one transformers forward."""
    ids = long_ids(gemma3, 1103)
    rows = [0, 100, 510, 511, 512, 513, 699, 700, 701, 1000, 1099, 1100, 1101, 1102]
    with torch.inference_mode():
        hidden = reference.model(torch.tensor([ids])).last_hidden_state[0]  # [len(ids), hidden]
        expected = reference.lm_head(hidden[rows]).float()
    driver = PagedDriver(gemma3, block_size=16, num_blocks=80)
    driver.add("a", len(ids))
    chunks = [ids[:700], ids[700:1100], *([t] for t in ids[1100:])]
    hiddens = []
    with torch.inference_mode():
        for chunk in chunks:
            seqs = [(driver.num_computed["a"], len(chunk), driver.block_tables["a"])]
            md, positions = build_attention_metadata(seqs, driver.block_size, "cpu",
                                                     sliding_window=gemma3.config.sliding_window)
            hiddens.append(gemma3.model(torch.tensor(chunk), positions, md, driver.kv_caches))
            driver.num_computed["a"] += len(chunk)
        got = gemma3.model.compute_logits(torch.cat(hiddens)[rows])
    torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("question", ["What is the capital of France?", "Write a haiku about the sea."])
def test_greedy_chat_matches_transformers(gemma3, reference, llm_off, question):
    ids = chat_ids(gemma3, question)
    out = llm_off.generate(ids, greedy(24))[0]
    assert out.token_ids == reference_greedy(reference, ids, 24)


@pytest.mark.parametrize("length", LONG_LENGTHS)
def test_greedy_long_prompt_matches_transformers(gemma3, reference, llm_off, length):
    ids = long_ids(gemma3, length)
    out = llm_off.generate(ids, greedy(12))[0]
    assert out.token_ids == reference_greedy(reference, ids, 12)


def test_cache_on_equals_cache_off_past_the_window(gemma3, llm_off):
    """A second request sharing a 1,200-token prefix takes it from the cache (its local layers then
    attend to cached keys inside their window only) and generates what it would without the cache."""
    prefix = long_ids(gemma3, 1200)
    tail_a = gemma3.tokenizer("\n\nQuestion: how long is the refund window?", add_special_tokens=False).input_ids
    tail_b = gemma3.tokenizer("\n\nQuestion: who pays for return shipping?", add_special_tokens=False).input_ids
    prompts = [prefix + tail_a, prefix + tail_b]
    on = make_llm(gemma3, enable_prefix_caching=True)
    outs_on = [on.generate(p, greedy(12))[0] for p in prompts]
    outs_off = [llm_off.generate(p, greedy(12))[0] for p in prompts]
    assert outs_on[1].num_cached_tokens >= 1184  # the prefix's full 16-token blocks
    assert outs_off[1].num_cached_tokens == 0
    assert [o.token_ids for o in outs_on] == [o.token_ids for o in outs_off]


def test_batch_invariant_tokens(gemma3, llm_off):
    """A prompt alone and in a batch with two others (one past the window) gives the same tokens."""
    prompts = [chat_ids(gemma3, "Name three primary colors."), long_ids(gemma3, 700),
               chat_ids(gemma3, "What is two plus two?")]
    alone = [llm_off.generate(p, greedy(16))[0].token_ids for p in prompts]
    batched = [o.token_ids for o in llm_off.generate(prompts, greedy(16))]
    assert batched == alone
