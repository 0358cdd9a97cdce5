"""Fixtures shared by the cache tests."""

from __future__ import annotations

import pytest

from prefixcache.cache import hashing


@pytest.fixture
def constant_hash(monkeypatch):
    """Every block and every root hashes to the same value (a forced collision, case C4), for
    every hasher created while the fixture is active."""
    for algo in hashing.HASH_ALGOS:
        monkeypatch.setitem(hashing._DIGESTS, algo, lambda data: b"\0" * 8)
