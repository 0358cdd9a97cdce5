"""``bench --workload memory``: the /proc and /metrics parsing, the table's shape and its --report section
(no server started here: the workload itself runs in ``prefixcache bench``)."""

import os
import subprocess
import sys

import pytest

from prefixcache.bench.cli import CLI_WORKLOADS, parse_workloads
from prefixcache.bench.memory import (FORMATS, MemoryRow, _gauge, kv_block_bytes, memory_markdown, process_tree,
                                      status_bytes, tree_memory, write_memory_outputs)
from prefixcache.bench.report_page import REPORT_STEMS, update_section

STATUS = "Name:\tpython\nVmPeak:\t 3000000 kB\nVmHWM:\t  2500000 kB\nVmRSS:\t  2065432 kB\nThreads:\t5\n"


def test_status_fields_in_bytes():
    assert status_bytes(STATUS, "VmRSS") == 2065432 * 1024
    assert status_bytes(STATUS, "VmHWM") == 2500000 * 1024
    with pytest.raises(ValueError, match="no 'VmSwap' line"):
        status_bytes(STATUS, "VmSwap")
    with pytest.raises(ValueError, match="not a count of kB"):
        status_bytes("VmRSS:\t12 MB\n", "VmRSS")


def test_the_process_trees_memory_counts_a_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        for _ in range(100):  # until the child holds its 64 MiB
            with open(f"/proc/{child.pid}/status") as f:
                if status_bytes(f.read(), "VmRSS") > 64 << 20:
                    break
            subprocess.run(["sleep", "0.1"])
        assert child.pid in process_tree(os.getpid())
        with open(f"/proc/{child.pid}/status") as f:
            child_rss = status_bytes(f.read(), "VmRSS")
        with open("/proc/self/status") as f:
            own_rss = status_bytes(f.read(), "VmRSS")
        rss, peak = tree_memory(os.getpid())
        assert rss >= own_rss + child_rss - (16 << 20) and peak >= rss - (16 << 20)  # pages may move meanwhile
    finally:
        child.kill()
        child.wait()


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
