"""Fixtures shared by the cache tests."""

from __future__ import annotations

import pytest

from prefixcache.cache.hashing import BlockHash, BlockHasher


@pytest.fixture
def constant_hash(monkeypatch):
    """Every block and every root hashes to the same value (a forced collision, case C4)."""
    constant = BlockHash(b"\0" * 8)
    monkeypatch.setattr(BlockHasher, "hash_block", lambda self, parent, tokens, extra=b"": constant)
    monkeypatch.setattr(BlockHasher, "root_hash", lambda self, root_key: constant)
