"""Builds and loads the aarch64 NEON build of the int4 formats' generated-token kernels: ``int4_mm``, ``int8_mm``
(qgemm.cpp over qgemm_core.h's NEON blocks: ``sdot`` where the CPU has the dot product extension, ``smull`` +
``saddlp`` where not, both exact), ``paged_decode_attention`` (paged_attention.cpp's float32 form,
decode_attention_f32.h) and ``DecodeLayers`` (decode_layers.cpp), plus their plain-loop references
(``int4_mm_reference``, ``int8_mm_reference``), and a bf16 model's fused prompt-row ops (``add_rms_norm``,
``rope_write_kv``, ``silu_mul``: prompt_ops.cpp): the same sources, names and bits as the AVX-512 and AVX2 builds
(csrc/vec16.h's NEON backend runs each lane's IEEE operation and the reduction trees of the AVX-512 form).
:func:`prefixcache.kernels.cpu_kernels.load_int4_kernels` returns this build on ARM (Graviton, Ampere, Apple
silicon under Linux).

One build, flags chosen once from the CPU's features (:func:`march`): ``-march=armv8.2-a+dotprod`` where it
reports ``asimddp``, else ``-march=armv8-a``. The ``-march`` is part of the extension's name
(:func:`extension_prefix`; the digest covers the sources alone), so a disk image moved to a CPU without the dot
product builds its own armv8-a form instead of loading one that executes ``sdot``. The bindings are
bindings_avx2.cpp's, whose x86-only int8 products (``int8_gemm_avx2``: AVX2 intrinsics) the preprocessor leaves
out here (the formats with int8 prompt products are refused on ARM: ``cpu_features.format_unavailable_reason``).

Built once per machine into torch's extension cache like the x86 builds; ``python -m
prefixcache.kernels.neon_kernels`` builds it (scripts/setup.sh; on x86 it prints one line and builds nothing).
No run-time choice between forms exists in this build (the ``-march`` fixes it), so it takes no kernel tier
(the tiers of :data:`~prefixcache.kernels.cpu_features.TIERS` are x86 features).
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path
from types import ModuleType

from prefixcache.kernels.build import build_main, load_extension
from prefixcache.kernels.cpu_features import cpu_has, describe_cpu

__all__ = ["MARCHES", "SOURCES", "NeonKernelsUnavailable", "extension_prefix", "flags", "load_neon_kernels", "march"]
_CSRC = Path(__file__).parent / "csrc"
SOURCES = [_CSRC / name for name in ("qgemm.cpp", "paged_attention.cpp", "decode_layers.cpp", "prompt_ops.cpp",
                                     "bindings_avx2.cpp")]
# -march -> what it compiles: armv8.2-a+dotprod gives qgemm_core.h's sdot blocks (__ARM_FEATURE_DOTPROD), armv8-a
# its smull + saddlp ones; vec16.h's NEON backend is the same in both (NEON is part of armv8-a)
MARCHES = {"armv8.2-a+dotprod": "asimddp", "armv8-a": "asimd"}


class NeonKernelsUnavailable(RuntimeError):
    """The NEON kernels can't run here (not an aarch64 CPU with NEON, or the extension doesn't build)."""


def march() -> str:
    """The ``-march`` this CPU (as capped by ``PREFIXCACHE_KERNELS``) takes: the first of :data:`MARCHES` whose
    feature it reports.

    Raises:
        NeonKernelsUnavailable: it reports no NEON (``asimd``): not an aarch64 CPU, or capped to ``reference``.
    """
    for name, feature in MARCHES.items():
        if cpu_has("asimd", feature):
            return name
    raise NeonKernelsUnavailable(f"our NEON kernels need an aarch64 CPU with NEON (asimd); {describe_cpu()}")


def flags(march_name: str) -> list[str]:
    """The compiler flags of the build for ``march_name`` (a key of :data:`MARCHES`), beside the ones torch's
    builder adds (``-fPIC``, ``-std=``, the include dirs, ``TORCH_EXTENSION_NAME``).

    Raises:
        ValueError: ``march_name`` is not a key of :data:`MARCHES`.
    """
    if march_name not in MARCHES:
        raise ValueError(f"march must be one of {list(MARCHES)}, got {march_name!r}")
    # -fopenmp: ATen's parallel_for is inline OpenMP; the process's libgomp is torch's, one thread pool. GCC's
    # default contraction, as in the x86 builds (the shared sources fuse the same products and sums in each).
    # -fvisibility=hidden: the same C++ names as the x86 builds, each library bound to its own definitions.
    return ["-O3", f"-march={march_name}", "-fopenmp", "-fvisibility=hidden"]


def extension_prefix(march_name: str) -> str:
    """The build's name before its sources' digest: one per ``-march``, so the two builds never share a cache
    entry (``prefixcache_neon_kernels_armv8_2_a_dotprod``)."""
    return "prefixcache_neon_kernels_" + march_name.replace(".", "_").replace("-", "_").replace("+", "_")


def load_neon_kernels() -> ModuleType:
    """The compiled extension for :func:`march` (built on first use).

    Raises:
        NeonKernelsUnavailable: the CPU (as capped by ``PREFIXCACHE_KERNELS``) reports no NEON, or the build failed
            (the compiler's message).
    """
    return _load(march())  # march() first: a cap set after the first load still holds


@cache
def _load(name: str) -> ModuleType:
    try:
        return load_extension(extension_prefix(name), SOURCES, flags(name))
    except (RuntimeError, OSError, ImportError) as e:
        raise NeonKernelsUnavailable(f"building the NEON kernels (prefixcache/kernels/csrc, -march={name}) "
                                     f"failed: {e}") from e


if __name__ == "__main__":  # setup.sh; on x86 (its own builds serve the int4 formats) one line and exit code 0
    sys.exit(build_main("neon_kernels", load_neon_kernels, NeonKernelsUnavailable, ["asimd"],
                        built_for=lambda: f"for -march={march()}"))
