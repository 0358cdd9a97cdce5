"""Medians of repeated passes of SmolLM2's 30 layers' four bf16 products (q|k|v, o, gate|up, down, 30
separate weights each, so they stream from out of cache as in a step) on our AMX kernel, for a step of M
rows. Standalone (only ``pack_weight`` and ``amx_linear``), so a copy runs in an older checkout for a
before / after pair (2026-12-02: fcd9d25 vs 19898e9).

    .venv/bin/python scripts/time_amx_gemm.py [--rows 10,150,2048] [--passes 15] [--num-threads 2]
"""

import argparse
import statistics
import time

import torch

from prefixcache.layers.amx_gemm import amx_gemm_supported, amx_linear, pack_weight

SHAPES = {"q|k|v": (576, 960), "o": (576, 576), "gate|up": (576, 3072), "down": (1536, 576)}  # (in, out)
LAYERS = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="10,150,2048")
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    if not amx_gemm_supported():
        raise SystemExit("this CPU has no AMX-BF16 tiles (or PREFIXCACHE_AMX=0)")
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(0)
    weights = {n: [pack_weight(torch.randn(o, i).bfloat16()) for _ in range(LAYERS)] for n, (i, o) in SHAPES.items()}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {n: torch.randn(m, i).bfloat16() for n, (i, _) in SHAPES.items()}
        times = []
        for _ in range(args.passes + 1):  # the first pass warms up
            start = time.perf_counter()
            for layer in range(LAYERS):
                for n, (_, o) in SHAPES.items():
                    amx_linear(xs[n], weights[n][layer], None, o)
            times.append(time.perf_counter() - start)
        print(f"{m:>5} rows: median {statistics.median(times[1:]) * 1e3:.2f} ms, min {min(times[1:]) * 1e3:.2f} ms "
              f"per pass of {LAYERS} layers' products")


if __name__ == "__main__":
    main()
