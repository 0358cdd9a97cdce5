"""The six prefix-sharing workloads, as rounds of token-id prompts.

A workload is a number of rounds; the prompts of a round arrive together, and a round may depend
on the outputs of the rounds before it (``multi-turn`` resends each chat's history, model replies
included). Every other workload is one round.

========== =========================================================== ===================
name       prompts                                                     shared
========== =========================================================== ===================
seed       the demo's ~100-token system prompt + one question each      system prompt
system-    a ~1600-token support policy + one ~150-token customer       system prompt
prompt     message each
few-shot   ~560 tokens of worked word problems + one ~70-token problem  examples
rag-doc    a ~2700-token report + one question about it each            document
multi-turn N chats with the library assistant, one turn per round,      system prompt, and
           each turn resending the whole history                       each chat's history
no-sharing N unrelated plain-text prompts (no chat template)            nothing
========== =========================================================== ===================

``text_scale`` < 1 keeps only that fraction of the words of the long shared texts (policy, worked
examples, report), for quick runs and tests.

When more requests are asked for than there are written texts, the texts repeat with a
``(request k)`` tag in front, so prompts stay distinct.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prefixcache.bench import texts
from prefixcache.bench.accounting import common_prefix_len
from prefixcache.errors import InvalidInputError
from prefixcache.sample_texts import QUESTIONS as SEED_QUESTIONS
from prefixcache.sample_texts import SYSTEM_PROMPT as SEED_SYSTEM_PROMPT

Prompt = list[int]
Message = dict[str, str]
# (round index, outputs of the earlier rounds: per round, per request, token ids) -> the round's prompts
RoundBuilder = Callable[[int, Sequence[Sequence[Sequence[int]]]], list[Prompt]]

WORKLOAD_NAMES = ("seed", "system-prompt", "few-shot", "rag-doc", "multi-turn", "no-sharing")
DEFAULT_NUM_REQUESTS = {"seed": 10, "system-prompt": 6, "few-shot": 6, "rag-doc": 6, "multi-turn": 4,
                        "no-sharing": 6}
DEFAULT_NUM_TURNS = 6
MAX_NUM_TURNS = len(texts.LIBRARY_CHATS[0])


@dataclass(frozen=True)
class Workload:
    """Rounds of prompts.

    Attributes:
        name: one of :data:`WORKLOAD_NAMES`.
        description: one line for the report.
        num_requests: requests per round.
        num_rounds: rounds (1 except for ``multi-turn``).
        build_round: makes round ``k``'s prompts from the earlier rounds' outputs.
        sharing: whether prompts are meant to share a prefix (``no-sharing`` is the 0 % case).
    """

    name: str
    description: str
    num_requests: int
    num_rounds: int
    build_round: RoundBuilder
    sharing: bool = True


def _pick(items: Sequence[str], n: int) -> list[str]:
    """``n`` texts: the written ones in order, then repeats tagged ``(request k)``."""
    return [items[i] if i < len(items) else f"(request {i + 1}) {items[i % len(items)]}" for i in range(n)]


def _static(prompts: list[Prompt]) -> RoundBuilder:
    return lambda k, outputs: prompts


def build_workload(
    name: str,
    tokenizer,
    eos_token_ids: Sequence[int],
    num_requests: int | None = None,
    num_turns: int = DEFAULT_NUM_TURNS,
    text_scale: float = 1.0,
) -> Workload:
    """Builds one workload for a model's tokenizer and chat template.

    Args:
        name: one of :data:`WORKLOAD_NAMES`.
        tokenizer: the model's tokenizer (with a chat template).
        eos_token_ids: where a reply ends, for ``multi-turn``'s history.
        num_requests: requests per round, ``>= 1``; ``None`` = :data:`DEFAULT_NUM_REQUESTS`.
        num_turns: ``multi-turn`` only: turns per chat, 1..:data:`MAX_NUM_TURNS`.
        text_scale: fraction of the long shared texts' words to keep, in (0, 1].

    Raises:
        ValueError: unknown name, ``num_requests < 1``, ``num_turns`` or ``text_scale`` out of range.
    """
    n = check_workload_args(name, num_requests, num_turns, text_scale)

    def scaled(text: str) -> str:
        if text_scale == 1:
            return text
        words = text.split(" ")
        return " ".join(words[: max(1, round(len(words) * text_scale))]) + "\n\n"

    def chat(conversation: list[Message]) -> Prompt:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    def system_chats(system: str, users: list[str]) -> list[Prompt]:
        return [chat([{"role": "system", "content": system}, {"role": "user", "content": u}]) for u in users]

    if name == "seed":
        prompts = system_chats(SEED_SYSTEM_PROMPT, _pick(SEED_QUESTIONS, n))
        return Workload(name, "~100-token system prompt + short library questions (the demo)", n, 1,
                        _static(prompts))
    if name == "system-prompt":
        prompts = system_chats(scaled(texts.SUPPORT_POLICY), _pick(texts.SUPPORT_MESSAGES, n))
        return Workload(name, "~1600-token support policy + ~150-token customer messages", n, 1,
                        _static(prompts))
    if name == "few-shot":
        examples = scaled(texts.FEW_SHOT_EXAMPLES)
        users = [f"{examples}Problem: {q}\nSolution:" for q in _pick(texts.WORD_PROBLEMS, n)]
        prompts = [chat([{"role": "user", "content": u}]) for u in users]
        return Workload(name, "~560 tokens of worked examples + a ~70-token word problem", n, 1, _static(prompts))
    if name == "rag-doc":
        users = [f"Read this report and answer the question below.\n\n{scaled(texts.RAG_DOCUMENT)}\nQuestion: {q}"
                 for q in _pick(texts.RAG_QUESTIONS, n)]
        prompts = [chat([{"role": "user", "content": u}]) for u in users]
        return Workload(name, "one ~2700-token report + a different question each", n, 1, _static(prompts))
    if name == "no-sharing":
        prompts = [tokenizer.encode(t, add_special_tokens=False) for t in _pick(texts.UNRELATED_PROMPTS, n)]
        return Workload(name, "unrelated plain-text prompts (0 % hits expected)", n, 1, _static(prompts),
                        sharing=False)
    return _multi_turn(tokenizer, chat, eos_token_ids, n, num_turns)


def check_workload_args(name: str, num_requests: int | None, num_turns: int, text_scale: float) -> int:
    """Validates :func:`build_workload`'s arguments (before a model is loaded for it); returns the
    number of requests per round.

    Raises:
        InvalidInputError: naming the field (``workload``, ``num_requests``, ``num_turns``,
            ``text_scale``): unknown name, ``num_requests < 1``, ``num_turns`` or ``text_scale`` out of range.
    """
    if name not in WORKLOAD_NAMES:
        raise InvalidInputError("workload", f"workload must be one of {WORKLOAD_NAMES} or 'all', got {name!r}")
    n = DEFAULT_NUM_REQUESTS[name] if num_requests is None else num_requests
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidInputError("num_requests", f"num_requests must be a positive integer, got {n!r}")
    if not 1 <= num_turns <= MAX_NUM_TURNS:
        raise InvalidInputError("num_turns", f"num_turns must be in [1, {MAX_NUM_TURNS}], got {num_turns}")
    if not 0 < text_scale <= 1:
        raise InvalidInputError("text_scale", f"text_scale must be in (0, 1], got {text_scale}")
    return n


def _multi_turn(tokenizer, chat: Callable[[list[Message]], Prompt], eos_token_ids: Sequence[int], n: int,
                num_turns: int) -> Workload:
    """``n`` library chats; round ``k`` resends each chat's history with the replies so far."""
    chats = [texts.LIBRARY_CHATS[i % len(texts.LIBRARY_CHATS)] for i in range(n)]
    openers = _pick([c[0] for c in texts.LIBRARY_CHATS], n)  # tags repeated chats apart
    eos = frozenset(eos_token_ids)

    def build(k: int, outputs: Sequence[Sequence[Sequence[int]]]) -> list[Prompt]:
        prompts = []
        for i in range(n):
            conv = [{"role": "system", "content": SEED_SYSTEM_PROMPT}]
            for turn in range(k + 1):
                conv.append({"role": "user", "content": openers[i] if turn == 0 else chats[i][turn]})
                if turn < k:
                    conv.append({"role": "assistant", "content": _reply_text(tokenizer, outputs[turn][i], eos)})
            prompts.append(chat(conv))
        return prompts

    return Workload("multi-turn", f"{n} library chats x {num_turns} turns, each turn resending the history",
                    n, num_turns, build)


def _reply_text(tokenizer, token_ids: Sequence[int], eos: frozenset[int]) -> str:
    """What a chat client shows and sends back: the reply up to its first EOS."""
    ids = list(token_ids)
    for i, t in enumerate(ids):
        if t in eos:
            ids = ids[:i]
            break
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


# ---------------------------------------------------------------------------------------- speed

SPEED_PREFIX_TOKENS = 2032  # the shared system prompt, in tokens
# Words the speed workload's system prompt is cut from: the support policy, then (for prefixes longer
# than the policy) the report, as background reading.
_SPEED_SYSTEM_TEXT = texts.SUPPORT_POLICY + "\nBackground reading, for context only:\n\n" + texts.RAG_DOCUMENT
_LONG_TEXT = texts.RAG_DOCUMENT + "\n" + texts.SUPPORT_POLICY + "\n" + texts.FEW_SHOT_EXAMPLES


@dataclass(frozen=True)
class SpeedPrompts:
    """The prompts of ``prefixcache bench --workload speed`` (see :mod:`prefixcache.bench.speed`).

    Attributes:
        shared: a ~``prefix_tokens``-token system prompt + one customer message each (chat template).
        prefix_tokens: tokens every prompt of ``shared`` starts with (capped one short of the shortest).
        short: the demo's system prompt + its first question: single-sequence decode.
        long: exactly the asked number of plain-text tokens (long-context prefill), or None.
    """

    shared: list[Prompt]
    prefix_tokens: int
    short: Prompt
    long: Prompt | None


def build_speed_prompts(tokenizer, num_requests: int, prefix_tokens: int = SPEED_PREFIX_TOKENS,
                        long_tokens: int | None = None) -> SpeedPrompts:
    """Builds the speed workload's prompts for a model's tokenizer and chat template.

    The system prompt is the longest word prefix of the support policy (then the report) whose
    chat-templated prompts share at most ``prefix_tokens`` tokens (binary search over words).

    Args:
        tokenizer: the model's tokenizer (with a chat template).
        num_requests: customer messages over the shared system prompt, ``>= 1``.
        prefix_tokens: target length of the shared prefix, ``>= 1``.
        long_tokens: length of the long plain-text prompt; None: none.

    Raises:
        ValueError: a size out of range.
    """
    for name, v in (("num_requests", num_requests), ("prefix_tokens", prefix_tokens),
                    ("long_tokens", 1 if long_tokens is None else long_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")

    def chat(system: str, user: str) -> Prompt:
        conv = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    def prefix_len(system: str) -> int:
        return common_prefix_len([chat(system, "Hello."), chat(system, "Thanks!")])

    words = _SPEED_SYSTEM_TEXT.split(" ")
    lo, hi = 1, len(words)  # the largest word count whose prefix fits (at least one word)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if prefix_len(" ".join(words[:mid])) <= prefix_tokens else (lo, mid - 1)
    system = " ".join(words[:lo])
    shared = [chat(system, m) for m in _pick(texts.SUPPORT_MESSAGES, num_requests)]
    n_prefix = min(common_prefix_len(shared), min(map(len, shared)) - 1)
    short = chat(SEED_SYSTEM_PROMPT, SEED_QUESTIONS[0])
    long = None
    if long_tokens is not None:
        ids = tokenizer.encode(_LONG_TEXT, add_special_tokens=False)
        long = (ids * (long_tokens // len(ids) + 1))[:long_tokens]
    return SpeedPrompts(shared, n_prefix, short, long)
