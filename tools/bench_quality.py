"""Quality of each weight format: perplexity on a fixed text, greedy agreement with float32.

    .venv/bin/python tools/bench_quality.py [--num-threads 2] [--out bench_results/quality.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from prefixcache.bench.quality import FORMATS, weight_format_quality


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {list(FORMATS)}")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--out", default="bench_results/quality.json")
    args = p.parse_args()
    result = weight_format_quality(formats=tuple(args.formats.split(",")), max_tokens=args.max_tokens,
                                   num_threads=args.num_threads)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
