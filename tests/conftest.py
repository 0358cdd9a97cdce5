"""Shared fixtures: the real default model, loaded once per test session."""

from __future__ import annotations

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption(
        "--regen-golden", action="store_true", default=False,
        help="recompute golden token ids with transformers and rewrite tests/engine/golden/*.json",
    )


@pytest.fixture(scope="session", autouse=True)
def _threads():
    # CI has 2 cores; fixed threads keep fp32 results reproducible run to run.
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm2():
    """The default model (SmolLM2-135M-Instruct, fp32), fetched by `prefixcache fetch` in setup."""
    from prefixcache.models.loader import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def make_llm(smollm2):
    """Builds an LLM on the already loaded default model; engine options as keywords."""
    from prefixcache.llm import LLM

    def make(**options):
        options.setdefault("num_threads", 2)
        return LLM("smollm2-135m", loaded=smollm2, **options)

    return make


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_isa(*names): skipped unless this CPU (as capped by "
                                       "PREFIXCACHE_KERNELS) reports every feature named (/proc/cpuinfo names, or "
                                       "a tier of prefixcache.kernels.cpu_features.TIERS)")
    config.addinivalue_line("markers", "requires_format(dtype, quantization): skipped where this CPU can't run the "
                                       "weight format (prefixcache.kernels.cpu_features.format_unavailable_reason)")


def pytest_collection_modifyitems(config, items):
    """Every test that loads the real default model (the ``smollm2`` fixture, directly or through
    another fixture) is ``slow``: ``pytest -m "not slow"`` is the fast subset (tiny models, the
    cache, the scheduler, layers). A test marked ``requires_isa`` / ``requires_format`` is skipped where
    this CPU can't run what it tests (an AVX2-only CPU, or ``PREFIXCACHE_KERNELS=avx2`` on a bigger one),
    naming what is missing; everything the CPU can run is still tested."""
    from prefixcache.kernels.cpu_features import TIERS, cpu_has, describe_cpu, format_unavailable_reason

    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
        for mark in item.iter_markers("requires_isa"):  # feature names or tier names ("avx512": TIERS)
            if not cpu_has(*(f for name in mark.args for f in TIERS.get(name, (name,)))):
                item.add_marker(pytest.mark.skip(reason=f"needs {'+'.join(mark.args)}; {describe_cpu()}"))
        for mark in item.iter_markers("requires_format"):
            reason = format_unavailable_reason(*mark.args)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason.split(":")[0]))


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on loopback for this test (the bench's
    :class:`~prefixcache.bench.loopback_redis.LoopbackRedis`); ``.url``, ``.client``, ``.stop()``."""
    import shutil

    from prefixcache.bench.loopback_redis import LoopbackRedis

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: scripts/setup.sh installs it (apt-get install redis-server)")
    try:
        server = LoopbackRedis(tmp_path, binary)
    except RuntimeError as e:
        pytest.fail(str(e))
    yield server
    server.stop()
