"""Python imports this at every start-up of a process whose ``PYTHONPATH`` names this folder:
:func:`prefixcache.bench.vllm_baseline.vllm_env` does so for vLLM's processes under a ``PREFIXCACHE_KERNELS``
cap below ``avx512``. vLLM picks its kernel build (``vllm._C_AVX2``, ``_C_AVX512`` or ``_C``) and its attention
and linear forms from torch's cpuid checks, which no environment variable caps, and its CPU worker is a spawned
process, so the checks are answered as an AVX2 CPU's would be here, in every process, before vLLM asks.
Never imported by prefixcache itself.
"""

import torch

for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported", "_is_amx_tile_supported",
              "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)
