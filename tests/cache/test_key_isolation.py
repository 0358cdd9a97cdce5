"""Property: requests differing in exactly one cache-key component share no block; equal ones share.

Components: weights/model fingerprint (covers config, tokenizer and chat template files), dtype is
folded into the fingerprint by the engine, hash seed, cache_salt, LoRA adapter digest, tenant
namespace. With an approved shared prefix, two tenants share exactly the full blocks inside it.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache.hashing import BlockHasher, make_root_key, tenant_extra_key
from tests.cache.cache_test_utils import make_manager
from prefixcache.request import Request
from prefixcache.sampling_params import SamplingParams

BLOCK = 4
COMPONENTS = ("fingerprint", "salt", "seed", "adapter", "tenant")
BASE = {"fingerprint": b"weights-v1", "salt": "salt-a", "seed": b"\x01" * 8, "adapter": b"", "tenant": "acme"}
ALTERNATIVES = {"fingerprint": b"weights-v2", "salt": None, "seed": b"\x02" * 8, "adapter": b"lora-digest",
                "tenant": "globex"}


def request(rid, tokens, key, hash_algo, num_shared_blocks=0):
    root = make_root_key(key["fingerprint"], key["salt"], key["seed"], key["adapter"])
    return Request(rid, tokens, SamplingParams(temperature=0, max_tokens=4), BlockHasher(BLOCK, hash_algo), root,
                   tenant_key=tenant_extra_key(key["tenant"]), num_shared_blocks=num_shared_blocks)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50), min_size=BLOCK * 2 + 1, max_size=BLOCK * 6),
    component=st.sampled_from(COMPONENTS + ("none",)),
    hash_algo=st.sampled_from(("xxh64", "sha256")),
)
def test_one_differing_component_shares_nothing(tokens, component, hash_algo):
    manager = make_manager(32, BLOCK)
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


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50), min_size=BLOCK * 2 + 1, max_size=BLOCK * 6),
    approved_len=st.integers(0, BLOCK * 7),
    hash_algo=st.sampled_from(("xxh64", "sha256")),
)
def test_two_tenants_share_exactly_the_approved_full_blocks(tokens, approved_len, hash_algo):
    """The prompt's first ``approved_len`` tokens are approved: both tenants share its full blocks
    (as far as the last-token cap allows) and nothing after them."""
    num_shared = min(approved_len, len(tokens)) // BLOCK
    manager = make_manager(32, BLOCK)
    first = request("a", tokens, BASE, hash_algo, num_shared)
    assert manager.allocate_slots(first, first.num_tokens) is not None
    manager.free(first)
    second = request("b", tokens, {**BASE, "tenant": "globex"}, hash_algo, num_shared)
    hits, num_hit = manager.get_computed_blocks(second)
    expected = min(num_shared, (len(tokens) - 1) // BLOCK)
    assert num_hit == expected * BLOCK
    assert hits == manager.block_pool.blocks[:expected]  # the first request's blocks 0, 1, ...
    assert second.block_hashes[:num_shared] == first.block_hashes[:num_shared]
    assert not set(second.block_hashes[num_shared:]) & set(first.block_hashes)


def test_no_tenant_name_spells_another_tenants_output_key():
    """Case from review: int4 appends its output key to a tenant's key on blocks holding generated
    tokens. With the name's length in the tenant key, a tenant named "x" + output key can't get the
    key of tenant x's output blocks on its prompt blocks (it did: a cross-tenant hit)."""
    from prefixcache.layers.quant import INT4_OUTPUT_KEY

    m = make_manager(16, BLOCK)
    root = make_root_key(b"m")
    params = SamplingParams(max_tokens=16, temperature=0)
    x = Request("x", [11, 12], params, BlockHasher(BLOCK, output_block_key=INT4_OUTPUT_KEY), root,
                tenant_key=tenant_extra_key("x"))
    m.allocate_slots(x, 2)
    x.num_computed_tokens = 2
    for token in (13, 14, 15):  # x's generated tokens fill block 0 (generation from slot 2)
        x.append_output_token_ids(token)
        m.allocate_slots(x, 1)
        x.num_computed_tokens += 1
    assert m.req_to_num_cached_blocks["x"] == 1
    m.free(x)
    evil = "x" + INT4_OUTPUT_KEY.decode() + "\x02\x00\x00\x00"
    other = Request("o", [11, 12, 13, 14, 99], params, BlockHasher(BLOCK, output_block_key=INT4_OUTPUT_KEY), root,
                    tenant_key=tenant_extra_key(evil))
    assert m.get_computed_blocks(other) == ([], 0)
    # x's own tokens as a new 5-token prompt: computed by the prompt kernels, so no hit either.
    again = Request("x2", x.all_token_ids, params, BlockHasher(BLOCK, output_block_key=INT4_OUTPUT_KEY), root,
                    tenant_key=tenant_extra_key("x"))
    assert m.get_computed_blocks(again) == ([], 0)


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=256), st.binary(max_size=40))
def test_the_tenant_is_read_back_from_any_block_key(name, output_key):
    """tenant_of_extra_key undoes tenant_extra_key, an output key after it or not (the dashboard
    shows a tenant's int4 output blocks under its name)."""
    from prefixcache.cache.hashing import tenant_of_extra_key

    name = name.encode("utf-8", "replace").decode("utf-8")  # valid UTF-8 (validate_tenant's rule)
    assert tenant_of_extra_key(tenant_extra_key(name) + output_key) == name
    assert tenant_of_extra_key(output_key) is None or output_key.startswith(b"tenant\0")
    assert tenant_of_extra_key(b"") is None
