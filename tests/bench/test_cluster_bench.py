"""The cluster benchmark's workload and output files (the runs themselves need the gateway:
tests/entrypoints/test_cluster.py)."""

from __future__ import annotations

import json

from prefixcache.bench.accounting import common_prefix_len
from prefixcache.bench.cluster import ClusterBenchOptions, markdown, requests, system_prompts, write_cluster_outputs


def test_system_prompts_share_no_block():
    opts = ClusterBenchOptions(num_prefixes=8)
    systems = system_prompts(opts)
    assert len(set(systems)) == 8
    # at most "Deployment " in common: far less than one 16-token block
    assert max(common_prefix_len([list(a), list(b)]) for i, a in enumerate(systems) for b in systems[i + 1:]) \
        == len("Deployment ")


def test_requests_come_in_prefix_major_waves_with_distinct_questions():
    opts = ClusterBenchOptions(num_prefixes=3, num_requests=4)
    work = requests(opts)
    systems = system_prompts(opts)
    assert [sorted(k for k, _ in work[3 * m: 3 * m + 3]) for m in range(4)] == [[0, 1, 2]] * 4  # waves
    assert [k for k, _ in work] != [0, 1, 2] * 4  # not in a fixed order
    assert requests(opts) == work  # seeded
    for k, messages in work:
        assert messages[0] == {"role": "system", "content": systems[k]}
    for k in range(3):
        questions = [m[1]["content"] for j, m in work if j == k]
        assert len(set(questions)) == 4
        assert [q.split(")")[0] for q in questions] == ["(request 1", "(request 2", "(request 3", "(request 4"]


def test_cluster_outputs_are_the_result_its_table_and_a_png(tmp_path):
    run = {"prompt_tokens_computed": 1327, "prefill_vs_single": 1.0, "hit_rate": 0.587, "ttft_p50_s": 1.111,
           "ttft_p99_s": 9.114, "output_tokens_per_s": 3.5, "requests_per_replica": [6, 6], "kv_tier_hits": 32}
    result = {"options": {"num_prefixes": 4, "num_requests": 3, "num_replicas": 2, "concurrency": 4, "max_tokens": 4},
              "runs": {"single": run}, "skipped": {"round_robin+redis": "shared_tier=False"},
              "goals": [{"goal": "g", "value": 1.005, "target": "<= 1.1", "met": True}]}
    paths = write_cluster_outputs(result, str(tmp_path / "out"), plots=False)
    assert paths == [tmp_path / "out" / "cluster.json", tmp_path / "out" / "cluster.md"]
    assert json.loads(paths[0].read_text()) == result
    assert paths[1].read_text() == markdown(result)
    assert "| single | 1327 | 1.00x | 58.7% | 1111 | 9114 | 3.5 | 6 / 6 | 32 |\n" in markdown(result)
    assert "| round_robin+redis | skipped: shared_tier=False |\n" in markdown(result)
    paths = write_cluster_outputs(result, str(tmp_path / "out"), plots=True)
    assert [p.name for p in paths] == ["cluster.json", "cluster.md", "cluster.png"]
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
