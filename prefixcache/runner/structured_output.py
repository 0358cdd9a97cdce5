"""Structured output: grammar masks over the logits (vLLM v1's ``StructuredOutputManager`` role),
through llguidance.

A request whose :class:`SamplingParams` has ``structured_outputs`` is constrained by a grammar:

- Admission: :meth:`StructuredOutputManager.compile` turns the constraint into an llguidance
  grammar and builds a matcher for it, once per distinct constraint (an LRU cache keyed by the
  frozen :class:`StructuredOutputsParams`, whose schema is compact JSON text), and builds its first
  masks along the tokens it forces: a schema or regex that doesn't compile, that llguidance refuses
  only there (its lexer past its limits: the regex ``a{1000000}`` at its first token), or that
  allows no token at all (``[^\\s\\S]``, a schema that only refers to itself) raises
  ``InvalidInputError("structured_outputs")`` here, before the request is queued.
- A grammar that fails later, in a step (a lexer limit reached only after some tokens), fails only
  its own request: :meth:`mask_logits` and :meth:`accept_tokens` report it (request id → message)
  and the engine finishes that request with ``"error"``; the step's other requests go on.
- Every step that samples: :meth:`mask_logits` sets to ``-inf`` the logits of every token that
  can't continue a text the grammar accepts, in each constrained row, before the sampler runs
  (greedy and sampled rows alike); EOS is allowed only where the text is complete.
- After sampling: :meth:`accept_tokens` advances each constrained request's matcher with its token.

Which tokens are allowed: those whose text continues a text the grammar accepts; where the grammar
forces a text (the ``{"name": `` that opens an object of a schema with one required property),
llguidance allows only the tokens of that text's own tokenization, not every token spelling a
prefix of it, so the model reads forced text tokenized as it was trained on.

Where the state lives: one matcher per engine request id, a copy of the compiled template made at
the request's first sampled token and dropped when the request finishes or is aborted
(``SchedulerOutput.finished_req_ids``). Each sample of an ``n > 1`` request has its own id and so
its own matcher (a fork samples its first token from its parent's logits row, through its own
mask). A preempted request keeps its matcher: it is recomputed from its prompt and the output it
already has, and samples only the token after them (the scheduler samples in the step that
computes a request's last token), so the matcher has seen exactly the request's output tokens.

The grammar doesn't change any K/V: it only masks the logits of the last position, so it is not
part of the prefix-cache key, and a constrained request shares cached blocks with unconstrained
ones of the same prompt.

Why llguidance (measured on this project's 2-core CPU machine, SmolLM2's 49,152-token vocabulary,
docs/benchmarks.md has the comparison): a 3 MB wheel with no dependencies (xgrammar 0.2 pulls in triton,
a 273 MB wheel, on Linux), a 2.5 ms schema compile, ~20 us per mask; it is one of vLLM's two
structured-output backends (``guidance``).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.hf
import llguidance.torch
import numpy as np
import torch

from prefixcache.errors import InvalidInputError
from prefixcache.sampling_params import SamplingParams, StructuredOutputsParams

MAX_CACHED_GRAMMARS = 256
FORCED_TOKENS_CHECKED = 16  # forced first tokens followed at admission (see _check_forced_start)
# JSON layout: json.dumps's default separators and no other whitespace (see StructuredOutputsParams).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_for(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked: the matcher reports errors).

    A choice list becomes a Lark alternation of string literals (JSON escapes, which Lark reads
    the same way), so no choice text is ever read as regex syntax.
    """
    if spec.json is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_OPTIONS)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))


def _first_line(error: str) -> str:
    """llguidance's error message without the parser state it appends (its first line, <= 300 chars)."""
    return (error.strip().splitlines() or [""])[0][:300]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets, in place, ``logits[rows[i], t] = -inf`` for every token ``t`` whose bit is 0 in
    ``bitmask[i]``.

    Args:
        logits: shape = [num_rows, vocab_size], float32 or float64, on the CPU, not requiring grad.
        bitmask: shape = [len(rows), ceil(vocab_size / 32)], int32; bit ``t % 32`` of word
            ``t // 32`` is 1 where token ``t`` is allowed (llguidance's and xgrammar's layout).
        rows: the rows of ``logits`` the bitmask's rows apply to.
    """
    # In numpy, on the tensor's memory: single-threaded, no thread-pool barriers (on a busy 2-core
    # machine, torch's indexing + masked_fill of one 49,152-wide row took 20-40 ms; this takes 0.3).
    words = bitmask.numpy().astype("<i4", copy=False)  # little-endian: byte k holds bits 8k..8k+7
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")  # [len(rows), 32 * num_words]
    values = logits.numpy()  # [num_rows, vocab_size], the same memory
    for k, row in enumerate(rows):
        np.putmask(values[row], bits[k, : values.shape[-1]] == 0, -np.inf)


class StructuredOutputManager:
    """Compiled grammars (cached by constraint) and the matchers of running constrained requests.

    Args:
        tokenizer: the engine's HF tokenizer (a fast one); ``None`` refuses every constraint.
        vocab_size: the model's logits width (tokens past the tokenizer's are never allowed).
        eos_token_ids: the ids that end a text the grammar accepts (the model's EOS tokens).
        max_cached_grammars: distinct constraints kept compiled (least recently used dropped).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 max_cached_grammars: int = MAX_CACHED_GRAMMARS) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_cached_grammars = max_cached_grammars
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built at the first constraint (~0.5 s)
        self._templates: OrderedDict[StructuredOutputsParams, llguidance.LLMatcher] = OrderedDict()
        self._matchers: dict[str, llguidance.LLMatcher] = {}  # request id -> its matcher

    @property
    def num_matchers(self) -> int:
        """Constrained requests holding a matcher now."""
        return len(self._matchers)

    def compile(self, spec: StructuredOutputsParams | None) -> None:
        """Compiles ``spec`` (cached), so the steps that run the request only copy it.

        Raises:
            InvalidInputError: (field ``structured_outputs``) the schema, regex or choices don't
                compile (llguidance's message says why), or the model has no tokenizer.
        """
        if spec is not None:
            self._template(spec)

    def _template(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        template = self._templates.get(spec)
        if template is not None:
            self._templates.move_to_end(spec)
            return template
        tokenizer = self._tokenizer()
        try:
            grammar = grammar_for(spec)
        except ValueError as e:
            raise InvalidInputError("structured_outputs", f"the constraint does not compile: {e}") from None
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidInputError("structured_outputs", f"the constraint does not compile: "
                                                          f"{template.get_error()[:500]}")
        self._check_forced_start(template)
        self._templates[spec] = template
        if len(self._templates) > self.max_cached_grammars:
            self._templates.popitem(last=False)
        return template

    def _check_forced_start(self, template: llguidance.LLMatcher) -> None:
        """Builds the constraint's first masks on a copy, following the tokens it forces (a mask with
        one allowed token) for up to :data:`FORCED_TOKENS_CHECKED` tokens: llguidance checks some
        limits only there (its regex lexer's state count: ``a{1000000}`` fails at its first token),
        and a constraint that allows nothing first (``[^\\s\\S]``, a schema that only refers to itself)
        fails its first mask.

        Raises:
            InvalidInputError: (field ``structured_outputs``) any of those.
        """
        matcher = template.deep_copy()
        bitmask = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        for _ in range(FORCED_TOKENS_CHECKED):
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            if matcher.is_error() or not bool(bitmask.any()):
                break
            allowed = torch.nonzero(bitmask[0]).flatten()
            word = int(bitmask[0, allowed[0]]) & 0xFFFFFFFF if allowed.numel() == 1 else 0
            if word == 0 or word & (word - 1):  # more than one token allowed: nothing forced
                return
            token = 32 * int(allowed[0]) + word.bit_length() - 1
            if token in self.eos_token_ids or not matcher.consume_token(token):
                break
        else:
            return
        if matcher.is_error():
            why = _first_line(matcher.get_error())
            if why == "NoExtensionBias":  # llguidance's name for "no token can come next"
                why = "it matches no text (llguidance: NoExtensionBias)"
            raise InvalidInputError("structured_outputs", f"the constraint does not compile: {why}")
        if not bool(bitmask.any()):
            raise InvalidInputError("structured_outputs", "the constraint matches no text: no token, and not "
                                                          "the end of the text, can come first")

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            if self._hf_tokenizer is None:
                raise InvalidInputError("structured_outputs", "structured output needs the model's tokenizer, "
                                                              "and this model was loaded without one")
            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
            )
        return self._ll_tokenizer

    def mask_logits(self, logits: torch.Tensor, request_ids: Sequence[str],
                    params: Sequence[SamplingParams]) -> tuple[torch.Tensor, dict[str, str]]:
        """Masks, in place, the tokens each constrained row's grammar doesn't allow next.

        A request's matcher is made here at its first sampled token.

        Args:
            logits: shape = [num_rows, vocab_size], float, on the CPU; row ``i`` is sampled for
                ``request_ids[i]`` with ``params[i]``.

        Returns:
            ``logits`` (unconstrained rows untouched), and the requests whose grammar failed here
            (request id → why: llguidance's error, or no token allowed); their rows are left
            unmasked, their tokens are not to be used.
        """
        rows = [i for i, p in enumerate(params) if p.structured_outputs is not None]
        if not rows:
            return logits, {}
        bitmask = torch.zeros(len(rows), (logits.shape[-1] + 31) // 32, dtype=torch.int32)
        failed: dict[str, str] = {}
        for k, i in enumerate(rows):
            rid = request_ids[i]
            matcher = self._matchers.get(rid)
            if matcher is None:
                matcher = self._matchers[rid] = self._template(params[i].structured_outputs).deep_copy()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, k)
            if matcher.is_error() or not bool(bitmask[k].any()):
                why = _first_line(matcher.get_error()) if matcher.is_error() else "no token is allowed next"
                failed[rid] = f"structured output: the grammar of request {rid!r} failed ({why})"
                bitmask[k] = -1  # every token: the row's sample is dropped
        apply_token_bitmask(logits, bitmask, rows)
        return logits, failed

    def accept_tokens(self, request_ids: Sequence[str], params: Sequence[SamplingParams],
                      tokens: Sequence[int], failed: dict[str, str] | None = None) -> dict[str, str]:
        """Advances each constrained request's matcher with the token sampled for it (requests
        already in ``failed``, :meth:`mask_logits`'s report, skipped).

        Returns:
            ``failed`` (or a new dict) with the requests whose matcher refused its token added
            (request id → why).
        """
        failed = {} if failed is None else failed
        for rid, p, token in zip(request_ids, params, tokens):
            if p.structured_outputs is None or rid in failed:
                continue
            if not self._matchers[rid].consume_token(token):
                failed[rid] = (f"structured output: token {token} of request {rid!r} is outside its grammar "
                               f"({_first_line(self._matchers[rid].get_error())})")
        return failed

    def free(self, request_ids: Sequence[str]) -> None:
        """Drops the matchers of finished or aborted requests (unknown ids are ignored)."""
        for rid in request_ids:
            self._matchers.pop(rid, None)
