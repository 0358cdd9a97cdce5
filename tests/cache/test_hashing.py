"""Chained block hashes: exact chaining, once-per-block extension, seeds across processes."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache import hashing
from prefixcache.cache.hashing import BlockHasher, hash_seed_bytes, make_root_key, pack_token_ids

ROOT = make_root_key(b"model", None, hash_seed_bytes(7))


def test_chain_is_xxh64_of_parent_tokens_extra():
    h = BlockHasher(block_size=2)
    root = h.root_hash(ROOT)
    assert root == xxhash.xxh64_digest(b"root" + ROOT)
    h0 = h.hash_block(root, [1, 2])
    assert h0 == xxhash.xxh64_digest(root + (1).to_bytes(4, "little") + (2).to_bytes(4, "little"))
    assert h.hash_block(root, [1, 2], b"x") != h0


def test_extend_hashes_full_blocks_once_and_equal_prefixes_share():
    h = BlockHasher(block_size=4)
    calls = []
    real = h._digest
    h._digest = lambda data: calls.append(data) or real(data)
    hashes: list = []
    tokens = list(range(10))
    assert h.extend(hashes, tokens, ROOT) == pack_token_ids(range(8)) == struct.pack("<8I", *range(8))
    assert len(hashes) == 2 and len(calls) == 3  # the root, then blocks 0 and 1 (not the partial 2)
    root = h.root_hash(ROOT)
    assert hashes == [h.hash_block(root, [0, 1, 2, 3]), h.hash_block(hashes[0], [4, 5, 6, 7])]
    calls.clear()
    assert h.extend(hashes, tokens + [10], ROOT) == b""  # still no full block 2: nothing hashed
    assert calls == []
    tokens += [10, 11]
    assert h.extend(hashes, tokens, ROOT) == struct.pack("<4I", 8, 9, 10, 11)
    assert len(calls) == 1 and hashes[2] == h.hash_block(hashes[1], [8, 9, 10, 11])
    keyed: list = []
    h.extend(keyed, tokens, ROOT, b"tenant", num_unkeyed_blocks=1)
    assert keyed[0] == hashes[0] and keyed[1] == h.hash_block(keyed[0], [4, 5, 6, 7], b"tenant") != hashes[1]
    other: list = []
    BlockHasher(4).extend(other, list(range(8)) + [99, 99, 99, 99], ROOT)
    assert other[:2] == hashes[:2] and other[2] != hashes[2]


def test_native_chain_is_built():
    # setup.sh's `pip install -e` builds it (setup.py); a machine without a C compiler falls back to
    # the Python loop with the same bytes, but CI must test the form users get.
    assert hashing.NATIVE_CHAIN is not None, "prefixcache/cache/chain_hash.c was not built: pip install -e ."


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_native_xxh64_is_xxhash_byte_for_byte(data):
    from prefixcache.cache._chain_hash import xxh64_digest

    assert xxh64_digest(data) == xxhash.xxh64_digest(data)


def _extend_both_ways(monkeypatch, hasher, steps, **kwargs):
    """Extends one hash list per way (C, Python loop) through the token lists in ``steps`` (a request
    growing by decode); returns both ways' (hashes, packed bytes)."""
    results = []
    for native in (hashing.NATIVE_CHAIN, None):
        monkeypatch.setattr(hashing, "NATIVE_CHAIN", native)
        hashes: list = []
        packed = b"".join(hasher.extend(hashes, tokens, ROOT, **kwargs) for tokens in steps)
        results.append((hashes, packed))
    return results


@settings(max_examples=200, deadline=None)
@given(
    block_size=st.integers(1, 33),
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    cuts=st.lists(st.integers(0, 200), max_size=4),
    extra_key=st.sampled_from([b"", b"tenant\0a", b"k" * 70]),
    num_unkeyed=st.integers(0, 8),
    output_key=st.sampled_from([b"", b"int4-out"]),
    num_prompt=st.integers(0, 200),
)
def test_native_chain_equals_python_loop(block_size, tokens, cuts, extra_key, num_unkeyed, output_key, num_prompt):
    """Every key layout (tenant key from a block on, int4's output key from the first generated token's
    block on) and every split into extend calls: the same hashes and packed bytes both ways."""
    assert hashing.NATIVE_CHAIN is not None
    hasher = BlockHasher(block_size, output_block_key=output_key)
    steps = [tokens[:c] for c in sorted(cuts)] + [tokens]
    with pytest.MonkeyPatch.context() as mp:
        (native, native_bytes), (python, python_bytes) = _extend_both_ways(
            mp, hasher, steps, extra_key=extra_key, num_unkeyed_blocks=num_unkeyed,
            num_prompt_tokens=min(num_prompt, len(tokens)))
    assert len(native) == len(tokens) // block_size
    assert native == python and native_bytes == python_bytes == pack_token_ids(tokens[: len(native) * block_size])


def test_native_chain_takes_numpy_and_torch_integers(monkeypatch):
    """A prompt given as a numpy array or a tensor (LLM.generate lists it) hashes as its ints."""
    import numpy as np
    import torch

    hasher = BlockHasher(2)
    for native in (hashing.NATIVE_CHAIN, None):
        monkeypatch.setattr(hashing, "NATIVE_CHAIN", native)
        ints: list = []
        hasher.extend(ints, [5, 6, 7, 8], ROOT)
        for tokens in (list(np.array([5, 6, 7, 8])), list(torch.tensor([5, 6, 7, 8])), [5, 6, 7, np.uint32(8)]):
            hashes: list = []
            assert hasher.extend(hashes, tokens, ROOT) == pack_token_ids([5, 6, 7, 8]) and hashes == ints


def test_native_chain_hashes_the_tokens_as_they_were_when_called(monkeypatch):
    """A token whose __index__ empties the list (arbitrary Python code runs there): both ways hash the
    tokens as they were at the call (the C form reads a copy; it used to read freed items)."""
    results = []
    for native in (hashing.NATIVE_CHAIN, None):
        monkeypatch.setattr(hashing, "NATIVE_CHAIN", native)
        tokens: list = []

        class Clearing:
            def __index__(self):
                tokens.clear()
                return 1

        tokens += [Clearing()] + list(range(2, 4097))
        hashes: list = []
        results.append((BlockHasher(4).extend(hashes, tokens, ROOT), hashes))
    assert results[0] == results[1] and results[0][0] == pack_token_ids([1] + list(range(2, 4097)))


@pytest.mark.parametrize("start,num_full,block_size", [(2, 4, 2**62), (0, 2, 2**62 + 1), (0, 1, 2**61), (3, 2, 1)])
def test_native_chain_refuses_block_ranges_outside_the_list(start, num_full, block_size):
    """Called directly with sizes whose products overflow (extend never passes them): a ValueError, not
    a read outside the list or uninitialised bytes returned."""
    with pytest.raises(ValueError, match="block range"):
        hashing.NATIVE_CHAIN(b"12345678", [1, 2, 3, 4], start, num_full, block_size, b"", 0, b"", num_full)


@pytest.mark.parametrize("bad,error", [([-1], OverflowError), ([2**32], OverflowError), ([1.5], TypeError)])
def test_native_chain_rejects_what_the_python_loop_rejects(monkeypatch, bad, error):
    hasher = BlockHasher(2)
    for native in (hashing.NATIVE_CHAIN, None):
        monkeypatch.setattr(hashing, "NATIVE_CHAIN", native)
        hashes: list = []
        with pytest.raises(error):
            hasher.extend(hashes, [1, 2, 3] + bad, ROOT)
        assert hashes == []


@pytest.mark.parametrize("algo,size", [("xxh64", 8), ("sha256", 32)])
def test_algos(algo, size):
    hashes: list = []
    BlockHasher(2, algo).extend(hashes, [5, 6, 7, 8], ROOT)
    assert [len(x) for x in hashes] == [size, size]


def test_root_key_separates_every_component():
    seed = hash_seed_bytes(1)
    keys = {
        make_root_key(b"m", None, seed), make_root_key(b"m", "a", seed), make_root_key(b"m", "b", seed),
        make_root_key(b"n", None, seed), make_root_key(b"m", None, hash_seed_bytes(2)),
    }
    assert len(keys) == 5


def _hashes_in_subprocess(seed: int | None) -> str:
    code = (
        "from prefixcache.cache.hashing import BlockHasher, hash_seed_bytes, make_root_key\n"
        f"k = make_root_key(b'model', 'salt', hash_seed_bytes({seed!r}))\n"
        "h = []\nBlockHasher(4).extend(h, list(range(12)), k)\nprint(b''.join(h).hex())\n"
    )
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout


def test_same_hash_seed_same_hashes_across_processes_random_otherwise():
    assert _hashes_in_subprocess(1234) == _hashes_in_subprocess(1234)
    assert _hashes_in_subprocess(None) != _hashes_in_subprocess(None)
    assert _hashes_in_subprocess(1234) != _hashes_in_subprocess(4321)
