"""prefixcache bench --report: a run's tables go into a Markdown page between their markers, with the machine,
date, commit and command; a second run replaces its section, nothing else on the page changes."""

from __future__ import annotations

import datetime
import os

from prefixcache.bench.report_page import update_section
import prefixcache.entrypoints.cli.main as cli
from prefixcache.kernels.cpu_features import describe_cpu


def test_report_puts_the_run_between_its_markers_and_a_rerun_replaces_it(tmp_path, capsys):
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nhand-written\n\n<!-- bench:flood:begin -->\nold numbers\n<!-- bench:flood:end -->\n\n"
                    "## After\n")
    argv = ["bench", "--workload", "flood", "--out", str(tmp_path / "out"), "--report", str(page)]
    assert cli.main(argv) == 0
    first = page.read_text()
    table = (tmp_path / "out" / "flood.md").read_text()
    begin, end = first.index("<!-- bench:flood:begin -->\n"), first.index("<!-- bench:flood:end -->")
    section = first[begin + len("<!-- bench:flood:begin -->\n"):end]
    assert section.startswith("Machine: ")
    assert f", {os.cpu_count()} cores ({describe_cpu()}); date {datetime.date.today()}; commit " in section
    assert section.endswith("command: `prefixcache " + " ".join(argv) + "`\n\n" + table)
    assert first.startswith("# Benchmarks\n\nhand-written\n\n") and first.endswith("<!-- bench:flood:end -->\n\n## After\n")
    assert "old numbers" not in first
    assert cli.main(argv) == 0  # again: the section replaced, not added
    assert page.read_text().count("<!-- bench:flood:begin -->") == 1
    assert "flood written into" in capsys.readouterr().err


def test_a_page_without_the_markers_gets_the_section_appended():
    assert update_section("# Page\n", "queue", "table\n") == (
        "# Page\n\n<!-- bench:queue:begin -->\ntable\n<!-- bench:queue:end -->\n")


def test_report_without_out_is_refused_naming_the_flags(tmp_path, capsys):
    assert cli.main(["bench", "--workload", "flood", "--out", "", "--report", str(tmp_path / "p.md")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prefixcache bench: error: --report needs --out (the tables it copies) and a Markdown "
                          "file, got --report ")
    assert not (tmp_path / "p.md").exists()


def test_a_section_is_named_after_what_ran_its_sizes_format_and_model(monkeypatch):
    from prefixcache.bench.report_page import section_name

    monkeypatch.delenv("PREFIXCACHE_KERNELS", raising=False)

    assert section_name("speed") == "speed"
    assert section_name("speed", fmt=("bfloat16", "int4")) == "speed-bfloat16-int4"
    assert section_name("sharing", fmt=("bfloat16", "int4-int8")) == "sharing-bfloat16-int4-int8"
    assert section_name("speed", "gemma3-270m") == "speed-gemma3-270m"
    assert section_name("speed", "/models/My Model.Q4_1.gguf", ("bfloat16", "int4")) == (
        "speed-bfloat16-int4-My-Model.Q4_1.gguf")
    assert section_name("restart", fmt=("bfloat16", "none")) == "restart-bfloat16-none"
    assert section_name("memory", "gemma3-270m", ("bfloat16", "int4")) == "memory-gemma3-270m"  # every format in one
    assert section_name("hash", "gemma3-270m", ("bfloat16", "int4")) == "hash"  # no model runs in it
    assert section_name("queue", "gemma3-270m", variant="14rps") == "queue-14rps"
    monkeypatch.setenv("PREFIXCACHE_KERNELS", "avx2+avx_vnni")  # a run standing for a smaller CPU
    assert section_name("speed", fmt=("bfloat16", "int4-int8")) == "speed-avx2-avx_vnni-bfloat16-int4-int8"
    assert section_name("trace") == "trace"  # no model runs in it
    monkeypatch.setenv("PREFIXCACHE_KERNELS", "auto")
    assert section_name("speed") == "speed"


def test_the_queue_variants_get_a_section_each():
    import argparse

    from prefixcache.bench.cli import add_cli_args, queue_variant

    parser = argparse.ArgumentParser()
    add_cli_args(parser)

    def variant(*flags):
        return queue_variant(parser.parse_args(["--workload", "queue", *flags]))

    assert variant() == ""
    assert variant("--queue-rate-rps", "14") == "14rps"
    assert variant("--queue-num-blocks", "30000") == "30000blocks"
    assert variant("--queue-rate-rps", "14.5", "--num-requests", "600") == "14.5rps-600requests"


def test_a_run_reports_each_part_into_its_own_section(tmp_path, monkeypatch):
    from prefixcache.bench.report_page import report_run

    monkeypatch.delenv("PREFIXCACHE_KERNELS", raising=False)  # a cap adds its name to the sections' (tested above)

    page = tmp_path / "benchmarks.md"
    page.write_text("<!-- bench:speed:begin -->\nfloat32 speed table\n<!-- bench:speed:end -->\n")
    out = tmp_path / "out"
    out.mkdir()
    for stem in ("sharing", "speed", "hash", "bench"):  # bench.md: the whole run, for the reader of --out
        (out / f"{stem}.md").write_text(f"{stem} table\n")
    assert report_run(page, out, 0.0, "prefixcache bench --dtype bfloat16 --quantization int4",
                      fmt=("bfloat16", "int4")) == ["hash", "sharing-bfloat16-int4", "speed-bfloat16-int4"]
    text = page.read_text()
    assert text.startswith("<!-- bench:speed:begin -->\nfloat32 speed table\n")  # the default format's kept
    for name, table in (("hash", "hash"), ("sharing-bfloat16-int4", "sharing"), ("speed-bfloat16-int4", "speed")):
        section = text[text.index(f"<!-- bench:{name}:begin -->"):text.index(f"<!-- bench:{name}:end -->")]
        assert section.endswith("`prefixcache bench --dtype bfloat16 --quantization int4`\n\n" + table + " table\n")
    assert "bench table" not in text
    assert report_run(page, out, 2**40, "later") == []  # nothing written since: nothing reported


def test_the_speed_table_alone_goes_only_where_its_markers_are(tmp_path, monkeypatch):
    from prefixcache.bench.report_page import report_run

    monkeypatch.delenv("PREFIXCACHE_KERNELS", raising=False)

    out = tmp_path / "out"
    out.mkdir()
    for stem in ("speed", "summary"):
        (out / f"{stem}.md").write_text(f"{stem} table\n")
    page, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    page.write_text("# B\n")
    readme.write_text("# R\n<!-- bench:summary-bfloat16-int4:begin -->\nold\n<!-- bench:summary-bfloat16-int4:end -->\n")
    fmt = ("bfloat16", "int4")
    assert report_run(page, out, 0.0, "cmd", fmt=fmt) == ["speed-bfloat16-int4"]  # the summary is never appended
    assert "summary" not in page.read_text()
    assert report_run(readme, out, 0.0, "cmd", fmt=fmt, append=False) == ["summary-bfloat16-int4"]
    text = readme.read_text()
    assert text.endswith("`cmd`\n\nsummary table\n<!-- bench:summary-bfloat16-int4:end -->\n") and "speed" not in text
    assert report_run(readme, out, 0.0, "cmd", append=False) == []  # float32: the README has no such markers


def test_the_summary_is_the_speed_table_alone():
    from prefixcache.bench.report import speed_markdown, speed_summary

    row = {"label": "cold TTFT", "unit": "s", "values": {"hf": 2.0, "ours": 1.0}, "ours_over": {"hf": 0.5}}
    speed = {"engines": {"hf": {"label": "transformers", "batch_same_tokens_as_ours": 1.0},
                         "ours": {"label": "prefixcache"}},
             "table": [row, dict(row, label="warm TTFT")], "threads": 2, "on_over_off_source": "x", "skipped": {}}
    full = speed_markdown(speed)
    summary = speed_summary(speed)
    assert len(summary) == 4 and summary[0].startswith("|  | ") and summary[1].startswith("|---|")
    assert summary[2].startswith("| cold TTFT (s) |") and summary[3].startswith("| warm TTFT (s) |")
    assert summary == full[3:7]


def test_a_bench_run_writes_a_markdown_file_per_part_with_its_own_goals(tmp_path):
    from prefixcache.bench.report import part_markdowns, write_outputs

    micro = [{"block_size": 16, "num_tokens": 4096, "hash_tokens_per_s": 96.2e6, "lookup_verify_tokens_per_s": 73.4e6,
              "total_tokens_per_s": 37.2e6}]
    result = {"model": "smollm2-135m", "date": "d", "command": None, "workloads": [], "speed": None, "micro": micro,
              "machine": {"cpu_cores": 2, "threads": 2, "torch": "t", "load_average_start": (0.5, 0, 0),
                          "load_average_end": (1.0, 0, 0)},
              "goals": [{"workload": "micro", "goal": "hash + verify + lookup tokens/s at block size 16",
                         "target": ">= 30e6", "value": 37.2e6, "met": True}]}
    parts = part_markdowns(result)
    assert list(parts) == ["hash"]
    assert "| 16 | 96.2 | 73.4 | 37.2 |\n" in parts["hash"]
    assert "| micro | hash + verify + lookup tokens/s at block size 16 | >= 30e6 | 37.2 M | yes |\n" in parts["hash"]
    paths = write_outputs(result, tmp_path, plots=False)
    assert [p.name for p in paths] == ["bench.json", "bench.md", "hash.md"]
    assert (tmp_path / "hash.md").read_text() == parts["hash"]


def test_the_trace_table_names_each_policy_against_lru():
    from prefixcache.bench.trace import run_trace_benchmark, trace_markdown

    rows = run_trace_benchmark(("lru", "cost", "belady"), seeds=(0,), num_requests=300, num_blocks=256)
    by = {(r["trace"], r["policy"]): r for r in rows}
    md = trace_markdown(rows, 256, 16)
    assert "300 requests, a pool of 256 blocks of 16 tokens" in md
    assert "| trace | seed | lru hit rate | lru prefill saved | cost | belady (offline reference) |\n" in md
    for trace in ("skewed", "uniform"):
        lru, cost, belady = by[(trace, "lru")], by[(trace, "cost")], by[(trace, "belady")]
        assert (f"| {trace} | 0 | {lru['hit_rate']:.3f} | {lru['prefill_tokens_saved']:,} | "
                f"{cost['saved_vs_lru']:+.1%} | {belady['saved_vs_lru']:+.1%} |\n") in md


def test_report_section_writes_a_script_table_under_its_provenance(tmp_path):
    from prefixcache.bench.report_page import provenance, report_section

    page = tmp_path / "p.md"
    page.write_text("# P\n\n<!-- bench:soak:begin -->\nold\n<!-- bench:soak:end -->\n")
    report_section(page, "soak", "| | |\n|---|---|\n| requests | 3 |\n", "python tools/soak.py")
    assert page.read_text() == ("# P\n\n<!-- bench:soak:begin -->\n" + provenance("python tools/soak.py")
                                + "\n\n| | |\n|---|---|\n| requests | 3 |\n<!-- bench:soak:end -->\n")


def _script(path: str):
    """A script of tools/ or benchmarks/ as a module (neither is a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    file = Path(__file__).resolve().parents[2] / path
    spec = importlib.util.spec_from_file_location(f"script_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_quality_table():
    quality = _script("tools/bench_quality.py")
    result = {"float32": {"perplexity": 21.567, "num_text_tokens": 2699, "identical_prompts": 10, "num_prompts": 10,
                          "mean_matching_prefix": 1.0},
              "int4-int8": {"perplexity": 21.647, "num_text_tokens": 2699, "identical_prompts": 3, "num_prompts": 10,
                            "mean_matching_prefix": 0.54, "generated_rows_perplexity": 21.604},
              "bfloat16+int8-attention": {"perplexity": 21.494, "num_text_tokens": 2699, "identical_prompts": 4,
                                          "num_prompts": 10, "mean_matching_prefix": 0.66}}
    md = quality.quality_markdown(result, 32)
    assert md.startswith("Perplexity of the bench's 2,699-token RAG document")
    assert "| float32 (float32 / none / float) | 21.567 | 10 / 10 | 100% |\n" in md
    assert ("| int4-int8 (bfloat16 / int4-int8 / float) | 21.647 (+0.37%) as prompt rows, 21.604 as generated rows "
            "| 3 / 10 | 54% |\n") in md
    assert "| bfloat16+int8-attention (bfloat16 / none / int8) | 21.494 (-0.34%) | 4 / 10 | 66% |\n" in md


def test_the_soak_table():
    soak = _script("tools/soak.py")
    O = soak.Outcome
    s = soak.summarize([O("chat_stream", 200, 0.0, 1.0, ttft_s=0.25, timed=True),
                        O("bad:empty_prompt", 400, 2.0, 0.01)], ["empty_prompt"])
    report = {"config": {"clients": 2, "duration_s": 5.0, "disconnect_fraction": 0.2, "slow_fraction": 0.1},
              "soak_wall_s": 5.1, "stopped_early": None, "soak": s, "server": {"health_after": 200},
              "drain": {"idle": True, "waited_s": 0.1, "kv_blocks_in_use": 0.0, "prefix_cache_hit_rate": 0.5,
                        "error": None},
              "rss_mib": {"before": 100.0, "after": 101.5, "growth": 1.5},
              "greedy": {"num_equal": 6, "num_prompts": 6, "mismatches": []}}
    report["checks"] = soak.checks(report, 50)
    md = soak.soak_markdown(report)
    assert "| requests | 2: 1 good (chat_stream 1), 1 bad inputs of 1 kinds |\n" in md
    assert "| statuses | 200: 1, 400: 1; 0 5xx |\n" in md
    assert "| TTFT p50 / p99 | 0.2 s / 0.2 s (1 streams) |\n" in md
    assert "| after the drain | 0 KV blocks in use, idle True, `/health` 200, prefix-cache hit rate 50.0% |\n" in md
    assert "| server RSS | 100.0 → 101.5 MiB (+1.5 MiB) |\n" in md
    assert "| greedy outputs vs a fresh server | 6 of 6 equal |\n" in md


def test_the_kernel_tables():
    attention = _script("benchmarks/prefill_attention.py")
    md = attention.markdown([("cold 2178", [12.0, 30.0, 8.0, 6.0])], ["amx", "avx512", "avx2"], 2, 3)
    assert "| cold 2178 | 12.0 | 30.0 | 0.40 | 8.0 | 1.50 | 6.0 | 2.00 |\n" in md and "Not run" not in md
    assert "| torch's padded flash path | our kernel, AMX form | torch / ours | our kernel, AVX-512 form |" in md
    md = attention.markdown([("cold 2178", [12.0, 30.0])], ["avx2"], 2, 3)
    assert "| cold 2178 | 12.0 | 30.0 | 0.40 |\n" in md and "Not run on this CPU: AMX form, AVX-512 form" in md
    linear = _script("benchmarks/amx_linear.py")
    assert "| 2,048 | 306.0 | 228.0 | 1.34 |\n" in linear.markdown([(2048, 306.0, 228.0)], 2, 3)


def test_the_commit_is_dirty_over_code_changes_not_over_markdown(tmp_path):
    import subprocess

    from prefixcache.bench.report_page import _commit

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "page.md").write_text("# p\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / "page.md").write_text("# p, with a reported table\n")  # what a report run writes
    assert _commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert _commit(tmp_path) == head + "+dirty"
