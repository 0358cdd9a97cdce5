"""The theoretical hit rate of a workload: what an unbounded prefix cache would serve, request by request.

Definition (the one ``prefixcache bench --workload field`` reports): prompts are taken in the order they were
sent; request ``i``'s theoretical hit is the longest common prefix, in tokens, of its prompt's token ids with any
earlier prompt's, capped at ``len(prompt_i) - 1`` because the last prompt token is always computed (it yields the
first output token's logits). The rate is the sum of those hits over the sum of prompt lengths.

Counted in tokens, not whole blocks, because our hits are: ``cached_tokens`` adds up full blocks and the
partial-block copies (a request whose match ends inside a cached block copies the matching slots), so the
measured hit count of a run that fits the pool reaches this bound whenever every earlier prompt's blocks were
still cached (and filled: only full blocks are cached, so a match reaching into an earlier prompt's unfilled
last block can fall short of it by less than one block). ``block_size`` gives the whole-block variant, for a
server that reuses full blocks only (vLLM's default): each hit rounded down to a multiple of the block size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def longest_earlier_prefixes(prompts: Iterable[Sequence[int]], warm: Iterable[Sequence[int]] = ()) -> list[int]:
    """For each prompt, in order, the length of its longest common prefix with any earlier prompt or with any
    of ``warm`` (prompts sent before the measured ones, e.g. a tool's warm-up request on a cache not flushed).

    Returns:
        one int per prompt, ``0 <= lcp[i] <= len(prompts[i])``.

    Raises:
        ValueError: a prompt that is not a sequence of ints (naming its index).
    """
    return _lcps(_token_lists(prompts, "prompts"), _token_lists(warm, "warm"))


def theoretical_hits(prompts: Iterable[Sequence[int]], warm: Iterable[Sequence[int]] = (),
                     block_size: int | None = None) -> list[int]:
    """Each prompt's theoretical hit in tokens: ``min(lcp, len - 1)`` (module docstring), rounded down to a
    multiple of ``block_size`` when given.

    Raises:
        ValueError: an empty prompt (naming its index), a bad token id, or ``block_size`` < 1.
    """
    return _hits(*_checked(prompts, warm, block_size))


def theoretical_hit_rate(prompts: Iterable[Sequence[int]], warm: Iterable[Sequence[int]] = (),
                         block_size: int | None = None) -> float:
    """Σ :func:`theoretical_hits` ÷ Σ prompt lengths (0.0 for no prompts).

    Raises:
        ValueError: as :func:`theoretical_hits`.
    """
    prompts, warm, block_size = _checked(prompts, warm, block_size)
    total = sum(len(p) for p in prompts)
    return sum(_hits(prompts, warm, block_size)) / total if total else 0.0


def _checked(prompts: Iterable[Sequence[int]], warm: Iterable[Sequence[int]],
             block_size: int | None) -> tuple[list[list[int]], list[list[int]], int | None]:
    """The public functions' arguments validated, once: the lists of token ids, and ``block_size``."""
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    prompts = _token_lists(prompts, "prompts")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompts[{i}] is empty: every request has at least one prompt token")
    return prompts, _token_lists(warm, "warm"), block_size


def _token_lists(seqs: Iterable[Sequence[int]], kind: str) -> list[list[int]]:
    """``seqs`` as lists of ints.

    Raises:
        ValueError: a token id that is not an int (bool excluded), naming ``kind`` and the list's index.
    """
    out = []
    for i, seq in enumerate(seqs):
        tokens = list(seq)
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"{kind}[{i}]: token ids must be ints, got {type(t).__name__} {t!r}")
        out.append(tokens)
    return out


def _lcps(prompts: list[list[int]], warm: list[list[int]]) -> list[int]:
    """:func:`longest_earlier_prefixes` on validated lists. A trie over token ids: every path from the root
    spells a prefix of some inserted prompt, so the depth a prompt's walk reaches before leaving the trie is
    exactly its longest shared prefix; O(total tokens)."""
    root: dict = {}

    def walk_and_insert(tokens: list[int]) -> int:
        node, depth = root, 0
        for t in tokens:
            child = node.get(t)
            if child is None:
                break
            node, depth = child, depth + 1
        for t in tokens[depth:]:
            node = node.setdefault(t, {})
        return depth

    for w in warm:
        walk_and_insert(w)
    return [walk_and_insert(p) for p in prompts]


def _hits(prompts: list[list[int]], warm: list[list[int]], block_size: int | None) -> list[int]:
    """:func:`theoretical_hits` on validated arguments (non-empty prompts)."""
    hits = [min(lcp, len(p) - 1) for lcp, p in zip(_lcps(prompts, warm), prompts)]
    if block_size:
        hits = [h // block_size * block_size for h in hits]
    return hits
