"""Cache breakers: where a prompt leaves a popular cached chain early, and what text did it.

Block hashes are chained, so one changed token early in a prompt misses every block after it, even
when the rest of the prompt equals a cached chain. A *breaker* is such a change: the prompt diverges
from a chain it shares text with at token ``position`` (block ``position // block_size``), the two
re-align after a short *span* (the request's ``span`` tokens against the chain's ``chain_span``), and
the aligned run after it (``tokens_lost``) is what the prompt would have been served from the cache
had the span been at its end::

    chain:    | shared ... | 2026-11-30 | same system prompt ..........|
    request:  | shared ... | 2026-12-01 | same system prompt .....|....
                           ^ position   ^ re-aligned: tokens_lost = the equal run

The span is classified (:func:`classify_span`) as ``datetime``, ``uuid_hex`` (a UUID or long hex
id), ``number``, ``whitespace`` (text equal up to whitespace, or equal text tokenized differently)
or ``other``. :class:`BreakerTracker` finds breakers against the recent prompts of each namespace
(the chains their blocks cached) and aggregates them; the same code serves a live server (the engine
thread feeds it finished requests) and ``prefixcache analyze`` (a file of prompts).

A request served no cached token at all (a *zero*) is explained in words as well
(:func:`explain_zero`, aggregated by :class:`ZeroHits`): no earlier prompt, nothing shared (the first
token differs), a shared prefix shorter than one block, or a shared prefix whose blocks were not
cached when the request arrived. "queries > 0, hits = 0" then says which.

Invariants: a recorded breaker has ``position < len(request)``, a span found within
``max_span_tokens`` tokens of both sides, and ``tokens_lost >= min_tokens_lost``; a namespace holds at
most ``max_chains`` chains, each at most ``max_chain_tokens`` long, and all namespaces together at most
``max_total_tokens`` tokens. Nothing here leaves a namespace:
a tenant's text is only ever compared with, and reported under, its own namespace.
"""

from __future__ import annotations

import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

DATETIME = "datetime"
UUID_HEX = "uuid_hex"
NUMBER = "number"
WHITESPACE = "whitespace"
OTHER = "other"
BREAKER_CLASSES = (DATETIME, UUID_HEX, NUMBER, WHITESPACE, OTHER)

_MONTHS = "jan|feb|mar|apr|may|jun|jul|aug|sep|sept|oct|nov|dec"
_DAYS = "mon|tue|tues|wed|thu|thur|thurs|fri|sat|sun"
_DATETIME_RE = re.compile(
    r"\d{4}-\d{1,2}-\d{1,2}(?:[T ]\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?"  # ISO 8601
    r"|\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:\s*[AaPp][Mm])?"  # 10:04, 10:04:59.123, 9:05 pm
    r"|\d{1,2}[/.]\d{1,2}[/.]\d{2,4}"  # 30/11/2026, 11.30.26
    rf"|\b(?:{_MONTHS})[a-z]*\.?\s+\d{{1,2}}(?:st|nd|rd|th)?(?:,?\s+\d{{4}})?"  # November 30, 2026
    rf"|\b\d{{1,2}}(?:st|nd|rd|th)?\s+(?:{_MONTHS})[a-z]*\.?(?:\s+\d{{4}})?"  # 30 Nov 2026
    rf"|\b(?:{_DAYS})[a-z]*\b",  # Monday
    re.IGNORECASE,
)
_UUID_HEX_RE = re.compile(
    r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
    r"|(?<![0-9A-Za-z])(?:0x)?(?=[0-9a-fA-F]*[0-9])(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}(?![0-9A-Za-z])"
)
_NUMBER_RE = re.compile(r"\d+(?:[.,]\d+)*")
_SPACES = re.compile(r"\s+")


def classify_span(window: str, start: int, end: int, other_window: str = "", other_start: int = 0,
                  other_end: int = 0) -> str:
    """The class of a differing span of text, seen in its context.

    Args:
        window: the request's text around the span (a few tokens either side).
        start: the span's first character in ``window``.
        end: one past its last character (``start == end`` for an empty span).
        other_window: the chain's text around its own span (same layout), if known.
        other_start: the chain span's first character in ``other_window``.
        other_end: one past its last.

    Returns:
        ``"whitespace"`` if the two spans' texts are equal once whitespace runs are collapsed (or
        equal outright: a tokenization difference); else the first of ``"datetime"``,
        ``"uuid_hex"``, ``"number"`` whose pattern matches text overlapping the span in either
        window; else ``"other"``.
    """
    span, other = window[start:end], other_window[other_start:other_end]
    if _SPACES.sub(" ", span).strip() == _SPACES.sub(" ", other).strip() and (
            span == other or _SPACES.search(span + other)):
        return WHITESPACE
    for name, pattern in ((DATETIME, _DATETIME_RE), (UUID_HEX, _UUID_HEX_RE), (NUMBER, _NUMBER_RE)):
        for text, s, e in ((window, start, end), (other_window, other_start, other_end)):
            if any(m.start() < max(e, s + 1) and m.end() > s for m in pattern.finditer(text)):
                return name
    return OTHER


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Equal leading tokens of ``a`` and ``b`` (binary search over C slice compares)."""
    a_bytes, b_bytes = array("i", a), array("i", b)
    lo, hi = 0, min(len(a_bytes), len(b_bytes))
    while lo < hi:  # invariant: a[:lo] == b[:lo]; the answer is < hi + 1
        mid = (lo + hi + 1) // 2
        if a_bytes[lo:mid] == b_bytes[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def realign(chain: Sequence[int], request: Sequence[int], position: int, max_span_tokens: int,
            anchor_tokens: int) -> tuple[int, int] | None:
    """Where two sequences that differ at ``position`` agree again.

    Returns:
        ``(chain_span, request_span)``, the fewest tokens to skip on each side (smallest sum, then
        smallest request span) after which ``anchor_tokens`` tokens are equal; ``None`` if no such
        pair lies within ``max_span_tokens`` of each side.
    """
    grams: dict[tuple[int, ...], int] = {}
    for i in range(min(max_span_tokens, len(chain) - position - anchor_tokens) + 1):
        grams.setdefault(tuple(chain[position + i : position + i + anchor_tokens]), i)
    best = None
    for j in range(min(max_span_tokens, len(request) - position - anchor_tokens) + 1):
        i = grams.get(tuple(request[position + j : position + j + anchor_tokens]))
        if i is not None and (i, j) != (0, 0) and (best is None or (i + j, j) < (sum(best), best[1])):
            best = (i, j)
    return best


@dataclass(slots=True)
class Breaker:
    """One request's break from a chain.

    Attributes:
        position: the first differing token of the request (= of the chain).
        block: ``position // block_size``.
        kind: the span's class (:data:`BREAKER_CLASSES`).
        span_tokens: the request's differing tokens ``[position, position + span_tokens)``.
        chain_span_tokens: the chain's differing tokens.
        tokens_lost: equal tokens after the span that the chain held (not served: the chain broke).
        chain_id: which chain of the namespace it broke from (the chain's arrival number).
        span_text: the request's differing text; chain_text: the chain's.
    """

    position: int
    block: int
    kind: str
    span_tokens: int
    chain_span_tokens: int
    tokens_lost: int
    chain_id: int
    span_text: str
    chain_text: str


@dataclass(slots=True)
class BreakerGroup:
    """Breakers of one class at one position of one chain, aggregated."""

    namespace: Hashable
    chain_id: int
    position: int
    block: int
    kind: str
    count: int = 0
    tokens_lost: int = 0
    examples: list[tuple[str, str]] = field(default_factory=list)  # (request span, chain span), <= 3

    def to_dict(self, with_text: bool) -> dict:
        out = {"position": self.position, "block": self.block, "kind": self.kind, "count": self.count,
               "tokens_lost": self.tokens_lost}
        if with_text:
            out["examples"] = [{"request": a, "chain": b} for a, b in self.examples]
        return out


@dataclass(slots=True)
class _Chain:
    chain_id: int
    token_ids: array
    uses: int = 1


class BreakerTracker:
    """Finds and aggregates the breakers of each namespace's prompts, against its recent chains.

    Args:
        block_size: tokens per KV block.
        decode: token ids → text (the model's tokenizer; special tokens kept).
        max_chains: recent prompts remembered per namespace (least recently used dropped).
        max_chain_tokens: tokens kept of each remembered prompt.
        max_total_tokens: tokens remembered over all namespaces (least recently used chains
            dropped): bounds the memory, ``4 * max_total_tokens`` bytes, whatever the namespaces.
        max_groups: breaker groups kept; beyond, the half that cost the fewest tokens is dropped
            (the per-class totals keep counting them).
        max_total_tokens: tokens remembered over all namespaces (least recently used chains
            dropped): bounds the memory, ``4 * max_total_tokens`` bytes, whatever the namespaces.
        max_groups: breaker groups kept; beyond, the half that cost the fewest tokens is dropped
            (the per-class totals keep counting them).
        max_span_tokens: a span longer than this on either side is not a breaker (the prompts
            simply differ).
        anchor_tokens: equal tokens that mark the re-alignment after a span.
        min_tokens_lost: a break that cost fewer tokens is not recorded (default one block).
        context_tokens: tokens of context either side of a span, decoded to classify it.
    """

    def __init__(self, block_size: int, decode: Callable[[Sequence[int]], str], *, max_chains: int = 64,
                 max_chain_tokens: int = 4096, max_total_tokens: int = 1 << 21, max_groups: int = 1024,
                 max_span_tokens: int = 64, anchor_tokens: int = 4, min_tokens_lost: int | None = None,
                 context_tokens: int = 24) -> None:
        if min(block_size, max_chains, max_chain_tokens, max_total_tokens, max_groups, max_span_tokens,
               anchor_tokens) < 1:
            raise ValueError("block_size, max_chains, max_chain_tokens, max_total_tokens, max_groups, "
                             "max_span_tokens and anchor_tokens must be >= 1")
        self.block_size = block_size
        self.decode = decode
        self.max_chains = max_chains
        self.max_chain_tokens = max_chain_tokens
        self.max_total_tokens = max_total_tokens
        self.max_groups = max_groups
        self.max_span_tokens = max_span_tokens
        self.anchor_tokens = anchor_tokens
        self.min_tokens_lost = block_size if min_tokens_lost is None else min_tokens_lost
        self.context_tokens = context_tokens
        self._chains: dict[Hashable, OrderedDict[int, _Chain]] = {}
        self._lru: OrderedDict[tuple[Hashable, int], int] = OrderedDict()  # (namespace, chain id) -> tokens
        self._total_tokens = 0
        self._next_id = 0
        self.groups: dict[tuple, BreakerGroup] = {}
        self._kind_totals: dict[Hashable, dict[str, list[int]]] = {}  # namespace -> kind -> [count, lost]
        self.num_observed = 0
        self.num_breakers = 0
        self.tokens_lost = 0
        self.last_chain_id: int | None = None  # the chain the last observed prompt became (None: a prefix of one)
        self.last_match_id: int | None = None  # the chain it was compared with (the longest common prefix)
        self.last_shared_tokens: int | None = None  # that common prefix's length (None: no chain to compare)

    def observe(self, namespace: Hashable, token_ids: Sequence[int]) -> Breaker | None:
        """Compares a prompt with its namespace's chains, records a breaker if it broke from one,
        then remembers the prompt as a chain.

        Args:
            namespace: the prompt's cache namespace (tenant, salt, adapter); never compared across.
            token_ids: the prompt.

        Returns:
            The breaker, or None (no chain to compare with, an exact prefix, or no re-alignment).
        """
        self.num_observed += 1
        chains = self._chains.setdefault(namespace, OrderedDict())
        tokens = array("i", token_ids[: self.max_chain_tokens])
        best, best_len = None, -1
        for chain in chains.values():
            n = common_prefix(chain.token_ids, tokens)
            if n > best_len or (n == best_len and chain.uses > best.uses):
                best, best_len = chain, n
        breaker = self._breaker(best, best_len, tokens) if best is not None else None
        if best is not None and (best_len >= self.block_size or breaker is not None):
            best.uses += 1
            chains.move_to_end(best.chain_id)
            self._lru.move_to_end((namespace, best.chain_id))
        self.last_match_id = best.chain_id if best is not None else None
        self.last_shared_tokens = best_len if best is not None else None
        self.last_chain_id = self._remember(namespace, chains, tokens) if best_len < len(tokens) else None
        if breaker is not None:
            self._record(namespace, breaker)
        return breaker

    def _breaker(self, chain: _Chain, position: int, tokens: array) -> Breaker | None:
        ref = chain.token_ids
        if position >= len(tokens) or position >= len(ref):
            return None
        spans = realign(ref, tokens, position, self.max_span_tokens, self.anchor_tokens)
        if spans is None:
            return None
        chain_span, span = spans
        lost = common_prefix(ref[position + chain_span :], tokens[position + span :])
        if lost < self.min_tokens_lost:
            return None
        text, s, e = self._window(tokens, position, span)
        other, os_, oe = self._window(ref, position, chain_span)
        return Breaker(position, position // self.block_size, classify_span(text, s, e, other, os_, oe), span,
                       chain_span, lost, chain.chain_id, text[s:e], other[os_:oe])

    def _window(self, tokens: Sequence[int], position: int, span: int) -> tuple[str, int, int]:
        """The decoded text around ``tokens[position : position + span]`` and the span's characters in it."""
        lo, hi = max(0, position - self.context_tokens), min(len(tokens), position + span + self.context_tokens)
        left = self.decode(tokens[lo:position])
        middle = self.decode(tokens[lo : position + span])
        return self.decode(tokens[lo:hi]), len(left), len(middle)

    def _remember(self, namespace: Hashable, chains: OrderedDict[int, _Chain], tokens: array) -> int:
        chain_id, self._next_id = self._next_id, self._next_id + 1
        chains[chain_id] = _Chain(chain_id, tokens)
        self._lru[(namespace, chain_id)] = len(tokens)
        self._total_tokens += len(tokens)
        while len(chains) > self.max_chains:
            self._forget(namespace, next(iter(chains)))
        while self._total_tokens > self.max_total_tokens and len(self._lru) > 1:
            self._forget(*next(iter(self._lru)))
        return chain_id

    def _forget(self, namespace: Hashable, chain_id: int) -> None:
        self._total_tokens -= self._lru.pop((namespace, chain_id))
        chains = self._chains[namespace]
        del chains[chain_id]
        if not chains:
            del self._chains[namespace]

    def _record(self, namespace: Hashable, b: Breaker) -> None:
        key = (namespace, b.chain_id, b.position, b.kind)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = BreakerGroup(namespace, b.chain_id, b.position, b.block, b.kind)
        group.count += 1
        group.tokens_lost += b.tokens_lost
        if len(group.examples) < 3:
            group.examples.append((b.span_text, b.chain_text))
        totals = self._kind_totals.setdefault(namespace, {k: [0, 0] for k in BREAKER_CLASSES})[b.kind]
        totals[0] += 1
        totals[1] += b.tokens_lost
        self.num_breakers += 1
        self.tokens_lost += b.tokens_lost
        if len(self.groups) > self.max_groups:
            kept = self.top(self.max_groups // 2)
            self.groups = {(g.namespace, g.chain_id, g.position, g.kind): g for g in kept}
        while len(self._kind_totals) > 4 * self.max_groups:  # the oldest namespaces' totals
            del self._kind_totals[next(iter(self._kind_totals))]

    def top(self, n: int = 10, visible: Callable[[Hashable], bool] = lambda ns: True) -> list[BreakerGroup]:
        """The ``n`` breaker groups that cost the most tokens, among the visible namespaces."""
        groups = [g for g in self.groups.values() if visible(g.namespace)]
        return sorted(groups, key=lambda g: (-g.tokens_lost, -g.count, g.position))[:n]

    def by_kind(self, visible: Callable[[Hashable], bool] = lambda ns: True) -> dict[str, dict[str, int]]:
        """Per class: breakers and tokens lost, among the visible namespaces."""
        out = {kind: {"count": 0, "tokens_lost": 0} for kind in BREAKER_CLASSES}
        for namespace, kinds in self._kind_totals.items():
            if visible(namespace):
                for kind, (count, lost) in kinds.items():
                    out[kind]["count"] += count
                    out[kind]["tokens_lost"] += lost
        return out


# Why a request served no cached token (:func:`explain_zero`).
NO_EARLIER_PROMPT = "no_earlier_prompt"
NOTHING_SHARED = "nothing_shared"
SHORTER_THAN_BLOCK = "shorter_than_block"
WHOLE_PROMPT_ONE_BLOCK = "whole_prompt_one_block"
NOT_CACHED = "not_cached"
ZERO_REASONS = (NO_EARLIER_PROMPT, NOTHING_SHARED, SHORTER_THAN_BLOCK, WHOLE_PROMPT_ONE_BLOCK, NOT_CACHED)


def explain_zero(shared_tokens: int | None, num_prompt_tokens: int, block_size: int) -> tuple[str, str]:
    """Why a prompt served no cached token, from the longest prefix it shares with an earlier prompt
    of its namespace.

    Args:
        shared_tokens: that prefix's length in tokens; ``None`` when no earlier prompt was seen.
        num_prompt_tokens: the prompt's length.
        block_size: tokens per KV block.

    Returns:
        ``(reason, sentence)``: the reason (:data:`ZERO_REASONS`) and what to tell an operator, e.g.
        ``("shorter_than_block", "shared prefix 12 tokens, shorter than one block (16)")``.
    """
    if shared_tokens is None:
        return NO_EARLIER_PROMPT, "nothing shared: no earlier prompt in its cache namespace"
    if shared_tokens == 0:
        return NOTHING_SHARED, "nothing shared: the first token differs from every earlier prompt"
    if shared_tokens < block_size:
        return SHORTER_THAN_BLOCK, f"shared prefix {shared_tokens} tokens, shorter than one block ({block_size})"
    if num_prompt_tokens <= block_size:  # a full block is served only with a token after it to compute
        return WHOLE_PROMPT_ONE_BLOCK, (f"shared prefix {shared_tokens} tokens, but the prompt is one block "
                                        f"({block_size}) and its last token is always computed")
    return NOT_CACHED, (f"shared prefix {shared_tokens} tokens ({shared_tokens // block_size} full blocks), but they "
                        "were not cached when it arrived (evicted, reset, or still being computed)")


class ZeroHits:
    """Requests that served no cached token, per namespace and reason (:func:`explain_zero`).

    Args:
        max_namespaces: namespaces kept (the least recently seen dropped beyond).
    """

    def __init__(self, max_namespaces: int = 4096) -> None:
        self.max_namespaces = max_namespaces
        # namespace -> reason -> [count, prompt tokens, sentence of the latest, sequence number of the latest]
        self._by_namespace: OrderedDict[Hashable, dict[str, list]] = OrderedDict()
        self._seq = 0

    def record(self, namespace: Hashable, shared_tokens: int | None, num_prompt_tokens: int,
               block_size: int) -> str:
        """Counts one request with no cached token; returns its sentence."""
        reason, sentence = explain_zero(shared_tokens, num_prompt_tokens, block_size)
        self._seq += 1
        reasons = self._by_namespace.setdefault(namespace, {})
        self._by_namespace.move_to_end(namespace)
        entry = reasons.setdefault(reason, [0, 0, "", 0])
        entry[0] += 1
        entry[1] += num_prompt_tokens
        entry[2:] = [sentence, self._seq]
        while len(self._by_namespace) > self.max_namespaces:
            self._by_namespace.popitem(last=False)
        return sentence

    def report(self, visible: Callable[[Hashable], bool] = lambda ns: True) -> dict:
        """The visible namespaces' zeros: ``count``, ``by_reason`` (``count``, ``prompt_tokens``,
        ``latest``: the last one's sentence) and ``explanation``: the latest sentence that says more
        than "no earlier prompt" (that one when it is all there is), None without zeros."""
        by_reason: dict[str, dict] = {}
        latest: dict[str, tuple[int, str]] = {}
        for namespace, reasons in self._by_namespace.items():
            if not visible(namespace):
                continue
            for reason, (count, tokens, sentence, seq) in reasons.items():
                entry = by_reason.setdefault(reason, {"count": 0, "prompt_tokens": 0, "latest": sentence})
                entry["count"] += count
                entry["prompt_tokens"] += tokens
                if seq >= latest.get(reason, (0, ""))[0]:
                    latest[reason] = (seq, sentence)
                    entry["latest"] = sentence
        informative = [v for r, v in latest.items() if r != NO_EARLIER_PROMPT] or list(latest.values())
        return {"count": sum(v["count"] for v in by_reason.values()),
                "by_reason": {r: by_reason[r] for r in ZERO_REASONS if r in by_reason},
                "explanation": max(informative)[1] if informative else None}


def explain_zeros(prompts: Sequence[Sequence[int]], num_cached_tokens: Sequence[int], block_size: int) -> dict:
    """:meth:`ZeroHits.report` of a run of prompts in one namespace (the bench's): each prompt that
    served no cached token explained against the prompts before it in ``prompts``.

    Args:
        prompts: the prompts' token ids, in arrival order.
        num_cached_tokens: what each one reported (``cached_tokens``), aligned with ``prompts``.
        block_size: tokens per KV block.
    """
    zeros = ZeroHits()
    for i, (prompt, cached) in enumerate(zip(prompts, num_cached_tokens)):
        if cached == 0:
            shared = max((common_prefix(earlier, prompt) for earlier in prompts[:i]), default=None)
            zeros.record(None, shared, len(prompt), block_size)
    return zeros.report()
