"""The fallbacks stay honest on every machine: the tiny-model tests of every weight format, run again with
PREFIXCACHE_KERNELS capping the tier to what an AVX2-only CPU, an AVX2 + AVX-VNNI one and a plain x86-64 have (our
AVX-512/AMX kernels off, oneDNN's prepacked bf16 off, int8 through the AVX2 or AVX-VNNI kernel or torch._int_mm,
the int4 decoder in its AVX2 build); and the int4 formats' tokens on a tiny model under each tier: cache on == off and batched == alone in
every tier, the same tokens in the AVX2 and AVX-512 tiers where the rule promises it. Each run is its own
process: the tier is read once per process."""

from __future__ import annotations

import os
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUBSET = ["tests/models/test_llama_vs_transformers.py", "tests/models/test_quantized.py",
          "tests/layers/test_attention_invariance.py", "tests/engine/test_prefix_caching.py",
          "tests/kernels/test_cpu_features.py", "tests/models/test_decode_layers.py", "tests/layers/test_quant_int4.py",
          "tests/kernels/test_int4_builds.py", "tests/kernels/test_int8_gemm_avx2.py",
          "tests/kernels/test_int8_gemm_vnni.py", "tests/models/test_paged_attention_model.py"]


@pytest.mark.parametrize("tier", ["reference", "avx2", pytest.param("avx2+avx_vnni", marks=pytest.mark.requires_isa(
    "avx2", "avx_vnni"))])  # an Alder Lake: int8 on our AVX-VNNI kernel
def test_the_tiny_model_tests_pass_with_the_tier_capped(tier):
    env = {**os.environ, "PREFIXCACHE_KERNELS": tier}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *SUBSET],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    summary = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 30 and "failed" not in summary, summary


# One process per tier: the default model (SmolLM2-135M) in int4 (where the tier runs it) and int4-int8, three prompts over a shared 40-token
# prefix, 12 greedy tokens each, batched with the cache on, then each alone with the cache off. Prints {format: [tokens...]} as JSON.
_GENERATE = r"""
import json, sys, torch
from prefixcache.kernels.cpu_features import format_unavailable_reason
from prefixcache.llm import LLM
from prefixcache.models.loader import load_model
from prefixcache.sampling_params import SamplingParams
g = torch.Generator().manual_seed(0)
prefix = torch.randint(3, 250, (40,), generator=g).tolist()
prompts = [prefix + torch.randint(3, 250, (n,), generator=g).tolist() for n in (3, 9, 17)]
params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
out = {}
for quantization in ("int4", "int4-int8"):
    if format_unavailable_reason("bfloat16", quantization):  # int4 below the avx512 tier: bf16 prompt products
        continue
    loaded = load_model("smollm2-135m", dtype=torch.bfloat16, quantization=quantization)
    options = dict(loaded=loaded, dtype="bfloat16", quantization=quantization, num_threads=2, block_size=16)
    on = LLM("smollm2-135m", **options)
    batched = [o.token_ids for o in on.generate(prompts, params, use_tqdm=False)]
    again = [o.token_ids for o in on.generate(prompts, params, use_tqdm=False)]  # prefix cached now
    off = LLM("smollm2-135m", enable_prefix_caching=False, **options)
    alone = [off.generate(p, params, use_tqdm=False)[0].token_ids for p in prompts]
    out[quantization] = {"batched": batched, "again": again, "alone": alone}
print("RESULT " + json.dumps(out))
"""


def _int4_tokens(tier: str) -> dict:
    env = {**os.environ, "PREFIXCACHE_KERNELS": tier}
    proc = subprocess.run([sys.executable, "-c", _GENERATE], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


@pytest.mark.slow  # loads the default model (in subprocesses: the smollm2 fixture can't mark it)
@pytest.mark.requires_isa("avx2")
def test_int4_formats_give_the_same_tokens_on_the_avx2_build_and_cache_on_equals_off():
    """In the AVX2 tier and the full tier: batched with the cache on (twice: the second run reuses the cached
    prefix) == each alone with the cache off. Where this CPU has AVX512-VNNI, the AVX2 tier also equals the
    ``avx512`` tier (both run the decoder's float32 attention form and the prompt kernel's AVX2 form, the same
    bits, and the fused prompt ops, whose AVX2 and AVX-512 builds have the same bits): int4-int8 token for token.
    int4 runs from the ``avx512`` tier up (below it, its bf16 prompt products have no fast kernel and the config
    refuses it). The full tier (AVX512-BF16, AMX) runs another attention form and prompt kernels, so its tokens may
    differ."""
    from prefixcache.kernels.cpu_features import cpu_has

    tiers = ["avx2", "auto"] + (["avx512"] if cpu_has("avx512_vnni", "avx512bw") else [])
    results = {tier: _int4_tokens(tier) for tier in tiers}
    for tier, by_format in results.items():
        for quantization, runs in by_format.items():
            assert runs["batched"] == runs["again"] == runs["alone"], (tier, quantization)
            assert all(len(t) == 12 for t in runs["alone"])
    assert set(results["avx2"]) == {"int4-int8"} and "int4-int8" in results["auto"]
    if "avx512" in results:
        assert set(results["avx512"]) == {"int4", "int4-int8"}
    if "avx512" in results:
        assert results["avx2"]["int4-int8"] == results["avx512"]["int4-int8"]
