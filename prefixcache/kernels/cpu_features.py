"""What this CPU can run: the instruction-set features our kernels and torch's fast paths need, read once,
and which weight formats therefore run here.

Tiers, each a superset of the one before (ggml's and vLLM's CPU backends draw the same lines):

==============  =====================================================  ==========================================
tier            features (Linux ``/proc/cpuinfo`` names)                what it adds
==============  =====================================================  ==========================================
``reference``   none                                                   torch's float32 path: runs everywhere
``avx2``        avx2, fma, f16c                                        our AVX2 build: int8 product, int4 decoder
``avx512``      + avx512f, avx512bw, avx512vl, avx512dq, avx512_vnni   oneDNN's bf16 and int8 products; our int4
``avx512_bf16`` + avx512_bf16                                          our bf16 attention and prompt kernels
``amx``         + amx_tile, amx_bf16, amx_int8                         our AMX-BF16 GEMM and attention forms
==============  =====================================================  ==========================================

``PREFIXCACHE_KERNELS`` caps the tier (``auto``, the default, takes what the CPU reports): ``reference`` runs no
compiled kernel and no ISA-specific format, ``avx2`` behaves as an AVX2-only CPU (a Zen 3, say) would, and so
on; ``+`` adds features outside the tiers back to a tier (``avx2+avx_vnni`` behaves as an Alder Lake or a Zen 5
without AVX-512 would). It can only take features away, never add one the CPU lacks: a forced lower tier keeps
the fallbacks honest on a bigger machine (the test suite runs a subset that way). It caps our choices only: for
timings that stand for a smaller CPU, cap torch's own kernels as well (``ONEDNN_MAX_CPU_ISA=AVX2`` or
``AVX2_VNNI``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``, ``ATEN_CPU_CAPABILITY=avx2``).
"""

from __future__ import annotations

import os
import platform
from functools import cache

__all__ = ["AUTO_FORMATS", "TIERS", "auto_format", "cpu_features", "cpu_has", "describe_cpu", "fast_int_mm",
           "format_unavailable_reason", "kernel_tier", "reported_cpu_features"]

ENV_VAR = "PREFIXCACHE_KERNELS"
_AVX2 = frozenset({"avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
_AVX512_BF16 = _AVX512 | {"avx512_bf16"}
_AMX = _AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}
TIERS: dict[str, frozenset[str]] = {"reference": frozenset(), "avx2": _AVX2, "avx512": _AVX512,
                                    "avx512_bf16": _AVX512_BF16, "amx": _AMX}
# Features outside the tiers that decide something: AVX-VNNI / AVX-NE-CONVERT (Alder Lake and later: oneDNN's
# bf16 products run on avx_ne_convert too), AVX512-FP16 (float16's products), and ARM's NEON (asimd) with its
# int8 dot product (asimddp).
_EXTRA = frozenset({"avx_vnni", "avx_ne_convert", "avx512_fp16", "asimd", "asimddp"})
_KNOWN = _AMX | _EXTRA
# oneDNN's bf16 linear needs one of these sets (torch raises "bf16 path needs the cpu support avx_ne_convert or
# avx512bw, avx512vl and avx512dq" at the weight's reorder otherwise)
_BF16_PRODUCTS = (frozenset({"avx512bw", "avx512vl", "avx512dq"}), frozenset({"avx_ne_convert"}))
# torch._int_mm's fast CPU path: oneDNN's VNNI or AMX int8 kernels. Without them it runs a reference loop
# (a 2,183-token SmolLM2 prompt took 292 s on a Zen 3, float32 9.5 s), so int8 is refused there. AVX-VNNI
# (vpdpbusd on ymm: Alder Lake and later, Zen 5) counts: oneDNN's avx2_vnni int8 GEMM offsets the activations to
# u8 and subtracts 128 * the weight's column sums, and vpdpbusd sums in int32 without saturating, so its sums are
# exact (torch._int_mm equals a float64 reference), and it ran about 3x float32's AVX2 GEMM at prompt shapes
# where oneDNN was capped to it. Plain AVX2's oneDNN kernel (vpmaddubsw) saturates: our own exact kernel runs there.
# torch's float16 linear on CPU is fast on oneDNN's AVX512-FP16 kernels only: a 1,000-token SmolLM2 prompt took
# 1.0 s in float16 with oneDNN capped to AVX512_CORE_FP16 and 6.6-7.1 s capped to AVX2, AVX512_CORE_VNNI or
# AVX512_CORE_BF16 (float32: 1.05-1.15 s), so float16 is refused on a CPU without it.
_FP16_PRODUCTS = (frozenset({"avx512_fp16"}),)
_INT8_PRODUCTS = (frozenset({"avx512_vnni"}), frozenset({"amx_int8"}), frozenset({"avx_vnni"}))
_INT4_FORMATS = ("int4", "int4-int8")  # the formats whose generated tokens run our int4 decoder
# Our int4 decoder has an AVX512-VNNI build and an AVX2 + FMA + F16C one (the same bits): either tier runs it.
# On aarch64 its NEON build (neon_kernels.py: asimd, sdot where asimddp) runs it outside the tiers, which are x86
# features: a cap keeps asimd only when named (``reference+asimd``), so ``reference`` alone runs no NEON kernel.
# int4-int8 stays refused there (no known fast torch._int_mm on ARM for its prompt rows).
# int4-int8's prompt rows run W8A8 products, on oneDNN (_INT8_PRODUCTS) or, on AVX2, on our exact AVX2 kernel;
# int4's prompt rows run bf16 products, oneDNN's prepacked ones where _BF16_PRODUCTS, else torch's plain bf16
# matmul (layers/linear.py's fallback).


@cache
def reported_cpu_features() -> frozenset[str]:
    """The features of :data:`TIERS` and the few others we read that this CPU reports (``/proc/cpuinfo``'s
    flags on Linux; elsewhere what torch's own checks say)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):  # x86, ARM
                    return frozenset(value.split()) & _KNOWN
    except OSError:
        pass
    return _features_from_torch()


def _features_from_torch() -> frozenset[str]:
    """Where there is no /proc/cpuinfo (macOS, Windows): torch's checks, which read cpuid."""
    import torch

    found: set[str] = set()
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", "NEON", ...
    if capability in ("AVX2", "AVX512"):
        found |= _AVX2
    if torch.cpu._is_avx512_supported():
        found |= {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    if torch.cpu._is_vnni_supported():
        found.add("avx512_vnni")
    if torch.cpu._is_avx512_bf16_supported():
        found.add("avx512_bf16")
    if torch.cpu._is_amx_tile_supported():
        found |= {"amx_tile", "amx_bf16", "amx_int8"}
    if platform.machine().lower() in ("arm64", "aarch64"):
        found.add("asimd")
    return frozenset(found)


@cache
def cpu_features() -> frozenset[str]:
    """:func:`reported_cpu_features` capped by ``PREFIXCACHE_KERNELS`` (see the module docstring).

    Raises:
        ValueError: ``PREFIXCACHE_KERNELS`` is not ``auto`` or a tier name, optionally followed by ``+`` and
            features outside the tiers (:func:`_features_of`).
    """
    cap = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    reported = reported_cpu_features()
    if cap == "auto":
        return reported
    return reported & _features_of(cap)


def _features_of(spec: str) -> frozenset[str]:
    """The features ``spec``, a ``PREFIXCACHE_KERNELS`` value other than ``auto`` in lower case, names: its form is
    ``tier+extra+...``, the tier's features of :data:`TIERS` and each extra (``avx2+avx_vnni``: AVX2, FMA, F16C and
    AVX-VNNI). The one parser of that form, for the cap (:func:`cpu_features`) and :data:`AUTO_FORMATS`' rows alike.

    Raises:
        ValueError: the tier is not one of :data:`TIERS`, or an extra is not a feature outside the tiers (a tier's
            own features come with its name), naming ``PREFIXCACHE_KERNELS``.
    """
    tier, *extras = spec.split("+")
    if tier not in TIERS:
        raise ValueError(f"{ENV_VAR} must be 'auto' or one of {list(TIERS)}, optionally followed by '+' and "
                         f"features of {sorted(_EXTRA)}, got {spec!r}")
    unknown = sorted(set(extras) - _EXTRA)
    if unknown:
        raise ValueError(f"{ENV_VAR}={spec!r}: {unknown} can't be added to a tier; the features that can are "
                         f"{sorted(_EXTRA)} (a tier's own features come with the tier's name)")
    return TIERS[tier] | frozenset(extras)


def cpu_has(*features: str) -> bool:
    """Whether every feature named (``/proc/cpuinfo`` names, e.g. ``"avx512_vnni"``) is in :func:`cpu_features`."""
    return set(features) <= cpu_features()


def kernel_tier() -> str:
    """The highest tier of :data:`TIERS` whose features this CPU (as capped) has all of."""
    return [name for name, needed in TIERS.items() if needed <= cpu_features()][-1]


def _shown_features() -> str:
    """The features that decide something, as the start-up log names them (``avx2+fma+avx_vnni``)."""
    features = cpu_features()
    return "+".join(name for name in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16",
                                      "avx512_fp16", "avx_ne_convert", "amx_bf16", "amx_int8", "asimd", "asimddp")
                    if name in features) or "baseline"


def _capped() -> bool:
    return cpu_features() != reported_cpu_features()


def describe_cpu() -> str:
    """One line for the start-up log, e.g. ``"cpu: avx2+fma+avx512f+avx512_vnni+avx512_bf16+amx_bf16+amx_int8,
    kernels: amx"``."""
    capped = f" (capped by {ENV_VAR})" if _capped() else ""
    return f"cpu: {_shown_features()}{capped}, kernels: {kernel_tier()}"


def _this_cpu() -> str:
    """How a refusal names the CPU: ``this CPU (avx2+fma)``, or ``this CPU as PREFIXCACHE_KERNELS caps it (...)``."""
    return f"this CPU{f' as {ENV_VAR} caps it' if _capped() else ''} ({_shown_features()})"


def _has_any(options: tuple[frozenset[str], ...]) -> bool:
    return any(option <= cpu_features() for option in options)


def fast_int_mm() -> bool:
    """Whether ``torch._int_mm`` has a fast exact kernel on this CPU (as capped): oneDNN's AVX512-VNNI, AMX-INT8
    or AVX-VNNI int8 GEMMs. Where it hasn't but the CPU has AVX2, int8 products run our own exact AVX2 kernel."""
    return _has_any(_INT8_PRODUCTS)


def format_unavailable_reason(dtype: str, quantization: str) -> str | None:
    """Why ``dtype`` / ``quantization`` can't run (fast) on this CPU, saying what to use instead; None
    where it can. Only the CPU's features are read (nothing is built or loaded).

    A format that would run pathologically slowly (int8 without VNNI or AMX int8) is refused like one that
    can't run at all: a user who picks it would wait tens of times longer than on float32.
    """
    cpu = _this_cpu()
    instead = ("use float32 with quantization none (--dtype float32 --quantization none), which runs on every CPU, "
               "or auto, this CPU's fastest format")
    if dtype == "float16" and not _has_any(_FP16_PRODUCTS):
        return (f"dtype='float16' needs AVX512-FP16 (Sapphire Rapids and later) for oneDNN's float16 products, "
                f"which {cpu} lacks (without it a prompt takes about 6x float32's time): {instead}")
    if quantization in _INT4_FORMATS:
        if cpu_has("asimd") and not cpu_has(*TIERS["avx2"]):  # aarch64: the NEON build (neon_kernels.py)
            if quantization == "int4-int8" and not _has_any(_INT8_PRODUCTS):
                return (f"quantization={quantization!r} runs its prompt rows' products in int8 (torch._int_mm), "
                        f"which has no known fast kernel on {cpu}; quantization int4 (--quantization int4) runs the "
                        f"same generated-token kernels with bf16 prompt products; or {instead}")
            return None
        if not cpu_has(*TIERS["avx2"]):
            return (f"quantization={quantization!r} runs our int4 kernels, which need a CPU with AVX2, FMA and "
                    f"F16C, or aarch64 NEON, and {cpu} has neither: {instead}")
        if quantization == "int4" and not _has_any(_BF16_PRODUCTS):
            return (f"quantization='int4' runs its prompt rows' products in bf16, which need AVX-512 (BW, VL, DQ) "
                    f"or AVX-NE-CONVERT for oneDNN's kernels; torch's plain bf16 matmul on {cpu} takes about 4x "
                    f"float32's prompt time. Quantization int4-int8 (--quantization int4-int8) runs the same int4 "
                    f"generated-token kernels with our int8 prompt products; or {instead}")
        return None  # int4-int8's prompt rows run our AVX2 int8 kernel where oneDNN has no exact one (above)
    if quantization == "int8" and not _has_any(_INT8_PRODUCTS) and not cpu_has(*TIERS["avx2"]):
        return (f"quantization={quantization!r} needs fast int8 products (AVX512-VNNI, AVX-VNNI or AMX-INT8, "
                f"oneDNN's kernels behind torch._int_mm, or AVX2 + FMA + F16C for our exact AVX2 kernel); without "
                f"them a prompt takes ~30x longer than in float32, and {cpu} has none: {instead}")
    if dtype == "bfloat16" and not _has_any(_BF16_PRODUCTS):
        return (f"dtype='bfloat16' needs a CPU with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT for oneDNN's bf16 "
                f"products, and {cpu} has neither: {instead}")
    return None


# What ``auto`` picks, best first: the fastest format this CPU runs whose perplexity on the bench's quality text
# stays within 1 % of float32's (docs/benchmarks.md, "Quality per format": bf16 +0.1 %, int4 +0.2 %, int4-int8
# +0.4 %, int8 +0.6 %). With AMX, bf16 + int4 was the fastest measured (prompt rows on AMX tiles, generated rows on
# the int4 decoder); without AMX but with AVX512-BF16, int4-int8 (int8 prompt rows are faster than bf16 there);
# with VNNI but no native bf16, int8 over a float32 model; with AVX2 (and AVX-VNNI or not), int4-int8 again: its
# prompt rows on our int8 kernels at least as fast as float32's AVX2 GEMM, its generated rows on the int4 decoder
# (about 8x float32's decode with torch's kernels capped to AVX2), or int8 where LoRA rules int4 out; elsewhere
# float32, which runs on every CPU. A row's first field is what the CPU needs, in PREFIXCACHE_KERNELS' syntax.
AUTO_FORMATS: tuple[tuple[str, str, str], ...] = (
    ("amx", "bfloat16", "int4"),
    ("avx512_bf16", "bfloat16", "int4-int8"),
    ("avx512", "float32", "int8"),
    ("avx2", "bfloat16", "int4-int8"),
    ("avx2", "float32", "int8"),
    ("reference", "float32", "none"),
)


def auto_format(dtype: str, quantization: str, lora: bool = False) -> tuple[str, str]:
    """``(dtype, quantization)`` with ``"auto"`` in either replaced by this CPU's choice: the first row of
    :data:`AUTO_FORMATS` whose features the CPU has and which agrees with the one given, if any; where no row does,
    the given one with its plainest partner (float32, or bfloat16 for an int4 format; none). ``lora``: LoRA
    adapters will be served, so no int4 format (their generated tokens run fused kernels without adapter
    deltas)."""
    if "auto" not in (dtype, quantization):
        return dtype, quantization
    for needs, d, q in AUTO_FORMATS:
        if (cpu_has(*_features_of(needs)) and dtype in ("auto", d) and quantization in ("auto", q)
                and not (lora and q in _INT4_FORMATS) and format_unavailable_reason(d, q) is None):
            return d, q
    d = dtype if dtype != "auto" else "bfloat16" if quantization in _INT4_FORMATS else "float32"
    return d, (quantization if quantization != "auto" else "none")
