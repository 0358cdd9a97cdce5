"""``prefixcache`` command line: ``demo``, ``fetch``, ``serve``, ``cluster``, ``bench``, ``analyze`` (and
``--version``).

Each subcommand's options live beside its code: ``add_cli_args(parser)`` and ``run_cli(args)`` in
``entrypoints/cli_args.py`` (serve), ``entrypoints/cluster.py`` (cluster), ``bench/runner.py`` (bench)
and ``bench/analyze.py`` (analyze), imported lazily so that ``prefixcache demo`` doesn't pay for the
server's imports. Every ``--help`` shows each flag's default (:class:`DefaultsHelpFormatter`) and the
choices of enumerated flags.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from prefixcache import __version__
from prefixcache.cache.config import DEFAULT_BLOCK_SIZE
from prefixcache.config import DEFAULT_MODEL

_SUBCOMMAND_MODULES = {
    "serve": ("prefixcache.entrypoints.cli_args", "OpenAI-compatible HTTP server"),
    "cluster": ("prefixcache.entrypoints.cluster", "N serve replicas behind the SGLang model gateway (sglang-router)"),
    "bench": ("prefixcache.bench.runner", "prefix-caching benchmarks; speed vs transformers and llama.cpp"),
    "analyze": ("prefixcache.bench.analyze", "a JSONL file of prompts: repeat rate, cache hit rate, cache breakers"),
}


MODEL_HELP = ("built-in name, a local HF directory (config.json + *.safetensors) or a local .gguf file; "
              "never downloaded from the Hub")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, plus ``(default: X)`` on every flag whose help doesn't say its default
    (flags defaulting to None, False or an empty list have nothing to show)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        nothing = default is None or default is False or default is argparse.SUPPRESS or default == []
        if "default" in text or nothing or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand; returns the exit status (2 for bad options, 130 when interrupted)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while a subcommand imports or starts: one line, no traceback
        print("prefixcache: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="prefixcache", description="LLM inference with automatic prefix caching",
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"prefixcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_parser(name: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, formatter_class=DefaultsHelpFormatter, **kwargs)

    demo = add_parser("demo", help="shared system prompt + 10 questions, prefix caching off vs on")
    demo.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    demo.add_argument("--json", action="store_true",
                      help="print the report as one JSON object on stdout (progress bars stay on stderr)")
    demo.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    demo.add_argument("--num-threads", type=int, default=None,
                      help="torch CPU threads (default: the available cores; on a shared or busy machine "
                           "give fewer, e.g. 2: oversubscribed cores make every run many times slower)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")

    fetch = add_parser("fetch", help="download and convert the default model into $PREFIXCACHE_HOME")
    fetch.add_argument("--home", default=None,
                       help="cache folder the model is stored in (default: $PREFIXCACHE_HOME, else ~/.cache/prefixcache)")
    fetch.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")

    requested = argv if argv is not None else sys.argv[1:]
    modules = {}
    for name, (module_name, help_text) in _SUBCOMMAND_MODULES.items():
        if requested[:1] != [name]:
            add_parser(name, help=help_text, add_help=False)
            continue
        try:
            modules[name] = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            print(f"prefixcache: error: `{name}` is not available ({e})", file=sys.stderr)
            return 2
        modules[name].add_cli_args(add_parser(name, help=help_text))

    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from prefixcache.entrypoints.demo import print_report, run_demo

            report = run_demo(args.model, block_size=args.block_size, num_threads=args.num_threads,
                              progress=not args.no_progress)
            print_report(report, args.json)
        elif args.command == "fetch":
            from pathlib import Path

            from prefixcache.models.fetch import fetch_default_model

            print(fetch_default_model(Path(args.home) if args.home else None, progress=not args.no_progress))
        else:
            return modules[args.command].run_cli(args) or 0
    except ValueError as e:  # bad options or a model that can't be loaded: one clear line
        print(f"prefixcache: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
