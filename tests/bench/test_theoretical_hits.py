"""The exact theoretical hit rate: longest prefix shared with any earlier prompt, token ids in, known answers out."""

from __future__ import annotations

import random

import pytest

from prefixcache.bench.theoretical_hits import longest_earlier_prefixes, theoretical_hit_rate, theoretical_hits


def _brute_force(prompts, warm=()):
    """max over earlier prompts of the common prefix, by direct comparison."""
    seen, out = [list(w) for w in warm], []
    for p in prompts:
        best = 0
        for q in seen:
            k = 0
            while k < min(len(p), len(q)) and p[k] == q[k]:
                k += 1
            best = max(best, k)
        out.append(best)
        seen.append(list(p))
    return out


def test_longest_prefix_is_taken_over_every_earlier_prompt_not_just_the_last():
    a = [1, 2, 3, 4, 5, 6]
    b = [1, 2, 9, 9]          # shares 2 with a
    c = [1, 2, 3, 4, 7]       # shares 4 with a (the earlier, not the latest, prompt)
    d = [8, 1, 2, 3]          # shares nothing: the first token differs
    e = [1, 2, 9, 9, 5]       # shares 4 with b
    assert longest_earlier_prefixes([a, b, c, d, e]) == [0, 2, 4, 0, 4]


def test_hits_are_capped_one_short_of_the_prompt_because_the_last_token_is_computed():
    # a repeated prompt hits all but its last token; a prompt that is a prefix of an earlier one, likewise
    assert theoretical_hits([[5, 6, 7], [5, 6, 7], [5, 6]]) == [0, 2, 1]
    assert theoretical_hits([[5], [5]]) == [0, 0]
    # one that extends an earlier prompt hits all of the earlier one
    assert theoretical_hits([[5, 6], [5, 6, 7, 8]]) == [0, 2]


def test_rate_is_tokens_hit_over_prompt_tokens():
    prefix = list(range(100, 132))  # a 32-token shared prefix
    prompts = [prefix + [1, 2, 3, 4], prefix + [5, 6, 7, 8], prefix + [1, 2, 9, 9], [7] * 36]
    assert theoretical_hits(prompts) == [0, 32, 34, 0]
    assert theoretical_hit_rate(prompts) == pytest.approx(66 / 144)


def test_whole_block_variant_rounds_each_hit_down_to_the_block_size():
    prefix = list(range(100, 132))
    prompts = [prefix + [1, 2, 3, 4], prefix + [1, 2, 9, 9], prefix[:20] + [0] * 10]
    assert theoretical_hits(prompts) == [0, 34, 20]
    assert theoretical_hits(prompts, block_size=16) == [0, 32, 16]
    assert theoretical_hit_rate(prompts, block_size=16) == pytest.approx(48 / 102)


def test_warm_prompts_count_as_earlier_but_are_not_measured():
    warm = [[1, 2, 3, 4, 5]]
    assert theoretical_hits([[1, 2, 3, 9], [1, 2, 3, 9]], warm=warm) == [3, 3]
    assert theoretical_hit_rate([[1, 2, 3, 9]], warm=warm) == pytest.approx(3 / 4)


def test_trie_agrees_with_brute_force_on_random_prompts():
    rng = random.Random(7)
    for _ in range(50):
        stems = [[rng.randrange(4) for _ in range(rng.randrange(0, 12))] for _ in range(3)]
        prompts = [rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randrange(1, 8))] for _ in range(12)]
        warm = prompts[:2]
        assert longest_earlier_prefixes(prompts[2:], warm) == _brute_force(prompts[2:], warm)


def test_bad_input_names_the_prompt():
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        theoretical_hits([[1], []])
    with pytest.raises(ValueError, match=r"prompts\[0\]: token ids must be ints"):
        theoretical_hits([[1, "a"]])
    with pytest.raises(ValueError, match="block_size"):
        theoretical_hits([[1]], block_size=0)
    with pytest.raises(ValueError, match=r"prompts\[1\]: token ids must be ints, got float 2.0"):
        theoretical_hit_rate([[1, 2], [1, 2.0]])  # equal to an earlier prompt's token 2, still refused
    with pytest.raises(ValueError, match=r"warm\[0\]: token ids must be ints, got bool True"):
        longest_earlier_prefixes([[1]], warm=[[True]])
    assert theoretical_hit_rate([]) == 0.0
