"""Times one layer's prompt attention, our paged kernel (each of its forms this CPU runs: AMX tiles where the
CPU has AMX-BF16, AVX512-BF16 dot products, AVX2 float32 FMAs, and the AVX2 form's int8 products that
``attention_dtype="int8"`` runs) vs torch's padded flash path, on SmolLM2's head shape, for the bench's shapes: a cold 2,178-token prefill, ten 150-token suffixes over 2,032
cached keys (the 10 x 32 run's second step), one such suffix (warm TTFT), and a 2,048-token chunk after
6,000 cached keys (an 8,000-token prefill's last chunk). Both paths include the K/V write; best of --repeats.
``--dtype float32`` times a float32 pool (float32 + int8's), ``--window 512`` a sliding-window layer's (Gemma 3's
window): only the AVX2 form takes those.

    .venv/bin/python benchmarks/prefill_attention.py [--num-threads 2] [--repeats 3] [--dtype bfloat16]
        [--window 0] [--report docs/benchmarks.md]

``--report PAGE`` puts the table into PAGE's ``kernels-prefill-attention`` section (``-float32``, ``-window-N``
appended for those runs) under the machine, date, commit and command (``prefixcache/bench/report_page.py``).
"""

import argparse
import shlex
import sys
import time

import torch

from prefixcache.kernels import prefill_attention
from prefixcache.layers.attention.metadata import build_attention_metadata, build_sliding_attention_metadata
from prefixcache.layers.attention.torch_attention import Attention

SECTION = "kernels-prefill-attention"  # the page section --report fills
FORM_NAMES = {"amx": "AMX form", "avx512": "AVX-512 form", "avx2": "AVX2 form",
              prefill_attention.INT8_FORM: "AVX2 form, int8 products"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--report", default=None, metavar="PAGE", help=f"also put the table into PAGE's '{SECTION}' "
                                                                        "section (e.g. docs/benchmarks.md)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the pool's dtype")
    parser.add_argument("--window", type=int, default=0, help="a sliding window's size (0: causal attention only)")
    args = parser.parse_args()
    if args.window < 0:
        parser.error("--window must be >= 0")
    torch.set_num_threads(args.num_threads)
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 600
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    attn = Attention(heads, kv_heads, head_dim, head_dim**-0.5)
    blocks = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, as a busy pool's are
    shapes = {"cold 2178": [(0, 2178)], "10 x 150 over 2032": [(2032, 150)] * 10, "1 x 150 over 2032": [(2032, 150)],
              "2048 over 6000": [(6000, 2048)]}  # the last chunk of an 8,000-token prefill
    forms = [form for form in (*prefill_attention.FORMS, prefill_attention.INT8_FORM)
             if prefill_attention.form_supported(form)
             and (form in ("avx2", prefill_attention.INT8_FORM) or (dtype == torch.bfloat16 and not args.window))]
    print(f"{'shape':<22}{'torch padded (ms)':>18}" + "".join(f"{'ours ' + form + ' (ms)':>18}{'ratio':>7}" for form in forms))
    rows = []
    for name, seqs in shapes.items():
        batch = [(c, n, blocks) for c, n in seqs]
        num_tokens = sum(n for _, n in seqs)
        q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
        k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
        times = []
        for form in [None, *forms]:  # None: torch's path
            attn.kernel_form = form  # the form the layer runs
            options = dict(batch_invariant=True, dtype=dtype, num_pool_blocks=num_blocks, paged_kernel=form is not None)
            if args.window:
                md, _ = build_sliding_attention_metadata(batch, block_size, "cpu", args.window, **options)
            else:
                md, _ = build_attention_metadata(batch, block_size, "cpu", **options)
            attn(q, k, v, kv_cache, md)
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                attn(q, k, v, kv_cache, md)
                best = min(best, time.perf_counter() - start)
            times.append(best * 1e3)
        print(f"{name:<22}{times[0]:>18.1f}" + "".join(f"{t:>18.1f}{times[0] / t:>7.2f}" for t in times[1:]))
        rows.append((name, times))
    if args.report:
        from prefixcache.bench.report_page import report_section, section_name

        command = shlex.join([".venv/bin/python", "benchmarks/prefill_attention.py", *sys.argv[1:]])
        variant = "-".join((["float32"] if dtype == torch.float32 else [])
                           + ([f"window-{args.window}"] if args.window else []))
        section = section_name(SECTION, variant=variant)  # a run under PREFIXCACHE_KERNELS gets the cap in its name
        report_section(args.report, section, markdown(rows, forms, args.num_threads, args.repeats, args.dtype,
                                                      args.window), command)
        print(f"--report: {section} written into {args.report}", file=sys.stderr)


def markdown(rows: list[tuple[str, list[float]]], forms: list[str], num_threads: int, repeats: int,
             dtype: str = "bfloat16", window: int = 0) -> str:
    """The timings (``rows``: shape, then ms per path: torch, then each of ``forms``) as a Markdown table."""
    kv = {"bfloat16": "bf16", "float32": "float32"}[dtype]
    masked = f", a sliding window of {window} keys" if window else ""
    lines = [f"One layer's prompt attention on SmolLM2's head shape (9 query / 3 KV heads, head_dim 64, {kv} K/V in "
             f"16-token blocks scattered over the pool{masked}), K/V write included, {num_threads} threads, best of "
             f"{repeats}, in ms.", "",
             "| shape (new tokens over cached keys) | torch's padded flash path | "
             + " | ".join(f"our kernel, {FORM_NAMES[form]} | torch / ours" for form in forms) + " |",
             "|---|---|" + "---|---|" * len(forms)]
    for name, times in rows:
        cells = [f"{times[0]:.1f}"] + [f"{t:.1f} | {times[0] / t:.2f}" for t in times[1:]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    missing = [FORM_NAMES[form] for form in prefill_attention.FORMS if form not in forms]
    if dtype != "bfloat16" or window:
        lines += ["", "Only the AVX2 form takes a float32 pool or a window (a model runs it where torch's path is not "
                  "batch-invariant, or with attention_dtype int8: models/llama.py)."]
    elif missing:
        lines += ["", f"Not run on this CPU: {', '.join(missing)} (or PREFIXCACHE_AMX=0 / PREFIXCACHE_KERNELS capped it)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
