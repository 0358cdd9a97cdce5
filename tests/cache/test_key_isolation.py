"""Property: requests differing in exactly one cache-key component share no block; equal ones share.

Components: weights/model fingerprint (covers config, tokenizer and chat template files), dtype is
folded into the fingerprint by the engine, hash seed, cache_salt, LoRA adapter digest. Tenant
namespaces will join this list with the server's tenant isolation.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache.hashing import BlockHasher, make_root_key
from prefixcache.cache.kv_cache_manager import KVCacheManager
from prefixcache.engine.request import Request
from prefixcache.sampling_params import SamplingParams

BLOCK = 4
COMPONENTS = ("fingerprint", "salt", "seed", "adapter")
BASE = {"fingerprint": b"weights-v1", "salt": "tenant-a", "seed": b"\x01" * 8, "adapter": b""}
ALTERNATIVES = {"fingerprint": b"weights-v2", "salt": None, "seed": b"\x02" * 8, "adapter": b"lora-digest"}


def request(rid, tokens, key, hash_algo):
    root = make_root_key(key["fingerprint"], key["salt"], key["seed"], key["adapter"])
    return Request(rid, tokens, SamplingParams(temperature=0, max_tokens=4), BlockHasher(BLOCK, hash_algo), root)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50), min_size=BLOCK * 2 + 1, max_size=BLOCK * 6),
    component=st.sampled_from(COMPONENTS + ("none",)),
    hash_algo=st.sampled_from(("xxh64", "sha256")),
)
def test_one_differing_component_shares_nothing(tokens, component, hash_algo):
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK)
    first = request("a", tokens, BASE, hash_algo)
    assert manager.allocate_slots(first, first.num_tokens) is not None
    manager.free(first)
    other_key = dict(BASE)
    if component != "none":
        other_key[component] = ALTERNATIVES[component]
    second = request("b", tokens, other_key, hash_algo)
    hits, num_hit = manager.get_computed_blocks(second)
    if component == "none":
        assert num_hit == (len(tokens) - 1) // BLOCK * BLOCK
    else:
        assert (hits, num_hit) == ([], 0)
        assert not set(second.block_hashes) & set(first.block_hashes)
