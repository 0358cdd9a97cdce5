"""``prefixcache`` command line: ``demo``, ``fetch``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixcache", description="LLM inference with automatic prefix caching")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="shared system prompt + 10 questions, prefix caching off vs on")
    demo.add_argument("--model", default="smollm2-135m", help="built-in name, HF directory or .gguf file")
    demo.add_argument("--json", action="store_true", help="print the report as one JSON object")
    demo.add_argument("--block-size", type=int, default=16)

    fetch = sub.add_parser("fetch", help="download and convert the default model into $PREFIXCACHE_HOME")
    fetch.add_argument("--home", default=None, help="cache folder (default $PREFIXCACHE_HOME or ~/.cache/prefixcache)")

    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from prefixcache.entrypoints.demo import print_report, run_demo

            print_report(run_demo(args.model, block_size=args.block_size), args.json)
        elif args.command == "fetch":
            from pathlib import Path

            from prefixcache.models.fetch import fetch_default_model

            print(fetch_default_model(Path(args.home) if args.home else None))
    except ValueError as e:  # bad options or a model that can't be loaded: one clear line
        print(f"prefixcache: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
