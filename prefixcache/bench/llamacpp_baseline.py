"""llama.cpp as a baseline: the same GGUF the default model was converted from, through llama-cpp-python.

Optional: ``pip install 'prefixcache[llamacpp]'`` (it compiles llama.cpp), or
``PREFIXCACHE_LLAMACPP=1 bash scripts/setup.sh``. Without it the bench says so and skips llama.cpp.

One ``Llama`` context, greedy (``temp=0``: llama.cpp's greedy sampler), exactly ``max_tokens``
tokens per request (the token generator never checks EOS). Requests run one at a time; llama-cpp-python
keeps the last evaluated tokens' K/V and re-evaluates only what follows their longest common prefix
with the next prompt: its in-context prefix reuse, which :meth:`LlamaCppEngine.reset` forgets.
"""

from __future__ import annotations

import importlib
import signal
import subprocess
import sys
import time
from pathlib import Path

INSTALL_HINT = ("pip install 'prefixcache[llamacpp]' (compiles llama.cpp), or "
                "PREFIXCACHE_LLAMACPP=1 bash scripts/setup.sh")
# A 32-token prefill and 2 decode steps on a small context: the kernels the bench will use.
_PROBE = """
import sys
from llama_cpp import Llama
threads = int(sys.argv[2])
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=threads, n_threads_batch=threads, verbose=False)
gen = llm.generate(list(range(100, 132)), temp=0.0)
next(gen); next(gen)
"""


def llama_cpp_missing() -> str | None:
    """Why llama.cpp can't run here (a sentence for the report), or None when it can."""
    try:
        importlib.import_module("llama_cpp")  # its shared library loads, or not
    except (ImportError, OSError, RuntimeError) as e:  # not installed, or its shared library won't load
        return f"llama-cpp-python is not importable ({e}); {INSTALL_HINT}"
    return None


def llama_cpp_probe(gguf_path: Path | str, num_threads: int, timeout_s: float = 300.0) -> str | None:
    """Runs llama.cpp on ``gguf_path`` in a child process first; returns why it failed, or None.

    A llama.cpp build can die by a signal instead of raising: built with ``-march=native`` on a VM that
    reports AMX, its AMX kernels get SIGILL (seen on this project's machines). In a child process that
    costs the bench a line in the report, not the whole run.
    """
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, str(gguf_path), str(num_threads)],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"a llama.cpp probe (32-token prompt) did not finish in {timeout_s:.0f} s"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        hint = (" (an AMX build on a machine whose AMX doesn't work: rebuild with "
                "CFLAGS/CXXFLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16', as scripts/setup.sh does)"
                if name == "SIGILL" else "")
        return f"a llama.cpp probe died with {name}{hint}"
    tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
    return f"a llama.cpp probe failed (exit {done.returncode}: {tail[0]})"


def llama_cpp_version() -> str | None:
    """The installed llama-cpp-python version, or None."""
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError):
        return None
    return getattr(llama_cpp, "__version__", None)


class LlamaCppEngine:
    """Times greedy requests on one llama.cpp context.

    Args:
        gguf_path: the model file.
        num_threads: llama.cpp threads for prefill and decode (``n_threads`` and ``n_threads_batch``).
        n_ctx: context size in tokens; must hold the longest prompt plus its new tokens.

    Raises:
        ImportError: llama-cpp-python is not installed.
        ValueError: llama.cpp cannot load the file.
    """

    def __init__(self, gguf_path: Path | str, num_threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.n_ctx = n_ctx
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=num_threads,
                         n_threads_batch=num_threads, seed=0, verbose=False)

    def reset(self) -> None:
        """Forgets the evaluated tokens: the next request computes its whole prompt."""
        self.llm.reset()

    def timed_generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
        """Exactly ``max_tokens`` greedy tokens after ``prompt``, reusing the longest common prefix
        with what was evaluated before.

        Returns:
            (output token ids, TTFT in seconds, seconds to the last token).

        Raises:
            ValueError: the prompt and its new tokens don't fit in ``n_ctx``.
        """
        if len(prompt) + max_tokens > self.n_ctx:
            raise ValueError(f"llama.cpp context holds {self.n_ctx} tokens; the request needs "
                             f"{len(prompt)} + {max_tokens}")
        ids: list[int] = []
        first_s = last_s = 0.0
        t0 = time.perf_counter()
        for token in self.llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            last_s = time.perf_counter() - t0
            if not ids:
                first_s = last_s
            ids.append(int(token))
            if len(ids) == max_tokens:
                break
        return ids, first_s, last_s
