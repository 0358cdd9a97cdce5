"""``prefixcache bench --report PAGE``: the tables a run wrote (``{stem}.md`` in ``--out``) replace their
sections of a Markdown page (``docs/benchmarks.md``), so the numbers there are produced, not typed.

Each section sits between ``<!-- bench:{name}:begin -->`` and ``<!-- bench:{name}:end -->`` (``name``: the stem
with the run's variant, format and model, :func:`section_name`) and opens with the run's provenance: the CPU (its
model name and the kernel tier, :func:`~prefixcache.kernels.cpu_features.describe_cpu`), the cores, the date, the
commit of the code that ran (``git rev-parse --short HEAD``, ``+dirty`` over uncommitted changes) and the
command. A page without a section's markers gets the section appended at its end; the rest of the page is kept
as it is. Scripts outside ``prefixcache bench`` (``tools/bench_quality.py``, ``tools/soak.py``, ``benchmarks/*.py``)
write their ``--report`` sections through :func:`report_section`, with the same provenance line.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
from pathlib import Path

from prefixcache.config import DEFAULT_MODEL
from prefixcache.kernels.cpu_features import ENV_VAR as KERNELS_ENV_VAR, describe_cpu

# the outputs whose Markdown a report takes ({stem}.md in --out), in the order the workloads run; a
# `prefixcache bench` run of the model workloads writes one file per part that ran (report.part_markdowns):
# the hash + lookup micro-benchmark, the prefix-sharing workloads, the speed table
REPORT_STEMS = ("trace", "flood", "restart", "queue", "cluster", "field", "memory", "hash", "sharing", "speed",
                "summary")
# parts a page gets only where it already has their markers (never appended): the speed table alone, which
# the README holds once (`--report docs/benchmarks.md --report README.md`)
MIRROR_STEMS = frozenset({"summary"})
MODEL_FREE_STEMS = frozenset({"trace", "flood", "queue", "hash"})  # no model runs: the same section on any --model
FORMAT_STEMS = frozenset({"sharing", "speed", "summary", "restart"})  # our engine runs in --dtype / --quantization
DEFAULT_FORMAT = ("float32", "none")  # the bench's format when --dtype and --quantization are not given


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _commit(cwd: Path) -> str:
    """The checkout's short commit id (``+dirty`` when files other than Markdown differ from it), or
    ``"unknown"`` outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        # Markdown files don't change what ran, and a report run writes its page (a second run's
        # provenance would otherwise say +dirty over the first run's table)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)*.md"],
                               cwd=cwd, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def provenance(command: str) -> str:
    """The line that opens a section: machine, date, the commit of the code that ran, and the command."""
    checkout = Path(__file__).resolve().parents[2]  # this package's checkout (an installed wheel: no git)
    return (f"Machine: {_cpu_model()}, {os.cpu_count()} cores ({describe_cpu()}); date {datetime.date.today()}; "
            f"commit {_commit(checkout)}; command: `{command}`")


def update_section(page_text: str, stem: str, body: str) -> str:
    """``page_text`` with ``stem``'s section (between its markers) replaced by ``body``, or appended."""
    begin, end = f"<!-- bench:{stem}:begin -->", f"<!-- bench:{stem}:end -->"
    section = f"{begin}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(page_text):
        return pattern.sub(lambda _: section, page_text, count=1)
    return page_text.rstrip("\n") + "\n\n" + section + "\n"


def section_name(stem: str, model: str = DEFAULT_MODEL, fmt: tuple[str, str] = DEFAULT_FORMAT,
                 variant: str = "") -> str:
    """The page section of ``stem``'s table: ``stem``, then ``-{variant}`` (a run's non-default sizes, e.g. the
    queue's ``14rps``), then ``-{dtype}-{quantization}`` for a stem in :data:`FORMAT_STEMS` run in another format
    than float32 / none, then ``-{model}`` (a built-in name, or a path's last part) for a model other than the
    default one, unless the stem runs no model. A run under a kernel cap (``PREFIXCACHE_KERNELS=avx2``, standing for
    a smaller CPU) gets the cap after the stem (``speed-avx2-bfloat16-int4-int8``, ``+`` written ``-``). So runs of
    different kinds, CPUs, formats, sizes and models land in sections of their own instead of replacing each
    other's tables."""
    parts = [stem, *([variant] if variant else [])]
    cap = os.environ.get(KERNELS_ENV_VAR, "auto").strip().lower() or "auto"
    if cap != "auto" and stem not in MODEL_FREE_STEMS:
        parts.append(cap.replace("+", "-"))
    if stem in FORMAT_STEMS and tuple(fmt) != DEFAULT_FORMAT:
        parts += list(fmt)
    if model != DEFAULT_MODEL and stem not in MODEL_FREE_STEMS:
        parts.append(re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model).name).strip("-") or "model")
    return "-".join(parts)


def report_section(page: str | Path, name: str, table: str, command: str) -> None:
    """Puts ``table`` (Markdown) into ``page``'s section ``name`` under the :func:`provenance` line of
    ``command``: the one writer for a script outside ``prefixcache bench`` (``tools/``, ``benchmarks/``).

    Raises:
        ValueError: ``page`` can't be read or written (naming ``--report``).
    """
    page = Path(page)
    text = _read_page(page)
    _write_page(page, update_section(text, name, provenance(command) + "\n\n" + table))


def _read_page(page: Path) -> str:
    try:
        return page.read_text(encoding="utf-8") if page.exists() else ""
    except OSError as e:
        raise ValueError(f"--report: cannot read {str(page)!r}: {e.strerror}") from e


def _write_page(page: Path, text: str) -> None:
    try:
        page.write_text(text, encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--report: cannot write {str(page)!r}: {e.strerror}") from e


def report_run(page: str | Path, out_dir: str | Path, since_s: float, command: str,
               model: str = DEFAULT_MODEL, fmt: tuple[str, str] = DEFAULT_FORMAT,
               variants: dict[str, str] | None = None, append: bool = True) -> list[str]:
    """Puts every ``{stem}.md`` written in ``out_dir`` since ``since_s`` (a run's start, ``time.time()``) into
    ``page``, each in its section :func:`section_name` (the run's ``model``, ``fmt`` = its resolved
    ``(dtype, quantization)``, ``variants[stem]``); returns the sections reported. A section the page has no
    markers for is appended when ``append`` (the benchmarks page) and the stem is not in :data:`MIRROR_STEMS`;
    otherwise (``append=False``: the README, which holds one table) only existing sections are replaced.

    Raises:
        ValueError: ``page`` can't be read or written (naming ``--report``).
    """
    page = Path(page)
    text = _read_page(page)
    names = []
    for stem in REPORT_STEMS:
        table = Path(out_dir) / f"{stem}.md"
        if table.is_file() and table.stat().st_mtime >= since_s:
            name = section_name(stem, model, fmt, (variants or {}).get(stem, ""))
            if (not append or stem in MIRROR_STEMS) and f"<!-- bench:{name}:begin -->" not in text:
                continue
            text = update_section(text, name, provenance(command) + "\n\n" + table.read_text(encoding="utf-8"))
            names.append(name)
    _write_page(page, text)
    return names
