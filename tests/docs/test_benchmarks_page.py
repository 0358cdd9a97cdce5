"""docs/benchmarks.md holds only produced tables: every Markdown table lies inside a section a command writes
(``<!-- bench:NAME:begin/end -->``, written by ``--report``, or ``<!-- flags:NAME:begin/end -->``, the generated
flag tables), and every bench section opens with the provenance line ``report_page.provenance`` writes (machine,
date, commit, command). A table typed by hand, or a section whose numbers were pasted in, fails here."""

from __future__ import annotations

import re
from pathlib import Path

from prefixcache.bench.report_page import MIRROR_STEMS, REPORT_STEMS, provenance

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
MARKER = re.compile(r"<!-- (bench|flags):([A-Za-z0-9._-]+):(begin|end) -->")
# report_page.provenance: "Machine: CPU, N cores (tier); date YYYY-MM-DD; commit ID[+dirty]; command: `...`"
PROVENANCE = re.compile(r"Machine: .+, \d+ cores \(.+\); date \d{4}-\d{2}-\d{2}; "
                        r"commit ([0-9a-f]{7,40}(\+dirty)?|unknown); command: `[^`]+`")


def script_sections() -> set[str]:
    """The sections the scripts outside ``prefixcache bench`` write (their ``SECTION = "..."``)."""
    names = set()
    for path in [ROOT / "tools" / "bench_quality.py", ROOT / "tools" / "soak.py", *(ROOT / "benchmarks").glob("*.py")]:
        names.update(re.findall(r'^SECTION = "([^"]+)"', path.read_text(), re.M))
    return names


def page_problems(text: str, writers: set[str]) -> list[str]:
    """Every table line outside a section, every bench section without its provenance line, every unpaired or
    repeated marker, and every bench section no writer makes (its name's stem not in ``writers``)."""
    problems, open_section, seen, in_fence = [], None, set(), False
    lines = text.split("\n")
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        marker = MARKER.fullmatch(line.strip())
        if marker:
            kind, name, edge = marker.groups()
            if edge == "begin":
                if open_section or (kind, name) in seen:
                    problems.append(f"line {number}: {kind}:{name} opened inside {open_section} or twice")
                open_section = (kind, name)
                seen.add((kind, name))
                if kind == "bench":
                    if not any(name == w or name.startswith(w + "-") for w in writers):
                        problems.append(f"line {number}: no command writes section {name!r}")
                    first = lines[number] if number < len(lines) else ""
                    if not PROVENANCE.fullmatch(first):
                        problems.append(f"line {number + 1}: section {name!r} does not open with the provenance "
                                        f"line (regenerate it with its command): {first[:80]!r}")
            elif open_section != (kind, name):
                problems.append(f"line {number}: {kind}:{name} closed but {open_section} is open")
            else:
                open_section = None
            continue
        if not in_fence and open_section is None and line.lstrip().startswith("|"):
            problems.append(f"line {number}: a table outside a generated section: {line[:80]!r}")
    if open_section:
        problems.append(f"{open_section} is never closed")
    return problems


def test_every_table_on_the_benchmarks_page_is_produced_by_a_command():
    problems = page_problems(PAGE.read_text(encoding="utf-8"), set(REPORT_STEMS) - MIRROR_STEMS | script_sections())
    assert not problems, "docs/benchmarks.md:\n" + "\n".join(problems)


def test_the_readme_table_is_produced_by_the_speed_bench():
    """The README's one benchmark table is the speed table alone (``summary``), written by
    ``prefixcache bench --workload speed ... --report docs/benchmarks.md --report README.md``; the README's other
    tables (the CPU tiers, the docs index) are prose, not measurements."""
    text = README.read_text(encoding="utf-8")
    names = [name for kind, name, edge in MARKER.findall(text) if kind == "bench" and edge == "begin"]
    assert len(names) == 1 and names[0].startswith("summary"), names
    section = text.split(f"<!-- bench:{names[0]}:begin -->")[1].split(f"<!-- bench:{names[0]}:end -->")[0]
    assert page_problems(f"<!-- bench:{names[0]}:begin -->{section}<!-- bench:{names[0]}:end -->", MIRROR_STEMS) == []
    assert section.count("\n|") >= 5  # the header, the rule and the speed rows


def test_the_check_finds_a_typed_table_a_pasted_section_and_an_unknown_one():
    good = provenance("prefixcache bench --workload flood")
    assert PROVENANCE.fullmatch(good), good  # the pattern is the writer's own line
    page = (f"# B\n\n<!-- bench:flood:begin -->\n{good}\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
            "<!-- bench:flood:end -->\n\n```\n| in a code block |\n```\n")
    assert page_problems(page, {"flood"}) == []
    typed = page + "\n| a | b |\n|---|---|\n"
    first = page.count("\n") + 2  # after the page's lines and one blank line
    assert page_problems(typed, {"flood"}) == [f"line {first}: a table outside a generated section: '| a | b |'",
                                               f"line {first + 1}: a table outside a generated section: '|---|---|'"]
    pasted = "<!-- bench:queue-14rps:begin -->\n2-core VM, 2026-12-01:\n| 1 |\n<!-- bench:queue-14rps:end -->\n"
    assert page_problems(pasted, {"queue"}) == [
        "line 2: section 'queue-14rps' does not open with the provenance line (regenerate it with its command): "
        "'2-core VM, 2026-12-01:'"]
    unknown = f"<!-- bench:bench:begin -->\n{good}\n<!-- bench:bench:end -->\n"
    assert page_problems(unknown, {"speed", "sharing"}) == ["line 1: no command writes section 'bench'"]
    assert page_problems("<!-- flags:bench:begin -->\n| x |\n", set()) == ["('flags', 'bench') is never closed"]


def test_every_writer_has_a_section_on_the_page():
    text = PAGE.read_text(encoding="utf-8")
    names = {name for kind, name, _ in MARKER.findall(text) if kind == "bench"}
    assert {"quality", "soak", "kernels-prefill-attention", "kernels-amx-linear"} <= script_sections()
    writers = set(REPORT_STEMS) - MIRROR_STEMS | script_sections()
    missing = [w for w in writers if not any(n == w or n.startswith(w + "-") for n in names)]
    assert missing == []
