"""prefixcache bench --workload flood: its table and JSON from the real cache manager (no model)."""

from __future__ import annotations

import json

import pytest

from prefixcache.bench.flood import FloodOptions, run_flood
import prefixcache.entrypoints.cli.main as cli


def test_bench_flood_writes_each_policy_with_and_without_the_breakpoint(tmp_path, capsys):
    assert cli.main(["bench", "--workload", "flood", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "flood.json").read_text())
    got = {(r["policy"], r["breakpoint"]): (r["hit_tokens"], r["max_hit_tokens"]) for r in rows}
    assert got == {("cost", True): (20480, 20480), ("cost", False): (20480, 20480),
                   ("lfu", True): (20480, 20480), ("lfu", False): (8000, 20480),
                   ("lru", True): (20480, 20480), ("lru", False): (8000, 20480),
                   ("ttl", True): (20480, 20480), ("ttl", False): (8000, 20480)}
    out = capsys.readouterr().out
    assert "| `lru` | 20480 / 20480 (100%) | 8000 / 20480 (39%) |" in out
    assert (tmp_path / "flood.md").read_text() == out


def test_flood_sizes_that_cannot_run_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^num_blocks: a one-off prompt \(100 blocks\) does not fit beside the "
                                         r"pinned prefix \(256 blocks\)$"):
        run_flood("lru", True, FloodOptions(num_blocks=300))
    with pytest.raises(ValueError, match=r"^policy must be one of \['cost', 'lfu', 'lru', 'ttl'\], got 'fifo'$"):
        run_flood("fifo", True)
