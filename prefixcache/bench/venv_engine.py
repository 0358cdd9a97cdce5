"""Speed-table engines that live in their own virtual environment: vLLM's CPU build and OpenVINO GenAI.

Each pins its own torch and transformers, so it never shares ``.venv``: it lives in
``.venv-field/<name>`` (:func:`prefixcache.bench.field_venvs.venvs_dir`), and that venv's python runs
``venv_runner.py`` (which imports nothing of prefixcache) as a child process. The bench drives the child
over its stdin and stdout, one JSON object per line each way::

    -> {"op": "init", "backend": "vllm", ...settings}        <- {"label": str}
    -> {"op": "reset"}                                        <- {}
    -> {"op": "generate", "prompt": [int], "max_tokens": n}   <- {"ids": [int], "ttft_s": float,
                                                                  "e2e_s": float, "num_cached_tokens": int}
    -> {"op": "generate_all", "prompts": [[int]], "max_tokens": n}  <- {"ids": [[int]]}
    any failure                                               <- {"error": str}

Prompts travel as token ids (the bench's prompts, built with our tokenizer from the same HF directory), so
every engine computes exactly the same tokens. TTFT and the last token's time are taken inside the child,
around the engine's own calls, so the pipe adds nothing to them; the batch run's wall time is the parent's
(one round trip more, under a millisecond beside seconds).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
from collections.abc import Mapping
from pathlib import Path

RUNNER = Path(__file__).with_name("venv_runner.py")
READY = ".installed"  # written into a venv by scripts/setup.sh once its install finished (as field.py's)
Timed = tuple[list[int], float, float]


class BaselineFailed(RuntimeError):
    """The child process failed, answered an error, or did not answer in time; the message ends with the
    tail of its log."""


def venv_dir(name: str) -> Path:
    """``.venv-field/<name>`` (or ``$PREFIXCACHE_FIELD_VENVS/<name>``)."""
    from prefixcache.bench.field_venvs import venvs_dir

    return venvs_dir() / name


def venv_missing(name: str, install_hint: str) -> str | None:
    """Why the venv ``name`` can't run (a sentence ending with how to install it), or None."""
    venv = venv_dir(name)
    if not (venv / "bin" / "python").is_file() or not (venv / READY).is_file():
        return f"no finished install in {venv}; install it with: {install_hint}"
    return None


class VenvEngine:
    """A :class:`~prefixcache.bench.speed.SpeedEngine` in a child process (protocol: the module docstring).

    Args:
        python: the venv's interpreter.
        settings: the ``init`` message (``backend``, ``model_dir``, ``num_threads``, ...).
        env: variables added to this process's environment for the child.
        log_path: the child's stderr (and whatever its libraries print) goes here.
        timeout_s: the longest wait for one answer; ``init`` gets ``init_timeout_s``.

    Raises:
        BaselineFailed: the child did not start or its engine failed to load.
    """

    def __init__(self, python: Path, settings: Mapping, env: Mapping[str, str], log_path: Path,
                 timeout_s: float = 600.0, init_timeout_s: float = 900.0) -> None:
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        with open(self.log_path, "w", encoding="utf-8") as log:
            try:
                # -P: the runner's folder is not put on the import path (its queue.py would hide the
                # standard library's from torch)
                self.proc = subprocess.Popen([str(python), "-P", str(RUNNER)], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=log, text=True,
                                             env={**os.environ, **env})
            except OSError as e:
                raise BaselineFailed(f"could not start {python}: {e}") from e
        self.label = self._call({"op": "init", **settings}, init_timeout_s)["label"]

    def _call(self, message: dict, timeout_s: float | None = None) -> dict:
        """Sends one message; returns the answer. Raises BaselineFailed (and ends the child) otherwise."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
            # one answer per message, so nothing is left in the pipe's buffer while select waits
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
            line = self.proc.stdout.readline() if ready else None
        except OSError as e:  # the child is gone: a broken pipe
            line, why = None, f"the pipe broke ({e})"
        else:
            why = f"no answer to {message['op']!r} in {timeout_s:.0f} s" if line is None else "it exited"
        if not line:
            self.close()
            raise BaselineFailed(f"{why} (exit code {self.proc.returncode}); {self._log_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            self.close()
            raise BaselineFailed(f"{message['op']} failed: {answer['error']}; {self._log_tail()}")
        return answer

    def _log_tail(self, lines: int = 5) -> str:
        try:
            tail = self.log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-lines:]
        except OSError:
            tail = []
        return f"log {self.log_path}: " + (" | ".join(tail) if tail else "empty")

    def close(self) -> None:
        """Ends the child: EOF on its stdin lets it exit; a child that doesn't within 30 s is killed."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

    # SpeedEngine
    def reset(self) -> None:
        self._call({"op": "reset"})

    def share_prefix(self, prefix: list[int]) -> None:
        pass  # the engine's prefix cache keeps what the earlier requests computed

    def generate(self, prompt: list[int], max_tokens: int) -> dict:
        """One request alone: ``ids``, ``ttft_s``, ``e2e_s`` and ``num_cached_tokens`` (the engine's own count
        of prompt tokens it reused)."""
        return self._call({"op": "generate", "prompt": list(prompt), "max_tokens": max_tokens})

    def timed_generate(self, prompt: list[int], max_tokens: int) -> Timed:
        a = self.generate(prompt, max_tokens)
        return a["ids"], a["ttft_s"], a["e2e_s"]

    def generate_all(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return self._call({"op": "generate_all", "prompts": [list(p) for p in prompts],
                           "max_tokens": max_tokens})["ids"]
