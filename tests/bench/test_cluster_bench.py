"""The cluster benchmark's workload (the runs themselves need the gateway: tests/entrypoints/test_cluster.py)."""

from __future__ import annotations

from prefixcache.bench.accounting import common_prefix_len
from prefixcache.bench.cluster import ClusterBenchOptions, requests, system_prompts


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
