"""The dashboard's blocks per KV-cache group, on a tiny Gemma 3 (fast) and the default model.

The tiny model: 6 layers, local local global local local global, window 8, blocks of 4 tokens: one
full group {2, 5} and two sliding groups {0, 1}, {3, 4} (tests/models/test_gemma3_engine.py's).
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from prefixcache.config import EngineConfig
from prefixcache.engine.async_engine import AsyncLLMEngine
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.entrypoints.dashboard.routes import render_page
from prefixcache.entrypoints.dashboard.state import DashboardState, kv_group_stats
from prefixcache.models.fetch import default_model_dir
from prefixcache.models.loader import load_model
from prefixcache.sampling_params import SamplingParams
from tests.models.model_testlib import tiny_gemma3_config

B = 4  # block_size
W = 8  # sliding_window
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
NUM_BLOCKS = 60


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("tiny-gemma3-dashboard")
    config = tiny_gemma3_config(LAYER_TYPES, W)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the engine decodes what it generates
        shutil.copy(default_model_dir() / name, out_dir / name)
    return load_model(str(out_dir))


def make_engine(loaded) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(loaded.model_dir), block_size=B, num_blocks=NUM_BLOCKS, num_threads=1),
                     loaded=loaded)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def counts(engine: LLMEngine) -> list[tuple[int, int, int, int]]:
    return [(g["in_use"], g["cached"], g["cached_free"], g["retained"]) for g in kv_group_stats(engine)]


def test_running_request_holds_its_window_only_in_the_sliding_groups(tiny_gemma):
    engine = make_engine(tiny_gemma)
    groups = kv_group_stats(engine)
    assert [(g["group_id"], g["kind"], g["window"], g["label"], g["layers"]) for g in groups] == [
        (0, "full_attention", None, "full attention", [2, 5]),
        (1, "sliding_attention", W, "sliding window 8", [0, 1]),
        (2, "sliding_attention", W, "sliding window 8", [3, 4]),
    ]
    assert counts(engine) == [(0, 0, 0, 0)] * 3
    engine.add_request(prompt(30, seed=1), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()  # the prefill: 30 tokens computed, in blocks 0..7 (block 7 holds tokens 28, 29)
    # Full: all 8 blocks held, the 7 full ones cached. Sliding: the next query (position 30) reads
    # keys 23..30, so blocks 0..4 (tokens 0..19) are released, still cached; blocks 5..7 held. Of
    # the released, block 4 is among the last ceil(8 / 4) + 1 = 3 full prompt blocks (4..6): retained.
    assert counts(engine) == [(8, 7, 0, 0), (3, 7, 5, 1), (3, 7, 5, 1)]
    m = engine.get_metrics()
    assert m.num_blocks_in_use == 8 + 3 + 3 and m.num_blocks_cached == 3 * 7


def test_stats_and_page_list_every_groups_blocks_after_requests(tiny_gemma):
    engine = make_engine(tiny_gemma)
    shared = prompt(24, seed=2)

    async def run() -> dict:
        aengine = AsyncLLMEngine(engine)
        aengine.start()
        try:
            board = DashboardState(aengine, "tiny-gemma3", tenant_isolation=False)
            params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            for tail in (prompt(5, seed=3), prompt(5, seed=4)):  # the second hits the shared 24 tokens
                async for _ in await aengine.generate(shared + tail, params):
                    pass
            return await board.stats(None)
        finally:
            await aengine.shutdown()

    doc = asyncio.run(run())
    assert doc["totals"]["prefix_cache_hits"] == 24 and doc["tree_stale"] is False
    groups = doc["kv_groups"]
    assert [g["label"] for g in groups] == ["full attention", "sliding window 8", "sliding window 8"]
    # Each request wrote 29 prompt tokens + 1 generated = 30 tokens: 7 full blocks; the first 6
    # (the shared 24 tokens) are one copy, so 6 + 1 + 1 cached blocks per group, none in use.
    assert [(g["in_use"], g["cached"], g["cached_free"]) for g in groups] == [(0, 8, 8)] * 3
    # Freed sliding blocks among the last ceil(8 / 4) + 1 = 3 of each prefix are retained.
    assert groups[0]["retained"] == 0 and groups[1]["retained"] == groups[2]["retained"] > 0
    assert sum(g["cached"] for g in groups) == doc["pool"]["blocks_cached"]
    page = render_page(doc)
    assert '<tbody id="groups-body"><tr><td>0</td><td>full attention</td><td>2 5</td><td>0</td><td>8</td>' in page
    assert page.count("<td>sliding window 8</td>") == 2


def test_a_full_attention_model_has_one_group_equal_to_the_pool(smollm2):
    engine = LLMEngine(EngineConfig(model=str(smollm2.model_dir), block_size=16, num_blocks=64, num_threads=1),
                       loaded=smollm2)
    engine.add_request(prompt(40, seed=5), SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    (group,) = kv_group_stats(engine)
    m = engine.get_metrics()
    assert group["label"] == "full attention" and group["layers"] == list(range(smollm2.config.num_hidden_layers))
    # 40 prompt tokens: blocks 0..2, the two full ones cached, all freed.
    assert (group["in_use"], group["cached"], group["cached_free"], group["retained"]) == (0, 2, 2, 0)
    assert group["cached"] == m.num_blocks_cached
