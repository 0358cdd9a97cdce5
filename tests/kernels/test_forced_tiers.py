"""The fallbacks stay honest on every machine: the tiny-model tests of every weight format, run again with
PREFIXCACHE_KERNELS capping the tier to what an AVX2-only CPU and a plain x86-64 have (our AVX-512/AMX kernels
off, oneDNN's prepacked bf16 off, int8 through the AVX2 kernel or torch._int_mm). Each run is its own process:
the tier is read once per process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUBSET = ["tests/models/test_llama_vs_transformers.py", "tests/models/test_quantized.py",
          "tests/layers/test_attention_invariance.py", "tests/engine/test_prefix_caching.py",
          "tests/kernels/test_cpu_features.py"]


@pytest.mark.parametrize("tier", ["reference", "avx2"])
def test_the_tiny_model_tests_pass_with_the_tier_capped(tier):
    env = {**os.environ, "PREFIXCACHE_KERNELS": tier}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *SUBSET],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    summary = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 30 and "failed" not in summary, summary
