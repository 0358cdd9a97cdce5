"""Quality of each weight format: perplexity on a fixed text, greedy agreement with float32.

    .venv/bin/python tools/bench_quality.py [--num-threads 2] [--out bench_results/quality.json]
        [--report docs/benchmarks.md]

``--report PAGE`` puts the table into PAGE's ``quality`` section (between ``<!-- bench:quality:begin/end -->``),
under the machine, date, commit and command (``prefixcache/bench/report_page.py``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from prefixcache.bench.quality import FORMATS, INT8_ATTENTION_FORMATS, format_options, weight_format_quality

SECTION = "quality"  # the page section --report fills


def quality_markdown(result: dict, max_tokens: int) -> str:
    """``result`` (:func:`weight_format_quality`) as a Markdown table: a row per format, perplexity relative to
    float32's when float32 ran (it always runs, as the reference of the greedy agreement)."""
    base = result.get("float32", {}).get("perplexity")
    any_row = next(iter(result.values()))
    lines = [f"Perplexity of the bench's {any_row['num_text_tokens']:,}-token RAG document teacher-forced in one "
             f"prefill, and greedy agreement with float32 on the {any_row['num_prompts']} seed chat prompts × "
             f"{max_tokens} tokens (`prefixcache/bench/quality.py`).", "",
             "| format (`--dtype` / `--quantization` / `--attention-dtype`) | perplexity | prompts identical to float32 "
             "| mean tokens before the first difference |", "|---|---|---|---|"]
    for name, r in result.items():
        ppl = f"{r['perplexity']:.3f}"
        if base and name != "float32":
            ppl += f" ({r['perplexity'] / base - 1:+.2%})"
        if "generated_rows_perplexity" in r:
            ppl += f" as prompt rows, {r['generated_rows_perplexity']:.3f} as generated rows"
        dtype, quantization, attention_dtype = format_options(name)
        lines.append(f"| {name} ({dtype} / {quantization} / {attention_dtype}) | {ppl} | {r['identical_prompts']} / {r['num_prompts']} | "
                     f"{r['mean_matching_prefix']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [*FORMATS, *INT8_ATTENTION_FORMATS]
    p.add_argument("--formats", default=",".join(names), help=f"comma list of {names}")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--out", default="bench_results/quality.json")
    p.add_argument("--report", default=None, metavar="PAGE",
                   help=f"also put the table into PAGE's '{SECTION}' section (e.g. docs/benchmarks.md)")
    args = p.parse_args(argv)
    result = weight_format_quality(formats=tuple(args.formats.split(",")), max_tokens=args.max_tokens,
                                   num_threads=args.num_threads)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if args.report:
        from prefixcache.bench.report_page import report_section

        command = shlex.join([".venv/bin/python", "tools/bench_quality.py", *(sys.argv[1:] if argv is None else argv)])
        report_section(args.report, SECTION, quality_markdown(result, args.max_tokens), command)
        print(f"bench_quality: --report: {SECTION} written into {args.report}", file=sys.stderr)


if __name__ == "__main__":
    main()
