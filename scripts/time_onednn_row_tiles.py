"""oneDNN's prepacked bf16 product (the non-AMX prompt path, layers/lora.py PrepackedWeight) on SmolLM2's four
prompt shapes, 1,280 rows, called in row tiles of 64 .. 1,280: medians of 15 passes and GFLOP/s. The engine calls
it in tiles of at most 128 rows (PREPACKED_ROW_TILE), where a row's bits don't depend on the call.

    .venv/bin/python scripts/time_onednn_row_tiles.py
"""

import time

import torch

torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
M = 1280
total: dict[int, float] = {}
for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
    packed = torch.ops.mkldnn._reorder_linear_weight((torch.randn(n, k, generator=g) * 0.05).bfloat16(), 1)
    x = torch.randn(M, k, generator=g).bfloat16()
    for tile in (64, 128, 256, 512, 1280):
        def run() -> None:
            for s in range(0, M, tile):
                torch.ops.mkldnn._linear_pointwise(x[s : s + tile], packed, None, "none", [], "")
        run()
        times = []
        for _ in range(15):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        median = sorted(times)[7]
        total[tile] = total.get(tile, 0.0) + median
        print(f"{n} x {k}, tiles of {tile}: {median * 1e3:.2f} ms, {2 * M * n * k / median / 1e9:.0f} GFLOP/s")
print("all four shapes, ms by tile:", {t: round(v * 1e3, 1) for t, v in total.items()})
