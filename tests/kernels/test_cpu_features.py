"""Which formats run on which CPU, read from its features: an AVX2-only CPU (AMD Zen 3), AVX2 with AVX-VNNI (Intel
Alder Lake's P-cores without AVX-512), AVX-512 without VNNI (Skylake-SP), AVX-512 with VNNI and BF16 (AMD Zen 4),
AMX (Intel Sapphire Rapids); PREFIXCACHE_KERNELS' cap; and the line and exit code each build's ``python -m``
prints for scripts/setup.sh on each CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from prefixcache.config import EngineConfig
from prefixcache.errors import InvalidInputError
from prefixcache.kernels import cpu_features as cf
from prefixcache.kernels.build import build_main

ZEN3 = frozenset({"avx2", "fma", "f16c"})
ALDER_LAKE = ZEN3 | {"avx_vnni"}
SKYLAKE_SP = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
ZEN4 = SKYLAKE_SP | {"avx512_vnni", "avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"avx_vnni", "amx_tile", "amx_bf16", "amx_int8"}
FORMATS = [("float32", "none"), ("bfloat16", "none"), ("float32", "int8"), ("bfloat16", "int8"),
           ("bfloat16", "int4"), ("bfloat16", "int4-int8")]


@pytest.mark.parametrize("flags,runs", [
    (frozenset(), [("float32", "none")]),
    # our AVX2 build: the exact int8 product and the int4 decoder; bf16 products (bfloat16 / none, int4's prompt
    # rows) need AVX-512 or AVX-NE-CONVERT
    (ZEN3, [("float32", "none"), ("float32", "int8"), ("bfloat16", "int4-int8")]),
    (ALDER_LAKE, [("float32", "none"), ("float32", "int8"), ("bfloat16", "int4-int8")]),
    (SKYLAKE_SP, FORMATS),  # int8 on our AVX2 kernel (no VNNI), bf16 on oneDNN
    (ZEN4, FORMATS),
    (SAPPHIRE_RAPIDS, FORMATS),
])
def test_each_cpu_runs_exactly_the_formats_its_features_allow(fake_cpu, flags, runs):
    fake_cpu(flags)
    assert [f for f in FORMATS if cf.format_unavailable_reason(*f) is None] == runs


def test_the_tiers_and_the_start_up_line(fake_cpu):
    for flags, tier in ((frozenset(), "reference"), (ZEN3, "avx2"), (ALDER_LAKE, "avx2"), (SKYLAKE_SP, "avx2"),
                        (ZEN4, "avx512_bf16"), (SAPPHIRE_RAPIDS, "amx")):
        fake_cpu(flags)
        assert cf.kernel_tier() == tier
    fake_cpu(ZEN3)
    assert cf.describe_cpu() == "cpu: avx2+fma, kernels: avx2"
    fake_cpu(SAPPHIRE_RAPIDS, cap="avx2")
    assert cf.describe_cpu() == "cpu: avx2+fma (capped by PREFIXCACHE_KERNELS), kernels: avx2"


def test_the_cap_only_takes_features_away(fake_cpu):
    fake_cpu(ZEN3, cap="amx")
    assert cf.cpu_features() == ZEN3
    fake_cpu(SAPPHIRE_RAPIDS, cap="avx512")
    assert cf.cpu_features() == cf.TIERS["avx512"] and cf.kernel_tier() == "avx512"
    fake_cpu(SAPPHIRE_RAPIDS, cap="reference")
    assert cf.cpu_features() == frozenset() and cf.format_unavailable_reason("bfloat16", "none") is not None
    fake_cpu(SAPPHIRE_RAPIDS, cap="AUTO")
    assert cf.cpu_features() == SAPPHIRE_RAPIDS
    fake_cpu(SAPPHIRE_RAPIDS, cap="avx9")
    with pytest.raises(ValueError, match=r"PREFIXCACHE_KERNELS must be 'auto' or one of \['reference', 'avx2', "):
        cf.cpu_features()


def test_the_cap_adds_features_outside_the_tiers_back_with_a_plus(fake_cpu):
    """``avx2+avx_vnni`` stands for an Alder Lake on a Sapphire Rapids: int8 runs (torch._int_mm on AVX-VNNI),
    not on our AVX2 kernel; a feature the CPU lacks is still not added, and a tier's own feature or an unknown
    name after ``+`` is refused naming the ones that can be added."""
    from prefixcache.kernels import avx2_kernels

    fake_cpu(SAPPHIRE_RAPIDS, cap="avx2+avx_vnni")
    assert cf.cpu_features() == ALDER_LAKE and cf.kernel_tier() == "avx2" and cf.fast_int_mm()
    assert cf.describe_cpu() == "cpu: avx2+fma+avx_vnni (capped by PREFIXCACHE_KERNELS), kernels: avx2"
    assert cf.format_unavailable_reason("float32", "int8") is None and not avx2_kernels.uses_avx2_int8_gemm()
    fake_cpu(SAPPHIRE_RAPIDS, cap="avx2")
    assert not cf.fast_int_mm() and not avx2_kernels.uses_vnni_int8_gemm()
    fake_cpu(ZEN3, cap="avx2+avx_vnni")
    assert cf.cpu_features() == ZEN3 and not cf.fast_int_mm()
    for cap, bad in (("avx2+avx512f", "['avx512f']"), ("avx2+avx_vnni+sse9", "['sse9']")):
        fake_cpu(SAPPHIRE_RAPIDS, cap=cap)
        with pytest.raises(ValueError) as e:
            cf.cpu_features()
        assert str(e.value) == (f"PREFIXCACHE_KERNELS={cap!r}: {bad} can't be added to a tier; the features that can "
                                "are ['asimd', 'asimddp', 'avx512_fp16', 'avx_ne_convert', 'avx_vnni'] (a tier's own features come "
                                "with the tier's name)")


@pytest.mark.parametrize("flags,dtype,quantization,field,start", [
    (ZEN3, "bfloat16", "none", "dtype", "dtype='bfloat16' needs a CPU with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT"),
    (frozenset(), "float32", "int8", "quantization", "quantization='int8' needs fast int8 products (AVX512-VNNI, "
                                                     "AVX-VNNI or AMX-INT8, oneDNN's kernels behind torch._int_mm, or "
                                                     "AVX2 + FMA + F16C"),
    (frozenset(), "bfloat16", "int4", "quantization", "quantization='int4' runs our int4 kernels, which need a CPU "
                                                      "with AVX2, FMA and F16C, or aarch64 NEON, and this CPU (baseline) has "
                                                      "neither: "),
    # int4's prompt rows are bf16 products: as slow as bfloat16 / none where that is refused (a 2,000-token prompt
    # took 38-53 s on AVX2, int4-int8 2.6 s); int4-int8 runs the same decoder
    (ZEN3, "bfloat16", "int4", "quantization", "quantization='int4' runs its prompt rows' products in bf16, which "
                                               "need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT for oneDNN's kernels; "
                                               "torch's plain bf16 matmul on this CPU (avx2+fma) takes about 4x"),
    (ZEN4, "float16", "none", "dtype", "dtype='float16' needs AVX512-FP16 (Sapphire Rapids and later) for oneDNN's "
                                       "float16 products, which this CPU (avx2+fma+avx512f+avx512_vnni+avx512_bf16) "
                                       "lacks (without it a prompt takes about 6x float32's time): use float32"),
])
def test_a_format_the_cpu_cannot_run_is_refused_by_the_config_naming_the_field(fake_cpu, flags, dtype, quantization,
                                                                               field, start):
    fake_cpu(flags)
    with pytest.raises(InvalidInputError) as e:
        EngineConfig.from_kwargs(dtype=dtype, quantization=quantization, device="cpu")
    assert e.value.field == field and str(e.value).startswith(start)
    assert str(e.value).endswith("use float32 with quantization none (--dtype float32 --quantization none), which "
                                 "runs on every CPU, or auto, this CPU's fastest format")
    assert EngineConfig.from_kwargs(dtype=dtype, quantization=quantization, device="cuda").dtype == dtype  # not a CPU's


def test_int4_and_float16_run_where_their_prompt_products_are_fast_and_a_capped_cpu_is_named_so(fake_cpu):
    fake_cpu(ZEN4)
    assert cf.format_unavailable_reason("bfloat16", "int4") is None
    assert cf.format_unavailable_reason("bfloat16", "int4-int8") is None
    fake_cpu(ZEN3)
    assert cf.format_unavailable_reason("bfloat16", "int4-int8") is None
    assert "Quantization int4-int8 (--quantization int4-int8) runs the same int4" in cf.format_unavailable_reason(
        "bfloat16", "int4")
    fake_cpu(SAPPHIRE_RAPIDS | {"avx512_fp16"})
    assert cf.format_unavailable_reason("float16", "none") is None
    fake_cpu(SAPPHIRE_RAPIDS | {"avx512_fp16"}, cap="amx")  # the cap keeps a tier's features and named extras
    assert "this CPU as PREFIXCACHE_KERNELS caps it (avx2+fma+avx512f+avx512_vnni+avx512_bf16+amx_bf16+amx_int8)" in (
        cf.format_unavailable_reason("float16", "none"))
    fake_cpu(SAPPHIRE_RAPIDS | {"avx512_fp16"}, cap="amx+avx512_fp16")
    assert cf.format_unavailable_reason("float16", "none") is None
    fake_cpu(SAPPHIRE_RAPIDS, cap="reference")
    assert "this CPU as PREFIXCACHE_KERNELS caps it (baseline)" in cf.format_unavailable_reason("float32", "int8")


def test_this_cpus_features_are_read_from_cpuinfo():
    """The real reading (no fake): every tier's features are ones /proc/cpuinfo names, and a CPU that reports
    avx512_vnni reports the AVX-512 base it needs."""
    features = cf.reported_cpu_features()
    assert features <= cf._KNOWN
    if "avx512_vnni" in features:
        assert {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= features


@pytest.mark.parametrize("flags,picks,with_lora", [
    (frozenset(), ("float32", "none"), ("float32", "none")),
    (ZEN3, ("bfloat16", "int4-int8"), ("float32", "int8")),  # LoRA: no int4 format
    (ALDER_LAKE, ("bfloat16", "int4-int8"), ("float32", "int8")),
    (SKYLAKE_SP, ("bfloat16", "int4-int8"), ("float32", "int8")),
    (ZEN4, ("bfloat16", "int4-int8"), ("float32", "int8")),
    (SAPPHIRE_RAPIDS, ("bfloat16", "int4"), ("float32", "int8")),
])
def test_auto_picks_each_cpus_row(fake_cpu, flags, picks, with_lora):
    fake_cpu(flags)
    assert cf.auto_format("auto", "auto") == picks
    assert cf.auto_format("auto", "auto", lora=True) == with_lora
    assert cf.auto_format("float32", "auto") == (("float32", "int8") if flags else ("float32", "none"))
    assert cf.auto_format("float32", "none") == ("float32", "none")  # nothing auto: as given


def test_auto_reads_its_rows_as_the_cap_is_read(fake_cpu, monkeypatch):
    """A row's first field is PREFIXCACHE_KERNELS' syntax, parsed by the same function: ``+`` features count, and
    a row naming a tier's own feature after ``+`` is refused with the cap's message."""
    monkeypatch.setattr(cf, "AUTO_FORMATS", (("avx2+avx_vnni", "float32", "int8"), ("reference", "float32", "none")))
    fake_cpu(ALDER_LAKE)
    assert cf.auto_format("auto", "auto") == ("float32", "int8")
    fake_cpu(ZEN3)  # no AVX-VNNI: the row doesn't apply
    assert cf.auto_format("auto", "auto") == ("float32", "none")
    monkeypatch.setattr(cf, "AUTO_FORMATS", (("avx2+avx512f", "float32", "int8"),))
    with pytest.raises(ValueError) as e:
        cf.auto_format("auto", "auto")
    assert str(e.value) == ("PREFIXCACHE_KERNELS='avx2+avx512f': ['avx512f'] can't be added to a tier; the features "
                            "that can are ['asimd', 'asimddp', 'avx512_fp16', 'avx_ne_convert', 'avx_vnni'] (a tier's own features "
                            "come with the tier's name)")


class _Unavailable(RuntimeError):
    pass


def test_the_setup_line_and_exit_code_of_a_build(fake_cpu, capsys):
    """Built: 0 and ``built``; not built: the error's first line only, 0 where the CPU (as capped) lacks what the
    build needs (nothing to build), 1 where it has it (the build itself failed)."""
    def fails():
        raise _Unavailable("building the AVX2 kernels failed: g++ exited 1\nint8_gemm_avx2.cpp:12: error: ...")

    fake_cpu(ZEN3)
    assert build_main("avx2_kernels", fails, _Unavailable, cf.TIERS["avx2"]) == 1
    assert capsys.readouterr().out == "avx2_kernels: not built: building the AVX2 kernels failed: g++ exited 1\n"
    fake_cpu(SAPPHIRE_RAPIDS, cap="reference")
    assert build_main("avx2_kernels", fails, _Unavailable, cf.TIERS["avx2"]) == 0
    assert capsys.readouterr().out.startswith("avx2_kernels: not built: ")
    fake_cpu(frozenset({"asimd", "asimddp"}))
    assert build_main("neon_kernels", lambda: None, _Unavailable, ["asimd"],
                      built_for=lambda: "for -march=armv8.2-a+dotprod") == 0
    assert capsys.readouterr().out == ("neon_kernels: built for -march=armv8.2-a+dotprod (cpu: asimd+asimddp, "
                                       "kernels: reference)\n")
    fake_cpu(ZEN4)
    assert build_main("cpu_kernels", lambda: None, _Unavailable, ["avx512_vnni"]) == 0
    assert capsys.readouterr().out == ("cpu_kernels: built (cpu: avx2+fma+avx512f+avx512_vnni+avx512_bf16, "
                                       "kernels: avx512_bf16)\n")


def test_each_build_s_python_m_prints_one_line_where_the_cpu_cant_run_it():
    """setup.sh's three ``python -m`` runs, capped to ``reference`` (so nothing is compiled): one line each, no
    traceback, exit code 0."""
    capped = " (capped by PREFIXCACHE_KERNELS)" if cf.reported_cpu_features() else ""
    expected = {
        "cpu_kernels": f"cpu_kernels: not built: our CPU kernels need AVX512-VNNI; cpu: baseline{capped}, kernels: "
                       f"reference (float32 runs on torch's own kernels)\n",
        "avx2_kernels": f"avx2_kernels: not built: our AVX2 kernels need AVX2, FMA and F16C; cpu: baseline{capped}, "
                        f"kernels: reference\n",
        "neon_kernels": f"neon_kernels: not built: our NEON kernels need an aarch64 CPU with NEON (asimd); cpu: "
                        f"baseline{capped}, kernels: reference\n",
    }
    env = {**os.environ, cf.ENV_VAR: "reference"}

    def run(module: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", f"prefixcache.kernels.{module}"], env=env, capture_output=True,
                              text=True, timeout=120)

    with ThreadPoolExecutor(len(expected)) as pool:
        done = dict(zip(expected, pool.map(run, expected)))
    for module, line in expected.items():
        assert (done[module].returncode, done[module].stdout) == (0, line), module
        assert "Traceback" not in done[module].stderr, module
