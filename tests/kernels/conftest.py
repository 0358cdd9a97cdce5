"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest

from prefixcache.kernels import cpu_features as cf


@pytest.fixture
def fake_cpu(monkeypatch):
    """Makes this process read ``flags`` as the CPU's features (and ``cap`` as PREFIXCACHE_KERNELS): call it as
    ``fake_cpu(flags, cap=None)``, any number of times in a test. :func:`cf.cpu_features` is cached, so its cache
    is cleared at each call and after the test (the real CPU's features come back for the next one)."""
    def use(flags: frozenset[str], cap: str | None = None) -> None:
        monkeypatch.setattr(cf, "reported_cpu_features", lambda: frozenset(flags))
        if cap is None:
            monkeypatch.delenv(cf.ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(cf.ENV_VAR, cap)
        cf.cpu_features.cache_clear()

    yield use
    cf.cpu_features.cache_clear()
