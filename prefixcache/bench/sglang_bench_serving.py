"""Runs SGLang's ``bench_serving`` (``sglang.benchmark.serving``) from a venv that holds the ``sglang`` wheel
without its serving runtime: ``python sglang_bench_serving.py ARGS`` = ``python -m sglang.bench_serving ARGS``.

Run by the field venv's Python, never imported by prefixcache (it imports nothing of ours). ``import
sglang.bench_serving`` first runs ``sglang/__init__.py``, which loads the serving runtime (CUDA kernels,
FlashInfer, a CUDA torch); the benchmark client needs none of it. So the packages ``sglang`` and
``sglang.srt``, ``sglang.srt.utils`` and ``sglang.srt.disaggregation`` are registered as bare packages (their
``__init__`` files not run), and the one name the client takes from ``sglang.srt.disaggregation.utils``
(``FAKE_BOOTSTRAP_HOST``, used only by ``--fake-prefill``) is given its value; the benchmark's own code runs as
shipped.

With ``$PREFIXCACHE_FIELD_PROMPTS`` set, the prompts its dataset generator returned are also written there (a JSON
list, in the order they are sent; the first is also its warm-up request), so the field workload can compute the
exact theoretical hit rate of what SGLang sent; only the dataset function is wrapped, nothing it returns changed.
"""

import importlib.util
import json
import os
import sys
import types

# Run as a script, this file's folder (prefixcache/bench) is sys.path[0], and its queue.py would shadow the
# standard library's queue module for urllib3
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # sglang.srt.disaggregation.utils' value in the pinned release
PROMPTS_ENV = "PREFIXCACHE_FIELD_PROMPTS"  # the same name as prefixcache.bench.field.PROMPTS_ENV


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
    import sglang.benchmark.serving as serving

    record = os.environ.get(PROMPTS_ENV)
    if record:
        generate = serving.get_dataset

        def get_dataset(*args, **kwargs):
            rows = generate(*args, **kwargs)
            with open(record, "w") as f:
                json.dump([row.prompt for row in rows], f)
            return rows

        serving.get_dataset = get_dataset
    cli_main = serving.cli_main
    sys.argv[0] = "sglang.bench_serving"
    cli_main()


if __name__ == "__main__":
    main()
