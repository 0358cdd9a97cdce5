"""llama.cpp as a baseline: the same GGUF the default model was converted from, through llama-cpp-python.

Optional: ``pip install 'prefixcache[llamacpp]'`` (it compiles llama.cpp), or
``PREFIXCACHE_LLAMACPP=1 bash scripts/setup.sh``. Without it the bench says so and skips llama.cpp.

One ``Llama`` context, greedy (``temp=0``: llama.cpp's greedy sampler), exactly ``max_tokens``
tokens per request (the token generator never checks EOS). Requests run one at a time; llama-cpp-python
keeps the last evaluated tokens' K/V and re-evaluates only what follows their longest common prefix
with the next prompt: its in-context prefix reuse, which :meth:`LlamaCppEngine.reset` forgets.
"""

from __future__ import annotations

import time
from pathlib import Path

INSTALL_HINT = ("pip install 'prefixcache[llamacpp]' (compiles llama.cpp), or "
                "PREFIXCACHE_LLAMACPP=1 bash scripts/setup.sh")


def llama_cpp_missing() -> str | None:
    """Why llama.cpp can't run here (a sentence for the report), or None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError, RuntimeError) as e:  # not installed, or its shared library won't load
        return f"llama-cpp-python is not importable ({e}); {INSTALL_HINT}"
    return None


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
