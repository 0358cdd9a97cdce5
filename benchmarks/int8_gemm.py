"""Times the exact int8 products on SmolLM2-135M's projection shapes (K x N: qkv 576 x 960, o 576 x 576, gate_up
576 x 3072, down 1536 x 576) at M = 1 (a generated token), 75 (a short prompt) and 2,180 rows (a long prompt's
chunk): our AVX2 kernel (``int8_gemm_avx2``, csrc/int8_gemm_avx2.cpp), our AVX-VNNI kernel (``int8_gemm_vnni``,
where the CPU has AVX-VNNI), ``torch._int_mm`` and MKL's float32 ``torch.mm``, as GOP/s (2 M K N operations per
product) and as ratios to float32's. The int8 forms get pre-quantized int8 rows and return int32 sums (the
rescale is not timed); the weights are packed once, outside the timing. Best of --repeats.

    .venv/bin/python benchmarks/int8_gemm.py [--num-threads 2] [--repeats 5] [--report docs/benchmarks.md]

torch's own kernels follow the CPU they run on: to stand for an AVX2 CPU on a bigger one, cap them with
environment variables set before Python starts (torch reads them once, at load):

    ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python ...

(``ONEDNN_MAX_CPU_ISA=AVX2_VNNI`` for an AVX-VNNI CPU). Our kernels are compiled for AVX2 (and AVX-VNNI) already.

``--report PAGE`` puts the table into PAGE's ``kernels-int8-gemm`` section under the machine, date, commit and
command (``prefixcache/bench/report_page.py``), with the caps it ran under.
"""

import argparse
import os
import shlex
import sys
import time

import torch

from prefixcache.kernels.avx2_kernels import (Avx2KernelsUnavailable, int8_gemm_avx2, int8_gemm_vnni,
                                              load_avx2_kernels, pack_weight, pack_weight_vnni)
from prefixcache.kernels.cpu_features import cpu_has

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}  # (K, N)
ROWS = (1, 75, 2180)
SECTION = "kernels-int8-gemm"  # the page section --report fills
CAPS = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY", "PREFIXCACHE_KERNELS")
NOTE = ("note: torch._int_mm and torch.mm run the kernels this CPU allows unless capped by environment variables "
        "set before Python starts: ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 "
        "(ONEDNN_MAX_CPU_ISA=AVX2_VNNI for an AVX-VNNI CPU) stand for an AVX2 CPU")
MIN_SECONDS = 0.2  # each timed repeat runs the product this long at least


def caps() -> str:
    """The caps this process runs under, from its environment."""
    return " ".join(f"{name}={os.environ[name]}" for name in CAPS if os.environ.get(name)) or "none"


def best_seconds(run, repeats: int) -> float:
    """The best time of one call of ``run`` over ``repeats`` repeats (each of enough calls to last MIN_SECONDS)."""
    run()  # warm-up: page faults, thread pool, lazy loads
    start = time.perf_counter()
    run()
    number = max(1, int(MIN_SECONDS / max(time.perf_counter() - start, 1e-7)))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            run()
        best = min(best, (time.perf_counter() - start) / number)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--report", default=None, metavar="PAGE", help=f"also put the table into PAGE's '{SECTION}' "
                                                                        "section (e.g. docs/benchmarks.md)")
    args = parser.parse_args()
    if args.num_threads < 1 or args.repeats < 1:
        parser.error(f"--num-threads and --repeats must be >= 1, got {args.num_threads} and {args.repeats}")
    try:
        kernels = load_avx2_kernels()
    except Avx2KernelsUnavailable as e:
        raise SystemExit(f"our AVX2 kernels can't run here: {e}") from e
    vnni = cpu_has("avx_vnni") and bool(kernels.avx_vnni_ready())  # cpu_has honours PREFIXCACHE_KERNELS
    print(NOTE, file=sys.stderr)
    print(f"caps: {caps()}", file=sys.stderr)
    torch.set_num_threads(args.num_threads)
    gen = torch.Generator().manual_seed(0)
    forms = ["avx2", *(["vnni"] if vnni else []), "int_mm", "fp32"]
    table = []  # (rows, shape, {form: GOP/s})
    for name, (k, n) in SHAPES.items():
        w = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=gen)
        w_float = w.float()
        packed, packed_vnni = pack_weight(w), pack_weight_vnni(w) if vnni else None
        for rows in ROWS:
            x = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=gen)
            x_float = x.float()
            runs = {"avx2": lambda: int8_gemm_avx2(x, packed, n),
                    "vnni": lambda: int8_gemm_vnni(x, packed_vnni, n),
                    "int_mm": lambda: torch._int_mm(x, w),
                    "fp32": lambda: torch.mm(x_float, w_float)}
            gops = {form: 2 * rows * k * n / best_seconds(runs[form], args.repeats) / 1e9 for form in forms}
            table.append((rows, name, gops))
            print(f"{rows:>6} {name:>8} " + "  ".join(f"{form} {gops[form]:7.1f} GOP/s" for form in forms), flush=True)
    text = markdown(sorted(table, key=lambda row: row[0]), forms, args.num_threads, args.repeats)
    print(text)
    if args.report:
        from prefixcache.bench.report_page import report_section, section_name

        command = shlex.join([".venv/bin/python", "benchmarks/int8_gemm.py", *sys.argv[1:]])
        section = section_name(SECTION)  # a run under PREFIXCACHE_KERNELS gets the cap in its name
        report_section(args.report, section, text, command)
        print(f"--report: {section} written into {args.report}", file=sys.stderr)


def markdown(table: list[tuple[int, str, dict[str, float]]], forms: list[str], num_threads: int, repeats: int) -> str:
    """``table`` (rows, shape, GOP/s per form) as a Markdown table: GOP/s, and each int8 form / float32."""
    heads = {"avx2": "our AVX2", "vnni": "our AVX-VNNI", "int_mm": "torch._int_mm", "fp32": "MKL float32 mm"}
    int8 = [form for form in forms if form != "fp32"]
    lines = [f"int8 x int8 -> int32 products (exact) and MKL's float32 product on SmolLM2-135M's projection shapes "
             f"(K x N), GOP/s (2 M K N operations per product), threads: {num_threads}, best of {repeats}; "
             f"torch's kernels capped by: {caps()}.", "",
             "| M | shape | " + " | ".join(f"{heads[form]} GOP/s" for form in forms) + " | "
             + " | ".join(f"{heads[form]} / float32" for form in int8) + " |",
             "|---|---|" + "---|" * (len(forms) + len(int8))]
    for rows, name, gops in table:
        k, n = SHAPES[name]
        lines.append(f"| {rows:,} | {name} {k}x{n} | " + " | ".join(f"{gops[form]:.1f}" for form in forms) + " | "
                     + " | ".join(f"{gops[form] / gops['fp32']:.2f}" for form in int8) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
