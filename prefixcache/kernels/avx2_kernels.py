"""Builds and loads our AVX2 kernels (``csrc/``): ``int8_gemm_avx2`` (int8_gemm_avx2.cpp), quantization="int8"'s
exact int8 × int8 → int32 product on CPUs with AVX2 and FMA but without AVX512-VNNI or AMX-INT8, where
``torch._int_mm`` has no fast exact kernel (a reference loop runs on a Zen 3; oneDNN's AVX2 int8 kernel, which
``ONEDNN_MAX_CPU_ISA=AVX2`` forces on a bigger CPU, saturates its u8 × s8 pairs and gets sums wrong); and the AVX2
build of the int4 formats' generated-token kernels: ``int4_mm``, ``int8_mm`` (qgemm.cpp, ``vpmaddubsw`` sums
with no int16 saturation), ``paged_decode_attention`` (paged_attention.cpp's float32 form) and ``DecodeLayers``
(decode_layers.cpp), and a bf16 model's fused prompt-row ops ``add_rms_norm``, ``rope_write_kv``, ``silu_mul``
(prompt_ops.cpp; :mod:`prefixcache.kernels.prompt_ops` picks the build), from the same sources as
:mod:`prefixcache.kernels.cpu_kernels`' AVX-512 build and with the same bits (the sources' headers say why), plus
their plain-loop references (``int4_mm_reference``,
``int8_mm_reference``). :func:`prefixcache.kernels.cpu_kernels.load_int4_kernels` picks between the builds.

The sums are exact, so they equal ``torch._int_mm``'s bit for bit and a row's result never depends on the other
rows of its call (the formula and its no-saturation bound are in the source's header). The weight is packed once,
at quantization (:func:`pack_weight`, ``Int8Weight.avx2_packed``), and each call streams the packed panels.

Compiled with ``-mavx2 -mfma -mf16c`` only (it runs on any AVX2 CPU, a Zen 3 included), as its own extension, once
per machine into torch's extension cache like :mod:`prefixcache.kernels.cpu_kernels`; ``python -m
prefixcache.kernels.avx2_kernels`` builds it (scripts/setup.sh). At load it is told the tier
:func:`~prefixcache.kernels.cpu_features.kernel_tier` chose (``set_kernel_tier``).
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from prefixcache.kernels.build import build_main, load_extension, tell_tier
from prefixcache.kernels.cpu_features import TIERS, cpu_has, describe_cpu, fast_int_mm

__all__ = ["Avx2KernelsUnavailable", "int8_gemm_avx2", "int8_gemm_vnni", "int8_linear_avx2", "int8_linear_vnni",
           "int8_product_avx2", "int8_product_vnni",
           "load_avx2_kernels", "pack_weight", "pack_weight_vnni", "uses_avx2_int8_gemm", "uses_vnni_int8_gemm"]
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("int8_gemm_avx2.cpp", "int8_gemm_vnni.cpp", "qgemm.cpp", "paged_attention.cpp",
                                      "decode_layers.cpp", "prefill_attention_avx2.cpp", "prompt_ops.cpp",
                                      "bindings_avx2.cpp")]
# -fopenmp: ATen's parallel_for is inline OpenMP; the process's libgomp is torch's (same soname), one thread pool.
# GCC's default contraction (a product and a sum into one fma), as in the AVX-512 build: the shared sources
# (qgemm.cpp, paged_attention.cpp, decode_layers.cpp) fuse the same scalar products and sums in both builds
# (int8_gemm_avx2.cpp keeps its rescale unfused by itself).
# -fvisibility=hidden: this build defines the same C++ names as the AVX-512 one (int4_mm, ...); each library
# binds its own calls to its own definitions whatever else the process loaded.
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fvisibility=hidden"]
PANEL = 16  # outputs per packed panel
PAIR = 2  # inputs per int32 lane


class Avx2KernelsUnavailable(RuntimeError):
    """The AVX2 kernels can't run here (no AVX2 + FMA, or the extension doesn't build)."""


def load_avx2_kernels() -> ModuleType:
    """The compiled extension (built on first use).

    Raises:
        Avx2KernelsUnavailable: the CPU (as capped by ``PREFIXCACHE_KERNELS``) lacks AVX2, FMA or F16C, or the
            build failed (the compiler's message).
    """
    if not cpu_has(*TIERS["avx2"]):  # before the cached module: a cap set after the first load still holds
        raise Avx2KernelsUnavailable(f"our AVX2 kernels need AVX2, FMA and F16C; {describe_cpu()}")
    return tell_tier(_load())


@cache
def _load() -> ModuleType:
    try:
        module = load_extension("prefixcache_avx2_kernels", _SOURCES, _FLAGS)
    except (RuntimeError, OSError, ImportError) as e:
        raise Avx2KernelsUnavailable(f"building the AVX2 kernels (prefixcache/kernels/csrc) failed: {e}") from e
    return module


def uses_avx2_int8_gemm() -> bool:
    """Whether int8 products run :func:`int8_gemm_avx2` here: the CPU has AVX2 and FMA but none of the features
    behind ``torch._int_mm``'s fast kernels (:func:`~prefixcache.kernels.cpu_features.fast_int_mm`: AVX512-VNNI,
    AVX-VNNI, AMX-INT8), and the extension loads."""
    if fast_int_mm() or not cpu_has(*TIERS["avx2"]):
        return False
    try:
        load_avx2_kernels()
    except Avx2KernelsUnavailable:
        return False
    return True


def pack_weight(qweight: torch.Tensor) -> torch.Tensor:
    """The layout :func:`int8_gemm_avx2` streams: ``packed[p, q, 2 j + i] = w[2 q + i, 16 p + j]``, zero-padded
    (a panel of 16 outputs, one input pair at a time).

    Args:
        qweight: shape = [in_features, out_features] int8 (``Int8Weight.qweight``).

    Returns:
        shape = [ceil(out_features / 16), ceil(in_features / 2), 32] int8, contiguous.
    """
    k, n = qweight.shape
    if qweight.dtype != torch.int8:
        raise ValueError(f"qweight must be int8, got {qweight.dtype}")
    kq, panels = -(-k // PAIR), -(-n // PANEL)
    w = torch.zeros(kq * PAIR, panels * PANEL, dtype=torch.int8)
    w[:k, :n] = qweight
    # [kq, 2 (i), panels, 16 (j)] -> [panels, kq, 16 (j), 2 (i)]
    return w.view(kq, PAIR, panels, PANEL).permute(2, 0, 3, 1).reshape(panels, kq, PANEL * PAIR).contiguous()


def int8_gemm_avx2(x_q: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``torch._int_mm(x_q, w)`` for the weight ``w`` that :func:`pack_weight` packed: the same int32 bits.

    Args:
        x_q: shape = [num_tokens, in_features] int8.
        packed: :func:`pack_weight`'s result.
        out_features: ``w.shape[1]``.

    Returns:
        shape = [num_tokens, out_features] int32.
    """
    return load_avx2_kernels().int8_gemm_avx2(x_q, packed, out_features)


def int8_linear_avx2(x_q: torch.Tensor, x_scale: torch.Tensor, packed: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`int8_gemm_avx2` rescaled in the same pass: ``float(acc) * x_scale * w_scale (+ bias)``, rounded after
    each operation in that order, the bits of ``quant.int8_rows_to_float_torch(acc, ...)`` in float32.

    Args:
        x_q: shape = [num_tokens, in_features] int8.
        x_scale: shape = [num_tokens, 1] float32, contiguous.
        packed: :func:`pack_weight`'s result.
        w_scale: shape = [out_features] float32, contiguous.
        bias: shape = [out_features] float32, contiguous, or None.

    Returns:
        shape = [num_tokens, out_features] float32.
    """
    return load_avx2_kernels().int8_linear_avx2(x_q, packed, x_scale, w_scale, bias)


def int8_product_avx2(x: torch.Tensor, mul: torch.Tensor | None, packed: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``quant.int8_product`` in one call on AVX2: each row quantized (``quant.quantize_activations``' rule and
    bits, a row with a NaN or an infinity getting a NaN scale), the exact product, the rescale (+ bias) in
    ``out_dtype``: the bits of the unfused halves and of :func:`int8_product_vnni` (csrc/int8_gemm_common.h holds
    the quantization and the rescale both run).

    Args:
        x: shape = [num_tokens, in_features], float32 or bfloat16.
        mul: shape = [in_features] float32, contiguous (``Int8Weight.act_mul``), or None.
        packed: :func:`pack_weight`'s result.
        w_scale: shape = [out_features] float32, contiguous.
        bias: shape = [out_features] float32, contiguous, or None.
        out_dtype: float32 or bfloat16.

    Returns:
        shape = [num_tokens, out_features], ``out_dtype``.
    """
    return load_avx2_kernels().int8_product_avx2(x, mul, packed, w_scale, bias, out_dtype)


def uses_vnni_int8_gemm() -> bool:
    """Whether int8 products run :func:`int8_gemm_vnni` here: the CPU has AVX2 and AVX-VNNI but neither AVX512-VNNI
    nor AMX-INT8 (where ``torch._int_mm``'s oneDNN kernels are fast at every size), and the extension loads. There
    ``torch._int_mm`` would run oneDNN's AVX-VNNI GEMM, which reorders the weight on every call: a generated
    token's few rows cost several times float32's."""
    if cpu_has("avx512_vnni") or cpu_has("amx_int8") or not cpu_has(*TIERS["avx2"], "avx_vnni"):
        return False
    try:
        return bool(load_avx2_kernels().avx_vnni_ready())
    except Avx2KernelsUnavailable:
        return False


def pack_weight_vnni(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout :func:`int8_gemm_vnni` streams: ``packed[p, q, 4 j + i] = w[4 q + i, 16 p + j]``, zero-padded (a
    panel of 16 outputs, one input quad at a time), and the compensation ``128 * sum_k w[k, n]`` for the
    activations' +128 offset (csrc/int8_gemm_vnni.cpp's header).

    Args:
        qweight: shape = [in_features, out_features] int8 (``Int8Weight.qweight``).

    Returns:
        (packed [ceil(out_features / 16), ceil(in_features / 4), 64] int8, comp [16 ceil(out_features / 16)]
        int32), both contiguous.
    """
    k, n = qweight.shape
    if qweight.dtype != torch.int8:
        raise ValueError(f"qweight must be int8, got {qweight.dtype}")
    kq, panels = -(-k // 4), -(-n // PANEL)
    w = torch.zeros(kq * 4, panels * PANEL, dtype=torch.int8)
    w[:k, :n] = qweight
    comp = (w.sum(dim=0, dtype=torch.int32) * 128).contiguous()  # |comp| <= 128 * 128 * K: int32 for K < 131,072
    # [kq, 4 (i), panels, 16 (j)] -> [panels, kq, 16 (j), 4 (i)]
    return w.view(kq, 4, panels, PANEL).permute(2, 0, 3, 1).reshape(panels, kq, PANEL * 4).contiguous(), comp


def int8_gemm_vnni(x_q: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor], out_features: int) -> torch.Tensor:
    """``torch._int_mm(x_q, w)`` for the weight ``w`` that :func:`pack_weight_vnni` packed: the same int32 bits.

    Args:
        x_q: shape = [num_tokens, in_features] int8.
        packed: :func:`pack_weight_vnni`'s result.
        out_features: ``w.shape[1]``.

    Returns:
        shape = [num_tokens, out_features] int32.

    Raises:
        RuntimeError: the CPU has no AVX-VNNI.
    """
    return load_avx2_kernels().int8_gemm_vnni(x_q, *packed, out_features)


def int8_linear_vnni(x_q: torch.Tensor, x_scale: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor],
                     w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`int8_gemm_vnni` rescaled in the same pass, the bits of :func:`int8_linear_avx2` (and of
    ``quant.int8_rows_to_float_torch``) in float32; arguments as there, ``packed`` from :func:`pack_weight_vnni`."""
    return load_avx2_kernels().int8_linear_vnni(x_q, *packed, x_scale, w_scale, bias)


def int8_product_vnni(x: torch.Tensor, mul: torch.Tensor | None, packed: tuple[torch.Tensor, torch.Tensor],
                      w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``quant.int8_product`` in one call on AVX-VNNI: each row quantized (``quant.quantize_activations``' rule and
    bits, a row with a NaN or an infinity getting a NaN scale), the exact product, the rescale (+ bias) in
    ``out_dtype``, the bits of the unfused halves.

    Args:
        x: shape = [num_tokens, in_features], float32 or bfloat16.
        mul: shape = [in_features] float32, contiguous (``Int8Weight.act_mul``), or None.
        packed: :func:`pack_weight_vnni`'s result.
        w_scale: shape = [out_features] float32, contiguous.
        bias: shape = [out_features] float32, contiguous, or None.
        out_dtype: float32 or bfloat16.

    Returns:
        shape = [num_tokens, out_features], ``out_dtype``.
    """
    return load_avx2_kernels().int8_product_vnni(x, mul, *packed, w_scale, bias, out_dtype)


if __name__ == "__main__":  # setup.sh; exit code 0 where the CPU can't run them too
    sys.exit(build_main("avx2_kernels", load_avx2_kernels, Avx2KernelsUnavailable, TIERS["avx2"]))
