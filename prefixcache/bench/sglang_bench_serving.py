"""Runs SGLang's ``bench_serving`` (``sglang.benchmark.serving``) from a venv that holds the ``sglang`` wheel
without its serving runtime: ``python sglang_bench_serving.py ARGS`` = ``python -m sglang.bench_serving ARGS``.

Run by the field venv's Python, never imported by prefixcache (it imports nothing of ours). ``import
sglang.bench_serving`` first runs ``sglang/__init__.py``, which loads the serving runtime (CUDA kernels,
FlashInfer, a CUDA torch); the benchmark client needs none of it. So the packages ``sglang`` and
``sglang.srt``, ``sglang.srt.utils`` and ``sglang.srt.disaggregation`` are registered as bare packages (their
``__init__`` files not run), and the one name the client takes from ``sglang.srt.disaggregation.utils``
(``FAKE_BOOTSTRAP_HOST``, used only by ``--fake-prefill``) is given its value; the benchmark's own code runs as
shipped.
"""

import importlib.util
import os
import sys
import types

# Run as a script, this file's folder (prefixcache/bench) is sys.path[0], and its queue.py would shadow the
# standard library's queue module for urllib3
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # sglang.srt.disaggregation.utils' value in the pinned release


def _bare_package(name: str, path: str) -> None:
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module


def main() -> None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("sglang is not installed in this Python (prefixcache bench --install-field-tools sglang)")
    root = list(spec.submodule_search_locations)[0]
    for name in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation"):
        _bare_package(name, root + name[len("sglang"):].replace(".", "/"))
    utils = types.ModuleType("sglang.srt.disaggregation.utils")
    utils.FAKE_BOOTSTRAP_HOST = FAKE_BOOTSTRAP_HOST
    sys.modules[utils.__name__] = utils
    from sglang.benchmark.serving import cli_main

    sys.argv[0] = "sglang.bench_serving"
    cli_main()


if __name__ == "__main__":
    main()
