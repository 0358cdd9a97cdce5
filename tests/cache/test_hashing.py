"""Chained block hashes: exact chaining, once-per-block extension, seeds across processes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import xxhash

from prefixcache.cache.hashing import BlockHasher, hash_seed_bytes, make_root_key

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
    real = h.hash_block
    h.hash_block = lambda parent, toks, extra=b"": calls.append(tuple(toks)) or real(parent, toks, extra)
    hashes: list = []
    tokens = list(range(10))
    h.extend(hashes, tokens, ROOT)
    assert len(hashes) == 2 and calls == [(0, 1, 2, 3), (4, 5, 6, 7)]
    tokens += [10, 11]
    h.extend(hashes, tokens, ROOT)
    assert len(hashes) == 3 and calls[2:] == [(8, 9, 10, 11)]
    other: list = []
    BlockHasher(4).extend(other, list(range(8)) + [99, 99, 99, 99], ROOT)
    assert other[:2] == hashes[:2] and other[2] != hashes[2]


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
