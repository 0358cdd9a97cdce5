"""The grammar-library comparison behind README's "Structured output" table (run from the repo root).

    pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi   # triton is not needed on the CPU
    pip install --no-deps --target /tmp/oc outlines-core
    PYTHONPATH=/tmp/xg .venv/bin/python scripts/bench_grammar_libs.py xgrammar
    .venv/bin/python scripts/bench_grammar_libs.py llguidance
    PYTHONPATH=/tmp/oc .venv/bin/python scripts/bench_grammar_libs.py outlines-core

For SmolLM2's tokenizer (49,152 tokens): the time to build the library's tokenizer table, to
compile a small JSON schema (and the any-JSON grammar), and to fill the next-token mask at each
step of a valid JSON text (every text token is checked to be allowed before it is consumed).
llguidance and xgrammar generate the text in their fixed layouts (spaced / compact).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import torch

from prefixcache.models.loader import load_model

VOCAB_SIZE = 49152
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}}},
          "required": ["name", "age"], "additionalProperties": False}
SPACED = '{"name": "Alice Smith", "age": 42, "tags": ["a", "b"]}'
COMPACT = '{"name":"Alice Smith","age":42,"tags":["a","b"]}'


def allowed(bitmask: torch.Tensor) -> np.ndarray:
    return np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:VOCAB_SIZE].astype(bool)


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def steps(ids: list[int], fill, consume) -> list[float]:
    """Mask fill seconds per step; asserts each token is allowed, then consumes it."""
    times = []
    for t in ids:
        mask, dt = timed(fill)
        times.append(dt)
        assert mask[t], t
        assert consume(t)
    return times


def xgrammar_run(tok) -> tuple[float, float, float, list[float]]:
    import xgrammar as xgr

    info, t_info = timed(lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB_SIZE, stop_token_ids=[2]))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    grammar, t_compile = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
    _, t_any = timed(compiler.compile_builtin_json_grammar)
    matcher, bitmask = xgr.GrammarMatcher(grammar), xgr.allocate_token_bitmask(1, VOCAB_SIZE)
    fill = lambda: (matcher.fill_next_token_bitmask(bitmask), allowed(bitmask))[1]  # noqa: E731
    return t_info, t_compile, t_any, steps(tok.encode(SPACED, add_special_tokens=False), fill, matcher.accept_token)


def llguidance_run(tok) -> tuple[float, float, float, list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    info, t_info = timed(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB_SIZE))
    make = lambda schema: llguidance.LLMatcher(  # noqa: E731
        info, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}))
    matcher, t_compile = timed(lambda: make(SCHEMA))
    _, t_any = timed(lambda: make({"type": "object"}))
    bitmask = llguidance.torch.allocate_token_bitmask(1, VOCAB_SIZE)
    fill = lambda: (llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0), allowed(bitmask))[1]  # noqa: E731
    return t_info, t_compile, t_any, steps(tok.encode(COMPACT, add_special_tokens=False), fill, matcher.consume_token)


def byte_level_vocabulary(tok) -> dict[bytes, list[int]]:
    """GPT-2 byte-level token strings → bytes (outlines-core reads no HF tokenizer offline)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = {}, 0
    for b in range(256):
        codes[chr(b) if b in printable else chr(256 + (extra := extra + 1) - 1)] = b
    vocab: dict[bytes, list[int]] = {}
    for text, i in tok.get_vocab().items():
        if i != 2:
            key = bytes(codes[c] for c in text) if all(c in codes for c in text) else text.encode()
            vocab.setdefault(key, []).append(i)
    return vocab


def outlines_core_run(tok) -> tuple[float, float, float, list[float]]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    vocab, t_info = timed(lambda: Vocabulary(2, byte_level_vocabulary(tok)))
    index, t_compile = timed(lambda: Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab))
    guide = Guide(index)
    fill = lambda: np.isin(np.arange(VOCAB_SIZE), guide.get_tokens())  # noqa: E731
    times = steps(tok.encode(COMPACT, add_special_tokens=False), fill, lambda t: guide.advance(t) is not None)
    return t_info, t_compile, float("nan"), times  # any-JSON is not a regular language


def main() -> None:
    lib = sys.argv[1]
    tok = load_model("smollm2-135m").tokenizer
    run = {"xgrammar": xgrammar_run, "llguidance": llguidance_run, "outlines-core": outlines_core_run}[lib]
    t_info, t_compile, t_any, times = run(tok)
    print(f"{lib}: tokenizer table {t_info * 1e3:.0f} ms, compile schema {t_compile * 1e3:.1f} ms, "
          f"any-JSON {t_any * 1e3:.1f} ms, mask fill (incl. unpacking) median "
          f"{statistics.median(times) * 1e6:.0f} us, max {max(times) * 1e6:.0f} us over {len(times)} steps")


if __name__ == "__main__":
    main()
