"""Tenant namespaces with approved shared prefixes, at the cache-manager level (exact blocks).

Block size 4; an approved prefix of 10 tokens covers blocks 0 and 1 fully and block 2 partly, so
blocks 0-1 are shared across tenants and block 2 onwards is tenant-keyed.
"""

from __future__ import annotations

import pytest

from prefixcache.engine.tenancy import ApprovedPrefixes, validate_tenant
from tests.cache.cache_test_utils import make_manager, admit, ids, make_request

B = 4
APPROVED = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens of block 2
PRIVATE = [7, 8, 9, 10, 11, 12, 13, 14, 15]
PROMPT = APPROVED + PRIVATE  # 19 tokens, 4 full blocks


def req(rid, tenant, prompt=PROMPT, shared=len(APPROVED) // B):
    return make_request(rid, prompt, block_size=B, tenant=tenant, num_shared_blocks=shared)


def test_tenants_share_the_approved_blocks_and_nothing_after():
    m = make_manager(40, B, enable_partial_block_reuse=True)
    a = req("a", "acme")
    assert admit(m, a)[1] == 0
    m.end_step()  # a's K/V is written: its blocks may now be partial-hit sources
    assert m.get_block_ids("a") == [0, 1, 2, 3, 4]
    b = req("b", "globex")
    hits, num_hit = m.get_computed_blocks(b)
    assert (ids(hits), num_hit) == ([0, 1], 8)
    assert m.get_partial_hit(b, hits) is None  # block 2 is acme's: not even a partial copy
    assert b.block_hashes[:2] == a.block_hashes[:2] and not set(b.block_hashes[2:]) & set(a.block_hashes)
    a2 = req("a2", "acme")
    hits, num_hit = m.get_computed_blocks(a2)
    assert (ids(hits), num_hit) == ([0, 1, 2, 3], 16)
    # A shorter acme prompt gets a partial copy of acme's block 2; globex never does.
    short = APPROVED + PRIVATE[:2]  # 12 tokens: blocks 0-1 hit, tokens 8..10 of block 2 copyable
    hits, _ = m.get_computed_blocks(req("a3", "acme", short))
    partial = m.get_partial_hit(req("a3", "acme", short), hits)
    assert partial is not None and (partial.block.block_id, partial.num_tokens) == (2, 3)
    hits, _ = m.get_computed_blocks(req("b3", "globex", short))
    assert ids(hits) == [0, 1] and m.get_partial_hit(req("b3", "globex", short), hits) is None


def test_requests_without_tenant_reach_only_the_public_blocks():
    m = make_manager(40, B)
    admit(m, req("a", "acme"))
    hits, num_hit = m.get_computed_blocks(req("anon", None))
    assert (ids(hits), num_hit) == ([0, 1], 8)
    # And a tenant never reaches blocks cached without a namespace beyond the approved part.
    admit(m, req("anon", None))
    assert m.get_block_ids("anon") == [0, 1, 5, 6, 7]
    hits, _ = m.get_computed_blocks(req("c", "initech"))
    assert ids(hits) == [0, 1]


def test_no_approved_prefix_means_no_sharing():
    m = make_manager(40, B)
    admit(m, req("a", "acme", shared=0))
    assert m.get_computed_blocks(req("b", "globex", shared=0)) == ([], 0)
    assert m.get_computed_blocks(req("a2", "acme", shared=0))[1] == 16



def test_tenant_key_is_verified_even_under_hash_collision(constant_hash):
    m = make_manager(40, B)
    a = req("a", "acme")
    admit(m, a)
    b = req("b", "globex")
    assert len(set(b.block_hashes) | set(a.block_hashes)) == 1  # every hash collides
    hits, num_hit = m.get_computed_blocks(b)
    assert (ids(hits), num_hit) == ([0, 1], 8)
    admit(m, req("c", "globex", shared=0))  # globex, no approved part: its own chain from block 0
    assert m.get_block_ids("c") == [5, 6, 7, 8, 9]


def test_shared_length_is_the_longest_common_prefix_with_any_approved_prefix():
    approved = ApprovedPrefixes()
    assert approved.shared_length([1, 2, 3]) == 0
    approved.add([1, 2, 3, 4, 5])
    approved.add([1, 2, 9, 9, 9, 9, 9])
    approved.add([1, 2, 3, 4, 5])  # duplicate ignored
    assert len(approved) == 2
    assert approved.shared_length([1, 2, 3, 4, 5, 6, 7]) == 5
    assert approved.shared_length([1, 2, 3, 0]) == 3  # a prefix of public text is public
    assert approved.shared_length([1, 2, 9, 9, 9, 9, 9, 9]) == 7
    assert approved.shared_length([2, 1]) == 0
    with pytest.raises(ValueError, match="must not be empty"):
        approved.add([])


@pytest.mark.parametrize("tenant", ["", "x" * 257, 5, b"acme"])
def test_bad_tenant_names_are_rejected(tenant):
    with pytest.raises(ValueError, match="tenant must be"):
        validate_tenant(tenant)
