"""Times a bf16 SmolLM2's 30 layers of linear products (q|k|v, o, gate|up, down; weights prepacked) for a
step of M rows: oneDNN's prepacked product in row tiles of <= 128 rows (layers/linear.py's row_tiles, how
a batch-invariant model calls it) vs our AMX kernel in one call (kernels/amx_gemm.py). Best of --repeats.

    .venv/bin/python benchmarks/amx_linear.py [--num-threads 2] [--repeats 3] [--report docs/benchmarks.md]

``--report PAGE`` puts the table into PAGE's ``kernels-amx-linear`` section under the machine, date, commit and
command (``prefixcache/bench/report_page.py``).
"""

import argparse
import shlex
import sys
import time

import torch
from torch import nn

from prefixcache.kernels.amx_gemm import amx_gemm_supported, amx_linear, pack_weight
from prefixcache.layers.linear import PrepackedWeight, row_tiled_linear

SHAPES = {"q|k|v": (576, 960), "o": (576, 576), "gate|up": (576, 3072), "down": (1536, 576)}  # (in, out)
LAYERS = 30
ROWS = (1, 10, 150, 2048)  # a decode step, a small batch, a warm suffix, a long prefill's chunk
SECTION = "kernels-amx-linear"  # the page section --report fills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--report", default=None, metavar="PAGE", help=f"also put the table into PAGE's '{SECTION}' "
                                                                        "section (e.g. docs/benchmarks.md)")
    args = parser.parse_args()
    if not amx_gemm_supported():
        raise SystemExit("this CPU has no AMX-BF16 tiles (or PREFIXCACHE_AMX=0): nothing to compare")
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(0)
    mods = {name: [nn.Linear(k, n, bias=False).bfloat16() for _ in range(LAYERS)] for name, (k, n) in SHAPES.items()}
    # oneDNN's reorder and product, as where the CPU has no AMX kernel
    onednn = {name: [PrepackedWeight([m], allow_amx=False) for m in ms] for name, ms in mods.items()}
    for packs in onednn.values():
        for p in packs:
            p.pack()
            assert not p.amx
    amx = {name: [pack_weight(m.weight.data) for m in ms] for name, ms in mods.items()}
    print(f"{'rows':>6}{'oneDNN row tiles (ms)':>24}{'AMX kernel (ms)':>18}{'ratio':>8}")
    table = []
    for rows in ROWS:
        xs = {name: torch.randn(rows, k).bfloat16() for name, (k, _) in SHAPES.items()}
        forms = {"onednn": lambda name, i: row_tiled_linear(xs[name], None, packed=onednn[name][i]),
                 "amx": lambda name, i: amx_linear(xs[name], amx[name][i], None, SHAPES[name][1])}
        best = {}
        for form, run in forms.items():
            best[form] = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                for i in range(LAYERS):
                    for name in SHAPES:
                        run(name, i)
                best[form] = min(best[form], time.perf_counter() - start)
        print(f"{rows:>6}{best['onednn'] * 1e3:>24.1f}{best['amx'] * 1e3:>18.1f}{best['onednn'] / best['amx']:>8.2f}")
        table.append((rows, best["onednn"] * 1e3, best["amx"] * 1e3))
    if args.report:
        from prefixcache.bench.report_page import report_section

        command = shlex.join([".venv/bin/python", "benchmarks/amx_linear.py", *sys.argv[1:]])
        report_section(args.report, SECTION, markdown(table, args.num_threads, args.repeats), command)
        print(f"--report: {SECTION} written into {args.report}", file=sys.stderr)


def markdown(table: list[tuple[int, float, float]], num_threads: int, repeats: int) -> str:
    """``table`` (rows, oneDNN ms, AMX ms) as a Markdown table."""
    lines = [f"The four linear products of SmolLM2's {LAYERS} layers (q|k|v, o, gate|up, down), bf16, weights "
             f"prepacked, {num_threads} threads, best of {repeats}, in ms.", "",
             "| rows | oneDNN, row tiles of <= 128 | our AMX GEMM, one call | oneDNN / ours |", "|---|---|---|---|"]
    lines += [f"| {rows:,} | {onednn:.1f} | {amx:.1f} | {onednn / amx:.2f} |" for rows, onednn, amx in table]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
