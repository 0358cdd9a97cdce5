"""Partial-block reuse and KV events for a model with several KV-cache groups (tiny random Gemma 3).

Partial hits: a prompt whose cached prefix ends inside a block past the window gets the block's
leading slots copied in every group (the full group's and each sliding group's block of that
position), counted in ``num_cached_tokens``, with cache-off's greedy tokens and logits bits; a group
without that block means no partial hit (manager-level, hand-computed block ids).

KV events: the stream holds group 0's hashes only, equal to the pool's group-0 set after every step,
and a router counting the published blocks of a shared prefix predicts the engine's hit while the
sliding groups' retained windows are there; a sliding block evicted alone publishes nothing and the
hit falls short of the count.

The model is test_gemma3_engine.py's: 6 layers (local local global) x 2, window 8, blocks of 4:
group 0 = full {2, 5}, groups 1 and 2 = sliding {0, 1} and {3, 4}.
"""

from __future__ import annotations

import json

import pytest
import torch
from model_testlib import GEMMA3_BLOCK_SIZE as B
from model_testlib import GEMMA3_PREFIX as PREFIX
from model_testlib import GEMMA3_TAILS as TAILS
from model_testlib import GEMMA3_WINDOW as W
from model_testlib import greedy, load_engine_gemma3
from model_testlib import make_gemma3_engine as make_engine
from model_testlib import token_ids as ids

from prefixcache.cache.config import CacheConfig
from prefixcache.cache.kv_cache_groups import AttentionKind, LayerSpec, group_block_hash, make_kv_cache_groups
from prefixcache.cache.kv_cache_manager import KVCacheManager, PartialHit
from prefixcache.cache.kv_events import external_block_hash
from prefixcache.kernels.prefill_attention import form_supported
from prefixcache.layers.attention.metadata import torch_attention_batch_invariant
from prefixcache.request import Request
from prefixcache.scheduler_output import CopyOp
from tests.cache.cache_test_utils import make_request


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Our loaded tiny Gemma 3 (model_testlib's engine-test checkpoint, test_gemma3_engine.py's), with the
    default model's tokenizer files beside the weights (the engine decodes what it generates; ids stay < 256)."""
    return load_engine_gemma3(tmp_path_factory.mktemp("tiny-gemma3-partial"))


class Recorder:
    """Wraps an engine's runner and the model's ``compute_logits``: every step's copy ops (with the
    block tables the runner gets then) and every logits row computed, in order."""

    def __init__(self, engine, monkeypatch) -> None:
        self.engine, self.copies, self.logits = engine, [], []
        execute, model = engine.runner.execute_model, engine.runner.model
        compute = model.compute_logits

        def execute_model(out):
            if out.copy_ops:
                tables = {s.request_id: engine.kv_cache_manager.get_group_block_ids(s.request_id) for s in out.seqs}
                self.copies.append((list(out.copy_ops), tables))
            return execute(out)

        def compute_logits(hidden):
            logits = compute(hidden)
            self.logits.append(logits.detach().clone())
            return logits

        monkeypatch.setattr(engine.runner, "execute_model", execute_model)
        monkeypatch.setattr(model, "compute_logits", compute_logits)

    def run(self, prompt: list[int], max_tokens: int = 6):
        """One request to completion: (its output, its logits rows)."""
        self.logits = []
        rid = self.engine.add_request(prompt, greedy(max_tokens))
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id == rid:
                    return out, list(self.logits)  # a later engine's steps may append to self.logits
        raise AssertionError("no output")


def cached_block(engine, tokens: list[int], index: int, group_id: int):
    """The cached block of ``group_id`` holding ``tokens``' block ``index``."""
    want = tuple(tokens[index * B:(index + 1) * B])
    (block,) = [b for b in engine.kv_cache_manager.block_pool.blocks
                if b.group_id == group_id and b.block_hash is not None and b.token_ids == want]
    return block


# B shares A's 43-token prompt up to token 30: blocks 0-6 (28 tokens, past the window of 8) and 2
# tokens of block 7; its token 30 differs from A's.
# Gemma 3 runs torch's padded attention where that is batch-invariant (MKL's AVX-512 path), else our paged kernel's
# AVX2 form (sliding windows, float32 pools), bit-exact by construction; with neither, cache on / off agree only
# to float rounding (the engine logs it at start-up)
BATCH_INVARIANT_ATTENTION = pytest.mark.skipif(
    not (form_supported("avx2") or torch_attention_batch_invariant()),
    reason="no form of our paged kernel runs here, and torch's attention kernels on this CPU are not batch-invariant")
A_PROMPT = PREFIX + TAILS[0]
B_PROMPT = PREFIX[:30] + [PREFIX[30] % 250 + 3] + ids(6, seed=30)


@BATCH_INVARIANT_ATTENTION
def test_a_prefix_ending_inside_a_block_past_the_window_is_copied_in_every_group(loaded, monkeypatch):
    assert B_PROMPT[30] != PREFIX[30]
    on = make_engine(loaded)
    rec = Recorder(on, monkeypatch)
    first, _ = rec.run(A_PROMPT)
    assert first.num_cached_tokens == 0 and rec.copies == []
    sources = [cached_block(on, PREFIX, 7, g) for g in (0, 1, 2)]  # A's block 7 (tokens 28-31), each group
    second, logits_on = rec.run(B_PROMPT)
    # 7 full blocks (the sliding groups' hit needs blocks 5-6: [21, 28)) + tokens 28-29 copied
    assert second.num_cached_tokens == 30
    ((ops, tables),) = rec.copies
    b_tables = tables[second.request_id]
    assert ops == [CopyOp(src.block_id, b_tables[g][7], 2) for g, src in enumerate(sources)]
    assert len({op.dst_block_id for op in ops}) == 3
    snapshot = on.kv_cache_manager.make_snapshot()
    assert (snapshot.prefix_cache_hits, snapshot.prefix_cache_partial_hits) == (30, 2)

    off = make_engine(loaded, enable_prefix_caching=False)
    off_rec = Recorder(off, monkeypatch)
    off_rec.run(A_PROMPT)
    cold, logits_off = off_rec.run(B_PROMPT)
    assert cold.num_cached_tokens == 0
    assert second.token_ids == cold.token_ids
    assert len(logits_on) == len(logits_off) == 6
    assert all(torch.equal(x, y) for x, y in zip(logits_on, logits_off))  # every bit of every step

    no_partial = make_engine(loaded, enable_partial_block_reuse=False)
    run = Recorder(no_partial, monkeypatch).run
    run(A_PROMPT)
    assert run(B_PROMPT)[0].num_cached_tokens == 28


@BATCH_INVARIANT_ATTENTION
def test_no_partial_hit_when_a_sliding_group_lacks_the_block(loaded, monkeypatch):
    """A's block 7 of sliding group 2 evicted alone: groups 0 and 1 still hold theirs and the full
    hit (28 tokens, window blocks 5-6) is whole, but the partial hit needs every group's block."""
    engine = make_engine(loaded)
    rec = Recorder(engine, monkeypatch)
    rec.run(A_PROMPT)
    engine.kv_cache_manager.block_pool.uncache([cached_block(engine, PREFIX, 7, 2)], reason="test")
    out, logits = rec.run(B_PROMPT)
    assert out.num_cached_tokens == 28 and rec.copies == []
    off = make_engine(loaded, enable_prefix_caching=False)
    cold, cold_logits = Recorder(off, monkeypatch).run(B_PROMPT)
    assert out.token_ids == cold.token_ids
    assert all(torch.equal(x, y) for x, y in zip(logits, cold_logits))


# -- the group rule, manager-level ----------------------------------------------------------------

HYBRID = make_kv_cache_groups([LayerSpec(AttentionKind.FULL), LayerSpec(AttentionKind.SLIDING, W)] * 3)


def manager_after_a() -> tuple[KVCacheManager, Request]:
    """A 40-block pool (group 0 = full, group 1 = sliding, window 8) after request a's 24 tokens
    (blocks 0-5 of each group) were computed and freed: every block cached."""
    kv = KVCacheManager(40, CacheConfig(block_size=B), kv_cache_groups=HYBRID)
    a = make_request("a", list(range(24)), B)
    admission = kv.admit(a, a.num_tokens)
    a_ids = kv.get_group_block_ids("a")
    assert admission.num_hit_tokens == 0 and a_ids == [list(range(6)), list(range(6, 12))]
    kv.end_step()
    a.num_computed_tokens = 24
    kv.remove_skipped_blocks(a)
    kv.free(a)
    return kv, a


def test_manager_partial_hit_takes_every_groups_block_of_the_position():
    kv, _ = manager_after_a()
    b = make_request("b", list(range(18)) + [99, 98, 97], B)  # blocks 0-3 equal a's, then 16, 17 of block 4
    admission = kv.admit(b, b.num_tokens)
    assert (admission.num_hit_tokens, admission.num_partial_tokens, b.num_cached_tokens) == (16, 2, 18)
    b_ids = kv.get_group_block_ids("b")
    # group 0's hits 0-3 and new blocks; group 1: null before the window [9, 16), a's 8-9, new blocks
    assert b_ids[1][:4] == [0, 0, 8, 9]
    assert kv.pending_copy_ops == [CopyOp(4, b_ids[0][4], 2), CopyOp(10, b_ids[1][4], 2)]
    pool = kv.block_pool
    assert pool.blocks[4].ref_cnt == pool.blocks[10].ref_cnt == 1  # pinned until the copy is done
    kv.end_step()
    assert pool.blocks[4].ref_cnt == pool.blocks[10].ref_cnt == 0 and kv.pending_copy_ops == []


def test_manager_no_partial_hit_without_a_sliding_groups_block_or_after_a_cut():
    kv, _ = manager_after_a()
    kv.block_pool.uncache([kv.block_pool.blocks[10]], reason="test")  # group 1's block 4
    c = make_request("c", list(range(18)) + [95, 94, 93], B)
    assert kv.get_partial_hit(c, kv.get_computed_blocks(c)[0]) is None
    admission = kv.admit(c, c.num_tokens)
    assert (admission.num_hit_tokens, admission.num_partial_tokens) == (16, 0) and kv.pending_copy_ops == []

    kv, _ = manager_after_a()
    kv.block_pool.uncache([kv.block_pool.blocks[9]], reason="test")  # group 1's block 3: the window at 16
    d = make_request("d", list(range(18)) + [91, 90, 89], B)
    hits, _ = kv.get_computed_blocks(d)
    assert len(hits) == 4 and kv.get_partial_hit(d, hits).num_tokens == 2  # group 0's view: 16 + 2
    admission = kv.admit(d, d.num_tokens)  # the rule cuts to blocks 1-2's window, 12 tokens: no partial
    assert (admission.num_hit_tokens, admission.num_partial_tokens) == (12, 0) and kv.pending_copy_ops == []


def test_manager_refuses_a_partial_hit_without_the_groups_blocks():
    kv, _ = manager_after_a()
    e = make_request("e", list(range(18)) + [87, 86, 85], B)
    hits, num_hit = kv.get_computed_blocks(e)
    hits, group_hits = kv._hybrid_hits(e, hits)
    with pytest.raises(ValueError, match="partial_hit.group_blocks must hold 1 blocks"):
        kv.allocate_slots(e, 3, hits, num_hit, PartialHit(kv.block_pool.blocks[4], 2), group_hits)
    assert "e" not in kv.req_to_blocks and kv.pending_copy_ops == []


# -- KV events ------------------------------------------------------------------------------------

def group0_hashes(pool) -> set[int]:
    """The pool's group-0 hashes in the published form."""
    return {external_block_hash(h) for h, blocks in pool.cached_block_hash_to_block.items()
            if any(b.group_id == 0 for b in blocks.values())}


def router_hit(engine, view, prompt: list[int]) -> int:
    """What a router predicts: the leading blocks of ``prompt`` whose hashes were published (and not
    removed), the last token left to compute, in tokens."""
    probe = Request("probe", prompt, greedy(1), engine.input_processor.block_hasher, engine.root_key())
    n = 0
    for h in probe.block_hashes[: (len(prompt) - 1) // B]:
        if external_block_hash(h) not in view.hashes:
            break
        n += 1
    return n * B


def test_kv_events_publish_group_0_and_predict_the_hit(loaded):
    pytest.importorskip("zmq")
    from tests.cache.kv_events_test_utils import Follower

    config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
              "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"}
    engine = make_engine(loaded, kv_events_config=json.dumps(config))
    pool = engine.kv_cache_manager.block_pool
    follower = Follower(engine.kv_event_publisher, "kv")
    other_groups = {external_block_hash(group_block_hash(b"\x00" * 8, g)) for g in (1, 2)}
    checked = []

    def run(prompt: list[int]):
        rid = engine.add_request(prompt, greedy(6))
        while engine.has_unfinished_requests():
            outs = engine.step()
            follower.catch_up()
            assert follower.view.hashes == group0_hashes(pool)
            checked.append(len(follower.view.hashes))
            for out in outs:
                if out.finished and out.request_id == rid:
                    return out
        raise AssertionError("no output")

    try:
        follower.join_live()
        assert run(PREFIX + TAILS[0]).num_cached_tokens == 0
        # A's 49 tokens: blocks 0-11 of group 0 published; groups 1-2 cached too, none published
        assert len(follower.view.hashes) == 12 and pool.num_cached_blocks == 3 * 12
        assert TAILS[1][0] != TAILS[0][0]  # no partial hit in block 10: the count is full blocks only
        assert router_hit(engine, follower.view, PREFIX + TAILS[1]) == 40
        assert run(PREFIX + TAILS[1]).num_cached_tokens == 40  # the retained windows (blocks 8-9) served
        # Group 1's block 9 evicted alone (the window a hit at 40 reads): nothing is published, the
        # router still counts 40, the engine serves 36 (blocks 7-8 cover [29, 36)).
        seen = follower.next_seq
        assert pool.uncache([cached_block(engine, PREFIX, 9, 1)], reason="test") == 1
        engine.publish_kv_events()
        assert engine.kv_event_publisher.last_seq < seen  # no batch: no event at all
        assert router_hit(engine, follower.view, PREFIX + TAILS[2]) == 40
        assert run(PREFIX + TAILS[2]).num_cached_tokens == 36
        # the other groups' keys, in the published form, are in the pool but were never sent
        assert {external_block_hash(h) for h, blocks in pool.cached_block_hash_to_block.items()
                if any(b.group_id != 0 for b in blocks.values())} == other_groups
        published = {h for event in follower.view.stored for h in event.block_hashes}
        assert not published & other_groups and len(published) == 12 + 2 + 1  # A: blocks 0-11; B: 10-11; C (47 tokens): 10
        assert len(checked) == 3 * 6
    finally:
        follower.close()
        engine.close()
