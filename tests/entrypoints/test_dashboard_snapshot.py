"""DashboardState's snapshot logic under a held engine thread, with a scripted stand-in for the async
engine (its ``inspect`` waits on an event, as a long step would hold the thread): concurrent polls of
one viewer, a snapshot that fails after its poll gave up, the empty tree before any was taken. The
real server path is in test_dashboard_server.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from prefixcache.cache.block_pool import BlockPool
from prefixcache.cache.kv_cache_groups import single_group
from prefixcache.engine.cache_insight import empty_report
import prefixcache.entrypoints.dashboard.state as dashboard
from prefixcache.entrypoints.dashboard.state import DashboardState


class HeldEngine:
    """``inspect`` runs ``fn`` once ``step_done`` is set (a step holds the engine thread until then);
    ``get_stats`` never waits, as AsyncLLMEngine's."""

    def __init__(self) -> None:
        self.engine = SimpleNamespace(config=SimpleNamespace(block_size=16), finish_hooks=[],
                                      kv_cache_groups=single_group(2),  # a snapshot lists the pool's groups
                                      kv_cache_manager=SimpleNamespace(block_pool=BlockPool(4)))
        self.step_done = asyncio.Event()
        self.num_inspects = 0

    async def inspect(self, fn):
        self.num_inspects += 1
        await self.step_done.wait()
        return fn(self.engine)

    async def get_stats(self):
        return "stats as of the last step"


class Reports:
    """CacheInsight.report's stand-in: numbered trees; raises while ``failing``."""

    def __init__(self) -> None:
        self.num_taken = 0
        self.failing = False

    def report(self, tenant, previews):
        if self.failing:
            raise RuntimeError("tree walk failed")
        self.num_taken += 1
        return {**empty_report(), "prefixes": [f"tree {self.num_taken}"], "time_s": float(self.num_taken)}


@pytest.fixture
def board(monkeypatch):
    monkeypatch.setattr(dashboard, "STATS_WAIT_S", 0.05)
    monkeypatch.setattr(dashboard, "take_stats", lambda engine: "stats taken with the tree")
    engine = HeldEngine()
    state = DashboardState(engine, "m", tenant_isolation=False)
    state.insight = Reports()
    return engine, state


def test_two_polls_of_one_viewer_share_the_pending_snapshot(board):
    engine, state = board

    async def run():
        engine.step_done.set()  # the step ends within the wait: both polls take the same snapshot
        return await asyncio.gather(state._snapshot(None), state._snapshot(None))

    first, second = asyncio.run(run())
    assert first == second == ("stats taken with the tree", state._reports[None], False)
    assert first[1]["prefixes"] == ["tree 1"] and engine.num_inspects == 1 and state._pending == {}


def test_stale_answers_then_the_snapshot_taken_when_the_step_ends(board):
    engine, state = board

    async def run():
        stale = await state._snapshot(None)  # nothing taken yet: the empty tree
        again = await state._snapshot(None)  # still held: the same pending snapshot, no second ask
        assert engine.num_inspects == 1
        engine.step_done.set()
        await asyncio.sleep(0)
        return stale, again, await state._snapshot(None)

    stale, again, fresh = asyncio.run(run())
    assert stale == again == ("stats as of the last step", empty_report(), True)
    # The snapshot that finished unseen was kept; the poll asked anew and got the newer tree at once.
    assert fresh == ("stats taken with the tree", state._reports[None], False)
    assert fresh[1]["prefixes"] == ["tree 2"] and engine.num_inspects == 2


def test_a_snapshot_failing_after_its_poll_gave_up_is_not_kept(board):
    """It used to stay pending and re-raise on every later poll of that viewer."""
    engine, state = board

    async def run():
        state.insight.failing = True
        stale = await state._snapshot(None)  # gives up; the snapshot fails later, unseen
        engine.step_done.set()
        for _ in range(3):
            await asyncio.sleep(0)
        state.insight.failing = False
        return stale, await state._snapshot(None), await state._snapshot(None)

    stale, first, second = asyncio.run(run())
    assert stale[2] is True and first[2] is False and first[1]["prefixes"] == ["tree 1"]
    assert second[1]["prefixes"] == ["tree 2"] and engine.num_inspects == 3


def test_the_empty_tree_is_a_fresh_dict_each_time():
    a, b = empty_report(), empty_report()
    a["prefixes"].append("x")
    a["breakers"]["top"].append("y")
    assert b["prefixes"] == [] and b["breakers"]["top"] == [] and empty_report() == b
