"""The aarch64 torch extension (prefixcache/kernels/neon_kernels.py): which ARM CPUs run the int4 formats on it, and
that each of its translation units compiles for aarch64.

There is no aarch64 libtorch here, so the build is checked up to its object files: each source the loader compiles
(``neon_kernels.SOURCES``) is cross-compiled with Debian's ``aarch64-linux-gnu-g++`` (``-c``, no link) with the
flags torch's builder passes (the loader's own, :func:`neon_kernels.flags`, plus its ``-fPIC``, ``-std=c++20``,
``TORCH_EXTENSION_NAME`` and ``-isystem`` dirs: this venv's torch headers and the Python ones, the headers an x86
wheel ships, which hold no x86-only code on the paths these sources include). The objects are aarch64 ELF, the
dotprod build's products hold ``sdot`` and the armv8-a one's none, and between them they define every entry point the
bindings reference, with no x86-only one (``int8_gemm_avx2``) left referenced. What this doesn't show: the link
against an aarch64 libtorch, the import, or speed (nothing ran on an ARM machine); the kernels' bits on aarch64 are
tests/kernels/test_aarch64_build.py's (qemu).

A translation unit that includes torch/extension.h takes tens of seconds to compile, so the objects are cached under
the temp dir by the sources' digest, the flags, the compiler's and torch's versions, and the plain armv8-a build
(the less common one: Graviton from its second generation, Ampere and Apple cores have the dot product) runs only in
the full suite (``slow``)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.utils.cpp_extension import include_paths

from prefixcache.kernels import cpu_features as cf
from prefixcache.kernels import neon_kernels
from prefixcache.kernels.build import extension_name

CXX, NM, OBJDUMP = "aarch64-linux-gnu-g++", "aarch64-linux-gnu-nm", "aarch64-linux-gnu-objdump"
EM_AARCH64 = 183  # the ELF header's e_machine for aarch64
# defined by the objects together; the bindings reference them all
ENTRY_POINTS = {"int4_mm", "int8_mm", "int4_mm_reference", "int8_mm_reference", "paged_decode_attention",
                "paged_decode_attention_float32", "bind_decode_layers", "prefixcache_kernel_tier",
                "add_rms_norm", "rope_write_kv", "silu_mul"}  # the last three: prompt_ops.cpp
X86_ONLY = {"int8_gemm_avx2", "int8_linear_avx2"}  # int8_gemm_avx2.cpp: AVX2 intrinsics, not in this build
GRAVITON2 = frozenset({"asimd", "asimddp"})  # Neoverse N1: NEON with the int8 dot product (sdot)
CORTEX_A72 = frozenset({"asimd"})  # armv8-a NEON only (Graviton 1, a Raspberry Pi 4)

needs_cross_compiler = pytest.mark.skipif(
    shutil.which(CXX) is None or shutil.which(NM) is None or shutil.which(OBJDUMP) is None,
    reason=f"{CXX} (and its binutils) not installed (apt-get install g++-aarch64-linux-gnu)")


def test_arm_cpus_run_int4_on_the_neon_build(fake_cpu):
    """int4 runs (the NEON build), int4-int8 and int8 don't (no known fast torch._int_mm there), bfloat16 alone
    doesn't (oneDNN's bf16 products need x86 features), auto keeps float32 (nothing was measured on ARM)."""
    for flags, march in ((GRAVITON2, "armv8.2-a+dotprod"), (CORTEX_A72, "armv8-a")):
        fake_cpu(flags)
        assert neon_kernels.march() == march
        assert cf.format_unavailable_reason("bfloat16", "int4") is None
        assert cf.format_unavailable_reason("float32", "int4") is None
        assert "quantization int4 (--quantization int4) runs the same" in cf.format_unavailable_reason("bfloat16",
                                                                                                    "int4-int8")
        assert "needs fast int8 products" in cf.format_unavailable_reason("float32", "int8")
        assert "dtype='bfloat16' needs" in cf.format_unavailable_reason("bfloat16", "none")
        assert cf.auto_format("auto", "auto") == ("float32", "none")
        assert cf.kernel_tier() == "reference"  # the tiers are x86 features


def test_the_cap_takes_neon_away_unless_named(fake_cpu):
    fake_cpu(GRAVITON2, cap="reference")
    with pytest.raises(neon_kernels.NeonKernelsUnavailable, match="asimd"):
        neon_kernels.march()
    assert "AVX2, FMA and F16C, or aarch64 NEON" in cf.format_unavailable_reason("bfloat16", "int4")
    fake_cpu(GRAVITON2, cap="reference+asimd")  # NEON kept, its dot product not: the armv8-a form
    assert neon_kernels.march() == "armv8-a" and cf.format_unavailable_reason("bfloat16", "int4") is None
    fake_cpu(GRAVITON2, cap="reference+asimd+asimddp")
    assert neon_kernels.march() == "armv8.2-a+dotprod"


def test_x86_cpus_keep_their_rules_and_never_take_the_neon_build(fake_cpu):
    fake_cpu(frozenset({"avx2", "fma", "f16c"}))
    assert cf.format_unavailable_reason("bfloat16", "int4-int8") is None  # our AVX2 int8 kernel, as before
    with pytest.raises(neon_kernels.NeonKernelsUnavailable):
        neon_kernels.march()
    fake_cpu(frozenset({"sse4_2"}))
    assert "AVX2, FMA and F16C" in cf.format_unavailable_reason("bfloat16", "int4")


def test_each_march_has_its_own_build_name_and_flags():
    names = {neon_kernels.extension_prefix(m) for m in neon_kernels.MARCHES}
    assert names == {"prefixcache_neon_kernels_armv8_2_a_dotprod", "prefixcache_neon_kernels_armv8_a"}
    assert neon_kernels.flags("armv8-a") == ["-O3", "-march=armv8-a", "-fopenmp", "-fvisibility=hidden"]
    with pytest.raises(ValueError, match="march must be one of"):
        neon_kernels.flags("armv9-a")


def _version(tool: str) -> str:
    return subprocess.run([tool, "-dumpfullversion"], capture_output=True, text=True, check=True).stdout.strip()


def _command(march: str, source: Path, obj: Path) -> list[str]:
    """torch's builder's command line for one source (torch/utils/cpp_extension.py, its ninja file's cflags) with
    the cross compiler in place of c++."""
    name = extension_name(neon_kernels.extension_prefix(march), neon_kernels.SOURCES)
    system = [*include_paths("cpu"), sysconfig.get_path("include", scheme="posix_prefix")]
    return [CXX, f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
            *[arg for d in system for arg in ("-isystem", d)], "-fPIC", "-std=c++20", *neon_kernels.flags(march),
            "-c", str(source), "-o", str(obj)]


def _objects(march: str) -> dict[str, Path]:
    """source name -> its aarch64 object, compiled (in parallel, at most one per core) unless cached."""
    key = hashlib.sha256(" ".join([extension_name("neon", neon_kernels.SOURCES), *neon_kernels.flags(march),
                                   _version(CXX), torch.__version__]).encode()).hexdigest()[:16]
    cache = Path(tempfile.gettempdir()) / "prefixcache_aarch64_extension" / f"{march.replace('+', '_')}_{key}"
    cache.mkdir(parents=True, exist_ok=True)
    objects = {s.name: cache / f"{s.stem}.o" for s in neon_kernels.SOURCES}

    def compile_one(source: Path) -> None:
        obj = objects[source.name]
        if obj.exists():
            return
        partial = obj.with_suffix(".partial")
        run = subprocess.run(_command(march, source, partial), capture_output=True, text=True)
        assert run.returncode == 0, f"{source.name} for -march={march}:\n{run.stderr[-4000:]}"
        partial.replace(obj)

    with ThreadPoolExecutor(max_workers=min(len(objects), os.cpu_count() or 1)) as pool:
        list(pool.map(compile_one, neon_kernels.SOURCES))
    return objects


def _symbols(obj: Path) -> tuple[set[str], set[str]]:
    """(defined, undefined) names in ``obj``, demangled, without their parameter lists."""
    out = subprocess.run([NM, "-C", str(obj)], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split(maxsplit=2) if not line.startswith(" ") else ["", *line.split(maxsplit=1)]
        kind, name = parts[-2], parts[-1].split("(")[0]
        (undefined if kind == "U" else defined).add(name)
    return defined, undefined


@needs_cross_compiler
@pytest.mark.parametrize("march", [pytest.param("armv8.2-a+dotprod"),
                                   pytest.param("armv8-a", marks=pytest.mark.slow)])
def test_each_source_of_the_extension_compiles_for_aarch64(march):
    objects = _objects(march)
    defined, undefined = set(), set()
    for obj in objects.values():
        header = obj.read_bytes()[:20]
        assert header[:5] == b"\x7fELF\x02" and int.from_bytes(header[18:20], "little") == EM_AARCH64, obj
        d, u = _symbols(obj)
        defined |= d
        undefined |= u
    assert ENTRY_POINTS <= defined
    assert not (undefined & X86_ONLY) and not (defined & X86_ONLY)
    assert not (undefined & ENTRY_POINTS) - defined
    name = extension_name(neon_kernels.extension_prefix(march), neon_kernels.SOURCES)
    assert f"PyInit_{name}" in _symbols(objects["bindings_avx2.cpp"])[0]
    code = subprocess.run([OBJDUMP, "-d", str(objects["qgemm.cpp"])], capture_output=True, text=True,
                          check=True).stdout
    assert ("\tsdot\t" in code) == (march == "armv8.2-a+dotprod")  # qgemm_core.h's int sums: sdot or smull
    assert "\tsmull" in code or march == "armv8.2-a+dotprod"
