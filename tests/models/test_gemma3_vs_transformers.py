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
    # 512 blocks of 16 tokens, each 3 layers' K/V (one KV-cache group): room for every test's
    # requests (a 2,000-token one holds 125 + 5 x 32 at most), and no 1 GiB default pool to fault in
    return LLM(GEMMA3_MODEL_NAME, loaded=gemma3, num_threads=2, dtype="float32", quantization="none",
               **{"num_blocks": 512, **options})


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
    driver = PagedDriver(gemma3, block_size=16, num_blocks=6 * 70)  # 6 KV-cache groups
    driver.add("a", len(ids))
    chunks = [ids[:700], ids[700:1100], *([t] for t in ids[1100:])]
    hiddens = []
    with torch.inference_mode():
        for chunk in chunks:  # per KV-cache group tables, out-of-window blocks released, as the runner's
            md, positions = driver.metadata([("a", len(chunk))])
            hiddens.append(gemma3.model(torch.tensor(chunk), positions, md, driver.kv_caches))
            driver.num_computed["a"] += len(chunk)
            driver._release("a")
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
    # group 0 serves the prefix's 75 full blocks; each sliding group the blocks covering
    # [1200 - 511, 1200): blocks 43-74, kept with the first request's prefix (retention): all 1,200;
    # then the tails' common first tokens ("\n\nQuestion:") come from block 75 of the first
    # request, copied in every group (partial-block reuse)
    shared = next(i for i, (a, b) in enumerate(zip(tail_a, tail_b)) if a != b)
    assert 0 < shared < 16
    assert outs_on[1].num_cached_tokens == 1200 + shared
    assert outs_off[1].num_cached_tokens == 0
    assert [o.token_ids for o in outs_on] == [o.token_ids for o in outs_off]


def test_batch_invariant_tokens(gemma3, llm_off):
    """A prompt alone and in a batch with two others (one past the window) gives the same tokens."""
    prompts = [chat_ids(gemma3, "Name three primary colors."), long_ids(gemma3, 700),
               chat_ids(gemma3, "What is two plus two?")]
    alone = [llm_off.generate(p, greedy(16))[0].token_ids for p in prompts]
    batched = [o.token_ids for o in llm_off.generate(prompts, greedy(16))]
    assert batched == alone


TAIL_C = "\n\nQuestion: can a gift card be refunded?"


def step_until_done(engine, request_id: str, on_step=None):
    """Steps the engine until ``request_id`` finishes; ``on_step(request_id)`` after each step it runs."""
    while True:
        outs = [o for o in engine.step() if o.finished and o.request_id == request_id]
        if on_step is not None and request_id in engine.kv_cache_manager.req_to_blocks:
            on_step(request_id)
        if outs:
            return outs[0]


def test_hit_after_sliding_blocks_are_evicted_is_what_the_rule_gives(gemma3, llm_off):
    """The full chain stays; one sliding group loses the block ending the window at 1,200: the hit
    drops to 1,184 (blocks 42-73 cover [673, 1184) in every group: retained with the prefix)."""
    prefix = long_ids(gemma3, 1200)
    tail = gemma3.tokenizer(TAIL_C, add_special_tokens=False).input_ids
    on = make_llm(gemma3, enable_prefix_caching=True)
    on.generate(prefix + tail, greedy(4))
    pool = on.engine.kv_cache_manager.block_pool
    want = prefix[74 * 16:75 * 16]
    (victim,) = [b for b in pool.blocks if b.group_id == 3 and b.block_hash is not None and list(b.token_ids) == want]
    pool.uncache([victim], reason="test")
    prompt = prefix + gemma3.tokenizer("\n\nQuestion: is there a restocking fee?", add_special_tokens=False).input_ids
    out = on.generate(prompt, greedy(12))[0]
    assert out.num_cached_tokens == 1184
    assert out.token_ids == llm_off.generate(prompt, greedy(12))[0].token_ids


def test_local_kv_held_and_the_saving_for_a_2000_token_prompt(gemma3):
    """From the manager after every step of a 2,000-token prompt (chunked) and 24 decodes: each
    sliding group holds <= window + 2 blocks (512 / 16 + 2 = 34); after the prefill the full group
    holds 125 blocks and each of the 5 sliding groups 32, 285 blocks of 3 layers against 125 of 18
    with one group: 855 layer-blocks against 2,250 (26.7 MiB against 70.3 MiB of float32 K/V)."""
    llm = make_llm(gemma3, enable_prefix_caching=True)
    engine, block_size = llm.engine, 16
    kv = engine.kv_cache_manager
    held, after_prefill = [], {}

    def check(rid: str) -> None:
        tables = kv.req_to_group_blocks[rid]
        counts = [sum(b is not None for b in t) for t in tables]
        assert max(counts) * block_size <= 512 + 2 * block_size, counts
        held.append(max(counts))
        request = engine.scheduler.requests[rid]
        if request.num_computed_tokens >= 2000 and not after_prefill:
            after_prefill.update(full=len(kv.req_to_blocks[rid]), sliding=counts)

    rid = engine.add_request(long_ids(gemma3, 2000), greedy(24))
    step_until_done(engine, rid, check)
    assert after_prefill == {"full": 125, "sliding": [32] * 5}
    layers = engine.kv_cache_groups.layers_per_group
    grouped = (125 + 5 * 32) * layers
    assert (layers, grouped, 125 * gemma3.config.num_hidden_layers) == (3, 855, 2250)
    assert engine.kv_cache_bytes_per_block * (125 + 5 * 32) == 855 * 16 * 256 * 2 * 4
