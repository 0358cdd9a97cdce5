"""Which formats run on which CPU, read from its features: an AVX2-only CPU (AMD Zen 3), AVX-512 without VNNI
(Skylake-SP), AVX-512 with VNNI and BF16 (AMD Zen 4), AMX (Intel Sapphire Rapids); and PREFIXCACHE_KERNELS' cap."""

from __future__ import annotations

import pytest

from prefixcache.config import EngineConfig
from prefixcache.errors import InvalidInputError
from prefixcache.kernels import cpu_features as cf

ZEN3 = frozenset({"avx2", "fma", "f16c"})
SKYLAKE_SP = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
ZEN4 = SKYLAKE_SP | {"avx512_vnni", "avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"avx_vnni", "amx_tile", "amx_bf16", "amx_int8"}
FORMATS = [("float32", "none"), ("bfloat16", "none"), ("float32", "int8"), ("bfloat16", "int8"),
           ("bfloat16", "int4"), ("bfloat16", "int4-int8")]


@pytest.fixture
def fake_cpu(monkeypatch):
    """Makes this process read ``flags`` as the CPU's features (and ``cap`` as PREFIXCACHE_KERNELS)."""
    def use(flags: frozenset[str], cap: str | None = None) -> None:
        monkeypatch.setattr(cf, "reported_cpu_features", lambda: frozenset(flags))
        if cap is None:
            monkeypatch.delenv(cf.ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(cf.ENV_VAR, cap)
        cf.cpu_features.cache_clear()

    yield use
    cf.cpu_features.cache_clear()


@pytest.mark.parametrize("flags,runs", [
    (frozenset(), [("float32", "none")]),
    (ZEN3, [("float32", "none"), ("bfloat16", "int4"), ("bfloat16", "int4-int8")]),  # the int4 decoder's AVX2 build
    (SKYLAKE_SP, [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int4"), ("bfloat16", "int4-int8")]),
    (ZEN4, FORMATS),
    (SAPPHIRE_RAPIDS, FORMATS),
])
def test_each_cpu_runs_exactly_the_formats_its_features_allow(fake_cpu, flags, runs):
    fake_cpu(flags)
    assert [f for f in FORMATS if cf.format_unavailable_reason(*f) is None] == runs


def test_the_tiers_and_the_start_up_line(fake_cpu):
    for flags, tier in ((frozenset(), "reference"), (ZEN3, "avx2"), (SKYLAKE_SP, "avx2"), (ZEN4, "avx512_bf16"),
                        (SAPPHIRE_RAPIDS, "amx")):
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


@pytest.mark.parametrize("dtype,quantization,field,start", [
    ("bfloat16", "none", "dtype", "dtype='bfloat16' needs a CPU with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT"),
    ("float32", "int8", "quantization", "quantization='int8' needs fast int8 products (AVX512-VNNI or AMX-INT8"),
    ("bfloat16", "int4", "quantization", "quantization='int4' runs our int4 kernels, which need a CPU with "
                                         "AVX2, FMA and F16C; this one has no AVX2: use dtype='float32'"),
])
def test_a_format_the_cpu_cannot_run_is_refused_by_the_config_naming_the_field(fake_cpu, dtype, quantization, field,
                                                                               start):
    fake_cpu(frozenset() if quantization == "int4" else ZEN3)
    with pytest.raises(InvalidInputError) as e:
        EngineConfig.from_kwargs(dtype=dtype, quantization=quantization, device="cpu")
    assert e.value.field == field and str(e.value).startswith(start)
    assert "use dtype='float32', quantization='none', which run on every CPU (or auto: this CPU's fastest)" in str(e.value)
    assert EngineConfig.from_kwargs(dtype=dtype, quantization=quantization, device="cuda").dtype == dtype  # not a CPU's


def test_this_cpus_features_are_read_from_cpuinfo():
    """The real reading (no fake): every tier's features are ones /proc/cpuinfo names, and a CPU that reports
    avx512_vnni reports the AVX-512 base it needs."""
    features = cf.reported_cpu_features()
    assert features <= cf._KNOWN
    if "avx512_vnni" in features:
        assert {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= features
