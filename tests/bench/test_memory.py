"""``bench --workload memory``: the resident set of a process tree, the peak read when a server is reaped, the
/metrics parsing, the table's shape and its --report section (no ``prefixcache serve`` started here: the
workload itself runs in ``prefixcache bench``)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from prefixcache.bench.cli import CLI_WORKLOADS, parse_workloads
from prefixcache.bench.loopback_server import LoopbackServer
from prefixcache.bench.memory import FORMATS, MemoryRow, _gauge, kv_block_bytes, memory_markdown, tree_rss, write_memory_outputs
from prefixcache.bench.report_page import REPORT_STEMS, update_section

def test_the_process_trees_resident_set_counts_a_child():
    import psutil

    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        for _ in range(100):  # until the child holds its 64 MiB (bytearray zero-fills: every page touched)
            if psutil.Process(child.pid).memory_info().rss > 64 << 20:
                break
            time.sleep(0.1)
        own_rss = psutil.Process().memory_info().rss
        child_rss = psutil.Process(child.pid).memory_info().rss
        assert child_rss > 64 << 20
        rss = tree_rss(os.getpid())
        assert abs(rss - (own_rss + child_rss)) < 16 << 20  # pages may move meanwhile
        assert abs(tree_rss(child.pid) - child_rss) < 16 << 20  # a leaf: itself alone
    finally:
        child.kill()
        child.wait()


def test_stop_reaps_the_server_with_its_peak_resident_set(tmp_path):
    """The peak is the process's own maximum, kept after it freed the memory: 256 MiB held, then freed."""
    code = ("import time\nb = bytearray(256 << 20)\ndel b\nopen(r'%s', 'w').close()\ntime.sleep(60)\n"
            % (tmp_path / "freed"))
    popen = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    server = LoopbackServer("probe", "http://127.0.0.1:1", popen, tmp_path / "probe.log")
    for _ in range(300):
        if (tmp_path / "freed").exists():
            break
        time.sleep(0.1)
    assert (tmp_path / "freed").exists()
    import psutil

    assert psutil.Process(popen.pid).memory_info().rss < 128 << 20  # freed: the resident set is back down
    server.stop(timeout_s=10)
    assert popen.returncode == -signal.SIGTERM  # SIGTERM's default action ended it
    # at least what it held; no upper bound: the peak also covers the forked copy of this (pytest) process
    # before exec, whose size depends on what the session imported (see loopback_server's docstring)
    assert server.peak_rss_bytes >= 256 << 20
    server.stop()  # idempotent: already reaped
    assert popen.returncode == -signal.SIGTERM


def test_gauge_reads_the_sample_not_a_longer_name():
    page = ("# HELP prefixcache:kv_blocks_total_x other\nprefixcache:kv_blocks_total_x 7.0\n"
            "# TYPE prefixcache:kv_blocks_total gauge\n"
            'prefixcache:kv_blocks_total{model_name="m",engine="0"} 2912.0\n')
    assert _gauge(page, "prefixcache:kv_blocks_total") == 2912
    with pytest.raises(ValueError, match="no 'prefixcache:kv_blocks_in_use' sample"):
        _gauge(page, "prefixcache:kv_blocks_in_use")


def test_kv_block_bytes_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 30, "num_attention_heads": 9, '
                                          '"num_key_value_heads": 3, "hidden_size": 576}')
    # K and V x 30 layers x 16 tokens x 3 heads x 64 dims x 4 bytes
    assert kv_block_bytes(tmp_path, "float32", 16) == 2 * 30 * 16 * 3 * 64 * 4 == 737280
    assert kv_block_bytes(tmp_path, "bfloat16", 16) == 368640


def test_table_rows_and_report_section(tmp_path):
    mib = 1 << 20
    rows = [MemoryRow("float32", "none", 2000 * mib, 2600 * mib, 1024 * mib, 2912),
            MemoryRow("bfloat16", "int4", skipped="int4 needs AVX2")]
    result = {"model": "smollm2-135m", "num_threads": 1, "block_size": 16, "rows": [vars(r) for r in rows]}
    table = memory_markdown(result)
    lines = table.splitlines()
    assert lines[2] == "| `--dtype` / `--quantization` | resident | peak | of which the KV pool | the rest |"
    assert lines[4] == "| float32 / none | 2,000 MiB | 2,600 MiB | 1,024 MiB (2,912 blocks) | 976 MiB |"
    assert lines[5] == "| bfloat16 / int4 | not run: int4 needs AVX2 | | | |"
    json_path, md_path = write_memory_outputs(result, tmp_path / "out")
    assert md_path.name == "memory.md" and md_path.read_text() == table and json_path.name == "memory.json"
    page = "# Benchmarks\n\n<!-- bench:memory:begin -->\nold\n<!-- bench:memory:end -->\n\ntail\n"
    assert update_section(page, "memory", table) == (
        "# Benchmarks\n\n<!-- bench:memory:begin -->\n" + table + "<!-- bench:memory:end -->\n\ntail\n")


def test_memory_is_a_workload_and_a_report_stem():
    assert "memory" in CLI_WORKLOADS and parse_workloads("memory,flood") == ("memory", "flood")
    assert "memory" in REPORT_STEMS and "memory" not in parse_workloads("all")  # a server per format: asked for
    assert [f for f, _ in FORMATS] == ["float32", "bfloat16", "float32", "bfloat16", "bfloat16"]
