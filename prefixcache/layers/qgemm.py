"""Builds and loads ``csrc/qgemm.cpp``: int8-activation products with grouped 4- and 8-bit weights
for generated tokens (the kernels' formulas and their batch invariance are in the source's header).

The extension is compiled once per machine with torch's C++ extension builder (g++ and ninja, about
40 s) into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``);
``scripts/setup.sh`` builds it, later loads take about a second. It needs a CPU with AVX512-VNNI.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["QgemmUnavailable", "load_qgemm"]
_SOURCE = Path(__file__).parent / "csrc" / "qgemm.cpp"
_FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-mfma"]  # -fopenmp: ATen's parallel_for
_LOADED: list[ModuleType] = []


class QgemmUnavailable(RuntimeError):
    """The int4 kernels can't run here (no AVX512-VNNI, or the extension doesn't build)."""


def load_qgemm() -> ModuleType:
    """The compiled extension (built on first use), with ``int4_mm`` and ``int8_mm``.

    Raises:
        QgemmUnavailable: the CPU lacks AVX512-VNNI, or the build failed (the compiler's message).
    """
    if _LOADED:
        return _LOADED[0]
    if not torch.cpu._is_vnni_supported():
        raise QgemmUnavailable("quantization='int4' needs a CPU with AVX512-VNNI (its kernels use vpdpbusd)")
    from torch.utils.cpp_extension import load

    venv_bin = str(Path(sys.executable).parent)  # ninja from the venv, also when it is not on PATH
    if shutil.which("ninja") is None and venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    try:
        module = load(name="prefixcache_qgemm", sources=[str(_SOURCE)], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                      verbose=False)
    except (RuntimeError, OSError, ImportError) as e:
        raise QgemmUnavailable(f"building the int4 kernels ({_SOURCE.name}) failed: {e}") from e
    _LOADED.append(module)
    return module


if __name__ == "__main__":  # python -m prefixcache.layers.qgemm: build now (setup.sh)
    load_qgemm()
    print(f"qgemm: built {_SOURCE.name}")
