"""oneDNN's int8 product (torch._int_mm, what quantization="int8" runs) against its bf16 one (F.linear on bf16,
the bf16 prompt rows' products) at the four SmolLM2 projection shapes, 128 and 2,176 rows, one thread,
best of 5, in G(FL)OP/s. On the AMD EPYC of 2026-12-02: ~400 vs ~200 (README, "On an AMD EPYC without AMX").

    .venv/bin/python scripts/time_int8_products.py
"""
import time

import torch

torch.set_num_threads(1)
def rate(f, flops, n=5):
    f(); best=1e9
    for _ in range(n):
        t=time.perf_counter(); f(); best=min(best,time.perf_counter()-t)
    return flops/best/1e9
for M in (128, 2176):
    for (K,N) in ((576,960),(576,576),(576,3072),(1536,576)):
        xb=torch.randn(M,K).bfloat16(); wb=torch.randn(N,K).bfloat16()
        xi=torch.randint(-127,127,(M,K),dtype=torch.int8); wi=torch.randint(-127,127,(K,N),dtype=torch.int8)
        fl=2*M*K*N
        rb=rate(lambda: torch.nn.functional.linear(xb,wb), fl)
        ri=rate(lambda: torch._int_mm(xi,wi), fl)
        print(f"M={M} K={K} N={N}: bf16 linear {rb:.0f} GFLOP/s, _int_mm {ri:.0f} GOP/s")
