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


def test_a_run_on_another_model_gets_its_own_section(tmp_path):
    from prefixcache.bench.report_page import report_run, section_name

    assert section_name("bench") == "bench"
    assert section_name("bench", "gemma3-270m") == "bench-gemma3-270m"
    assert section_name("bench", "/models/My Model.Q4_1.gguf") == "bench-My-Model.Q4_1.gguf"
    page = tmp_path / "benchmarks.md"
    page.write_text("<!-- bench:bench:begin -->\nsmollm2 table\n<!-- bench:bench:end -->\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "bench.md").write_text("gemma table\n")
    assert report_run(page, out, 0.0, "prefixcache bench --model gemma3-270m", model="gemma3-270m") == [
        "bench-gemma3-270m"]
    text = page.read_text()
    assert "smollm2 table" in text  # the default model's section is left alone
    begin = text.index("<!-- bench:bench-gemma3-270m:begin -->")
    assert text.index("gemma table", begin) < text.index("<!-- bench:bench-gemma3-270m:end -->")
