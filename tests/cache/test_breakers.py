"""Cache breakers on hand-made prompts, tokenized by SmolLM2's tokenizer: where a prompt leaves a chain
(exact token position and block), what the differing span is and its class, the tokens it cost; and
the span classifier on plain strings."""

from __future__ import annotations

import pytest

from prefixcache.cache.breakers import (
    DATETIME, NUMBER, OTHER, UUID_HEX, WHITESPACE, BreakerTracker, classify_span, common_prefix, realign,
)

BS = 16
SYSTEM = ("You are the support assistant of the ACME online store. Answer in two sentences, politely, and "
          "only about orders, shipping, returns and our product catalogue. Never invent prices.")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from prefixcache.models.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"), local_files_only=True)


def first_difference(a, b) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def equal_run(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def breaker_of(tok, chain_text: str, request_text: str, chat: bool = False):
    def ids(text):
        if chat:
            rendered = tok.apply_chat_template([{"role": "system", "content": text},
                                                {"role": "user", "content": "Where is my parcel?"}],
                                               tokenize=False, add_generation_prompt=True)
            return tok.encode(rendered, add_special_tokens=False)
        return tok.encode(text)

    tracker = BreakerTracker(BS, lambda t: tok.decode(list(t)))
    chain, request = ids(chain_text), ids(request_text)
    assert tracker.observe(("root", b""), chain) is None  # nothing to break from yet
    return tracker, chain, request, tracker.observe(("root", b""), request)


def test_timestamp_at_the_front(tok):
    tracker, chain, request, b = breaker_of(tok, "2026-11-30T10:04:59Z " + SYSTEM + " Q: my order?",
                                            "2026-12-01T08:15:00Z " + SYSTEM + " Q: my refund?")
    assert b.position == first_difference(chain, request) == 6  # "2026-1" is 6 tokens: one per character
    assert (b.block, b.kind) == (0, DATETIME)
    assert (b.span_text, b.chain_text) == ("2-01T08:15:00", "1-30T10:04:59")
    assert (b.span_tokens, b.chain_span_tokens) == (13, 13)
    after = b.position + b.span_tokens
    assert b.tokens_lost == equal_run(chain[after:], request[after:])
    assert tok.decode(request[after : after + b.tokens_lost]) == "Z " + SYSTEM + " Q: my"
    assert tracker.by_kind()[DATETIME] == {"count": 1, "tokens_lost": b.tokens_lost}


def test_uuid_in_the_system_prompt(tok):
    a, b_id = "3f2b9c1e-8d4a-4b6e-9f0a-1c2d3e4f5a6b", "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d"
    tracker, chain, request, b = breaker_of(tok, f"Session {a}. {SYSTEM}", f"Session {b_id}. {SYSTEM}", chat=True)
    prefix = tok.encode(tok.apply_chat_template([{"role": "system", "content": "Session "}], tokenize=False)
                        .split("Session ")[0] + "Session", add_special_tokens=False)
    assert b.position == first_difference(chain, request) == len(prefix) + 1  # after "...Session", " "
    assert (b.block, b.kind) == (b.position // BS, UUID_HEX)
    assert (b.span_text, b.chain_text) == (b_id, a)
    assert b.tokens_lost == equal_run(chain[b.position + b.chain_span_tokens:], request[b.position + b.span_tokens:])
    assert b.tokens_lost >= len(tok.encode(SYSTEM)) - 1


def test_double_space(tok):
    _, chain, request, b = breaker_of(tok, SYSTEM + " Q: my order?",
                                      SYSTEM.replace("support assistant", "support  assistant") + " Q: my order?")
    assert b.position == first_difference(chain, request) == len(tok.encode("You are the support"))
    assert (b.block, b.kind) == (0, WHITESPACE)
    assert (b.span_text, b.chain_text, b.span_tokens, b.chain_span_tokens) == (" ", "", 1, 0)
    assert b.tokens_lost == len(chain) - b.position


def test_no_breaker_across_namespaces_or_below_a_block(tok):
    tracker = BreakerTracker(BS, lambda t: tok.decode(list(t)))
    one = tok.encode("2026-11-30 " + SYSTEM)
    two = tok.encode("2026-12-01 " + SYSTEM)
    assert tracker.observe(("root", b"tenant\0a"), one) is None
    assert tracker.observe(("root", b"tenant\0b"), two) is None  # another tenant's chain is never compared
    short = BreakerTracker(BS, lambda t: tok.decode(list(t)))
    short.observe("ns", tok.encode("2026-11-30 Hi there"))
    assert short.observe("ns", tok.encode("2026-12-01 Hi there")) is None  # cost < one block
    assert short.num_observed == 2 and short.num_breakers == 0


@pytest.mark.parametrize("request_text, chain_text, kind", [
    ("Order 98712 shipped", "Order 12345 shipped", NUMBER),
    ("id 0badc0de99 ok", "id deadbeef01 ok", UUID_HEX),
    ("Dear Robert, hi", "Dear Alice, hi", OTHER),
    ("Today is Monday.", "Today is Friday.", DATETIME),
    ("at 9:05 pm sharp", "at 10:04 am sharp", DATETIME),
    ("on 30/11/2026 we", "on 01/12/2026 we", DATETIME),
    ("on November 30, 2026 we", "on December 1, 2026 we", DATETIME),
    ("a\tb", "a b", WHITESPACE),
    ("ab", "ab", WHITESPACE),  # equal text, other tokens: a tokenization difference
])
def test_classify_span(request_text, chain_text, kind):
    s = first_difference(request_text, chain_text) if request_text != chain_text else 1
    e = len(request_text) - equal_run(request_text[::-1], chain_text[::-1])
    oe = len(chain_text) - equal_run(request_text[::-1], chain_text[::-1])
    assert classify_span(request_text, s, max(e, s), chain_text, s, max(oe, s)) == kind


def test_common_prefix_and_realign():
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([5] * 1000, [5] * 1000) == 1000
    #        0  1  2  3  4  5  6  7
    chain = [1, 2, 7, 7, 3, 4, 5, 6]
    req = [1, 2, 8, 3, 4, 5, 6]
    assert realign(chain, req, 2, max_span_tokens=8, anchor_tokens=4) == (2, 1)
    assert realign(chain, req, 2, max_span_tokens=1, anchor_tokens=4) is None


def test_memory_bounds_keep_the_totals():
    decode = lambda t: " ".join(map(str, t))  # noqa: E731
    tracker = BreakerTracker(4, decode, max_chains=3, max_total_tokens=100, max_groups=8, anchor_tokens=2)
    tail = list(range(1000, 1040))  # 40 tokens every prompt shares after its first token
    for i in range(20):  # 20 namespaces, 2 prompts each: the second breaks from the first at token 0
        assert tracker.observe(("ns", i), [5000 + 2 * i] + tail) is None
        b = tracker.observe(("ns", i), [5001 + 2 * i] + tail)
        assert (b.position, b.span_tokens, b.chain_span_tokens, b.tokens_lost, b.kind) == (0, 1, 1, 40, NUMBER)
        assert tracker._total_tokens <= 100 and sum(map(len, tracker._chains.values())) <= 3
    assert tracker.num_breakers == 20 and tracker.tokens_lost == 800
    assert len(tracker.groups) <= 8  # pruned to the 4 costliest whenever it passes 8
    assert tracker.by_kind()[NUMBER] == {"count": 20, "tokens_lost": 800}  # totals survive the pruning
    assert tracker.by_kind(lambda ns: ns == ("ns", 3))[NUMBER] == {"count": 1, "tokens_lost": 40}


# ---------------------------------------------------------------------------- C23: a zero says why
def test_explain_zero_names_each_reason_in_words():
    from prefixcache.cache.breakers import explain_zero

    assert explain_zero(None, 40, 16) == ("no_earlier_prompt", "nothing shared: no earlier prompt in its cache namespace")
    assert explain_zero(0, 40, 16) == ("nothing_shared", "nothing shared: the first token differs from every earlier prompt")
    assert explain_zero(12, 40, 16) == ("shorter_than_block", "shared prefix 12 tokens, shorter than one block (16)")
    assert explain_zero(16, 16, 16) == (
        "whole_prompt_one_block", "shared prefix 16 tokens, but the prompt is one block (16) and its last token is "
                                  "always computed")
    assert explain_zero(40, 50, 16) == (
        "not_cached", "shared prefix 40 tokens (2 full blocks), but they were not cached when it arrived (evicted, "
                      "reset, or still being computed)")


def test_the_bench_explains_its_zeros():
    from prefixcache.cache.breakers import explain_zeros

    first = list(range(100, 140))
    short = first[:12] + list(range(300, 328))  # shares 12 tokens
    other = [7] + first[1:]  # differs in its first token
    z = explain_zeros([first, short, other], [0, 0, 0], 16)
    assert z == {"count": 3, "explanation": "nothing shared: the first token differs from every earlier prompt",
                 "by_reason": {
                     "no_earlier_prompt": {"count": 1, "prompt_tokens": 40,
                                           "latest": "nothing shared: no earlier prompt in its cache namespace"},
                     "nothing_shared": {"count": 1, "prompt_tokens": 40, "latest": "nothing shared: the first "
                                        "token differs from every earlier prompt"},
                     "shorter_than_block": {"count": 1, "prompt_tokens": 40,
                                            "latest": "shared prefix 12 tokens, shorter than one block (16)"}}}
    z = explain_zeros([first, short], [0, 0], 16)
    assert z["explanation"] == "shared prefix 12 tokens, shorter than one block (16)"
    assert explain_zeros([first, first], [0, 32], 16)["count"] == 1  # the hit is not a zero


def test_zero_hits_keep_namespaces_apart():
    from prefixcache.cache.breakers import ZeroHits

    z = ZeroHits()
    z.record("a", 12, 40, 16)
    z.record("b", 0, 30, 16)
    assert z.report(lambda ns: ns == "a") == {
        "count": 1, "explanation": "shared prefix 12 tokens, shorter than one block (16)",
        "by_reason": {"shorter_than_block": {"count": 1, "prompt_tokens": 40,
                                             "latest": "shared prefix 12 tokens, shorter than one block (16)"}}}
    assert z.report(lambda ns: False) == {"count": 0, "by_reason": {}, "explanation": None}
