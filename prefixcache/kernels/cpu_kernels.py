"""Builds and loads our CPU kernels (``csrc/``, AVX-512): ``int4_mm`` and ``int8_mm`` (qgemm.cpp:
int8-activation products with grouped 4- and 8-bit weights), ``paged_decode_attention``
(paged_attention.cpp: generated tokens' attention straight from the KV pool),
``paged_prefill_attention`` (prefill_attention.cpp: prompt rows' causal attention from the pool; its
functions alone are compiled for AVX512-BF16, and its AMX form for AMX-BF16, and run only where the CPU
has them, see
:func:`prefixcache.kernels.prefill_attention.prefill_kernel_supported`) and ``DecodeLayers``
(decode_layers.cpp: generated tokens' decoder layers around those kernels), and ``add_rms_norm``,
``rope_write_kv``, ``silu_mul`` (prompt_ops.cpp: a bf16 model's prompt rows' element-wise ops, fused), and
``quantize_rows_int8``, ``int8_rows_to_float`` (int8_rows.cpp: quantization="int8"'s per-row quantization and
rescaling around torch._int_mm, fused). The formulas and why
each gives a row the same bits in any batch are in each source's header.

The extension is compiled once per machine with torch's C++ extension builder (g++ and ninja, about
a minute) into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``); ``scripts/setup.sh`` builds it, later loads take about a second. It
needs a CPU with AVX512-VNNI (``TIERS["avx512"]``); at load it is told the tier
:func:`~prefixcache.kernels.cpu_features.kernel_tier` chose (``set_kernel_tier``, csrc/isa_tier.h), so its
own choices (the AVX512-BF16 attention form, AMX) honour ``PREFIXCACHE_KERNELS`` too.

The int4 formats' generated-token kernels (``int4_mm``, ``int8_mm``, ``paged_decode_attention``,
``DecodeLayers``) and the prompt ops (prompt_ops.cpp, which :mod:`prefixcache.kernels.prompt_ops` picks a build
of) are built from the same sources a second time, for AVX2 + FMA + F16C, in
:mod:`prefixcache.kernels.avx2_kernels`, and on aarch64 for NEON in :mod:`prefixcache.kernels.neon_kernels`;
:func:`load_int4_kernels` picks the best build this CPU (as capped) runs, ggml's way: one source per op family, a
plain-loop reference beside the ISA forms (``int4_mm_reference``, ``int8_mm_reference``), each build with its own
flags, one run-time choice. A build the compiler can't make is lost alone, with one line
(:func:`~prefixcache.kernels.build.build_main`), never the others.
"""

from __future__ import annotations

import os
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

from prefixcache.kernels.build import build_main, load_extension, tell_tier
from prefixcache.kernels.cpu_features import TIERS, cpu_features, cpu_has, describe_cpu

__all__ = ["CpuKernelsUnavailable", "amx_ready", "int4_kernels_build", "kernels_compiler", "load_cpu_kernels",
           "load_int4_kernels"]
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("qgemm.cpp", "paged_attention.cpp", "prefill_attention.cpp", "decode_layers.cpp",
                                      "prompt_ops.cpp", "amx_gemm.cpp", "int8_rows.cpp", "bindings.cpp")]
# -fopenmp: ATen's parallel_for is inline OpenMP; the process's libgomp is torch's (same soname), one thread pool
_FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-mfma"]
_LOADED: list[ModuleType] = []


class CpuKernelsUnavailable(RuntimeError):
    """The kernels can't run here (no AVX512-VNNI, or the extension doesn't build)."""


def load_cpu_kernels() -> ModuleType:
    """The compiled extension (built on first use).

    Raises:
        CpuKernelsUnavailable: the CPU lacks AVX512-VNNI, or the build failed (the compiler's message).
    """
    if not cpu_has(*TIERS["avx512"]):  # before the cached module: a cap set after the first load still holds
        raise CpuKernelsUnavailable(f"our CPU kernels need AVX512-VNNI; {describe_cpu()} (float32 runs on torch's own "
                                    f"kernels)")
    if not _LOADED:
        try:
            _LOADED.append(load_extension("prefixcache_cpu_kernels", _SOURCES, _FLAGS))
        except (RuntimeError, OSError, ImportError) as e:
            raise CpuKernelsUnavailable(f"building the CPU kernels (prefixcache/kernels/csrc) failed: {e}") from e
    return tell_tier(_LOADED[0])


def int4_kernels_build() -> str:
    """Which build :func:`load_int4_kernels` returns here: ``"avx512"`` (this module's extension, where the CPU
    as capped has ``TIERS["avx512"]`` and it builds), ``"avx2"`` (:mod:`prefixcache.kernels.avx2_kernels`' build of
    the same sources, where it has ``TIERS["avx2"]``), ``"neon"`` (:mod:`prefixcache.kernels.neon_kernels`' build,
    on an aarch64 CPU reporting ``asimd``), or ``""`` (none: the int4 formats don't run here). Chosen once per set
    of CPU features (:func:`~prefixcache.kernels.cpu_features.cpu_features`, so a changed cap chooses again)."""
    return _best_build(cpu_features())[0]


@cache
def _best_build(features: frozenset[str]) -> tuple[str, ModuleType | None]:
    """(name, extension) of :func:`int4_kernels_build`; ``features`` is the cache key only (a build that failed to
    load for these features is not tried again on every call)."""
    try:
        return "avx512", load_cpu_kernels()
    except CpuKernelsUnavailable:
        pass
    from prefixcache.kernels.avx2_kernels import Avx2KernelsUnavailable, load_avx2_kernels

    try:
        return "avx2", load_avx2_kernels()
    except Avx2KernelsUnavailable:
        pass
    from prefixcache.kernels.neon_kernels import NeonKernelsUnavailable, load_neon_kernels

    try:
        return "neon", load_neon_kernels()
    except NeonKernelsUnavailable:
        return "", None


def load_int4_kernels() -> ModuleType:
    """The int4 formats' generated-token kernels (``int4_mm``, ``int8_mm``, ``paged_decode_attention``,
    ``paged_decode_attention_float32``, ``DecodeLayers`` and the ``*_reference`` loops) in the best build this
    CPU (as capped by ``PREFIXCACHE_KERNELS``) runs (:func:`int4_kernels_build`). Every build gives the same bits
    wherever the attention takes the same form (the AVX2 and NEON builds have only the float32 form, which a CPU
    without AVX512-BF16, or capped below it, runs in the AVX-512 build too).

    Raises:
        CpuKernelsUnavailable: the CPU lacks AVX2 + FMA + F16C and NEON, or no build builds.
    """
    module = _best_build(cpu_features())[1]
    if module is not None:
        return module
    raise CpuKernelsUnavailable(f"the int4 kernels need AVX2 + FMA + F16C or aarch64 NEON (and a build of them); "
                                f"{describe_cpu()}")


@cache
def amx_ready() -> bool:
    """Whether our kernels run AMX-BF16 tiles here: the CPU has them, Linux granted this process the tile
    state (``amx_bf16_ready`` in csrc/prefill_attention.cpp) and ``PREFIXCACHE_AMX`` is not ``0`` (every
    AMX form off, for A/B measurements). False where the kernels don't build."""
    if os.environ.get("PREFIXCACHE_AMX", "1") == "0" or not cpu_has("amx_tile", "amx_bf16", "avx512_bf16"):
        return False
    try:
        return bool(load_cpu_kernels().amx_bf16_ready())
    except CpuKernelsUnavailable:
        return False


@cache
def kernels_compiler() -> str:
    """The compiler that built the kernels (``__VERSION__``, e.g. ``"12.2.0"``), or ``""`` where they don't
    build. Part of the cache key wherever they compute K/V (:func:`prefixcache.layers.attention.numerics.kv_numerics`):
    the same sources can round differently under another compiler (GCC fuses a product and a sum written as
    two intrinsics into one fma, ``-ffp-contract=fast``, and its choices vary by version), so replicas
    sharing a KV tier reuse each other's blocks only when built alike. Where only the AVX2 build runs (it computes
    int4's generated K/V there), that build's compiler."""
    try:
        return str(load_int4_kernels().compiler())
    except CpuKernelsUnavailable:
        return ""


if __name__ == "__main__":  # setup.sh; exit code 0 where the CPU can't run them too (float32 needs none of them)
    sys.exit(build_main("cpu_kernels", load_cpu_kernels, CpuKernelsUnavailable, ["avx512_vnni"]))
