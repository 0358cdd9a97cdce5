"""The arithmetic floor of issue 12's two prompt-bound speed goals on this CPU.

Counts the multiplies of the speed bench's warm TTFT (one prompt's suffix over the cached system
prompt) and of its 10 x 32 row's two prefill steps (the first 2,048 tokens of one prompt, then the
ten prompts' own tokens over the cached prefix: ``scripts/trace_batch_steps.py`` shows those
steps), exactly, from the model's shapes and the bench's own prompts; then measures the best rate
this CPU gives the int8 and the bf16 product (oneDNN's ``torch._int_mm`` and bf16 ``F.linear`` at
the model's four projection shapes, the script's threads, best of 5) and prints how long the
multiplies alone would take if *every* product, attention's too, ran at that rate, and with the
attention at the bf16 rate (what --quantization int4-int8 runs on a CPU without AMX). Nothing else
(norms, RoPE, quantization passes, softmax, sampling, scheduling) is counted, so the real time can
only be longer.

    .venv/bin/python scripts/speed_floor.py [--num-threads 2] [--decode-s 1.0]

``--decode-s``: the 10 x 32 row's 31 decode steps as measured (``scripts/trace_batch_steps.py
--dtype bfloat16 --quantization int4-int8``: 31 x 32.2 ms on the AMD EPYC of 2026-12-03), added to
the row's floor; the row's goal is 120 output tok/s, i.e. 320 tokens in 2.67 s.
"""

import argparse
import time

import torch

from prefixcache.bench.accounting import common_prefix_len
from prefixcache.config import DEFAULT_MODEL
from prefixcache.bench.workloads import build_speed_prompts
from prefixcache.models.loader import load_model

p = argparse.ArgumentParser()
p.add_argument("--num-threads", type=int, default=2)
p.add_argument("--decode-s", type=float, default=31 * 0.0322)
p.add_argument("--step-tokens", type=int, default=2048, help="the engine's token budget per step")
args = p.parse_args()
torch.set_num_threads(args.num_threads)

loaded = load_model(DEFAULT_MODEL)
c = loaded.config
prompts = build_speed_prompts(loaded.tokenizer, 10)
shared = prompts.shared
prefix = common_prefix_len(shared) // 16 * 16  # the cached full blocks (block size 16) a later prompt reuses

hd, L = c.head_dim, c.num_hidden_layers
shapes = [  # (in, out) of each layer's products: q|k|v, o, gate|up, down
    (c.hidden_size, (c.num_attention_heads + 2 * c.num_key_value_heads) * hd),
    (c.num_attention_heads * hd, c.hidden_size),
    (c.hidden_size, 2 * c.intermediate_size),
    (c.intermediate_size, c.hidden_size),
]
macs_per_row = L * sum(k * n for k, n in shapes)


def attention_macs(first: int, n: int) -> int:
    """Multiply-adds of the causal attention of positions first .. first + n - 1 (q.k and p.v)."""
    keys = n * first + n * (n + 1) // 2  # sum over rows of (position + 1)
    return L * c.num_attention_heads * hd * 2 * keys


def step_ops(first: int, n: int, last_rows: int) -> tuple[float, float]:
    """(products, attention) operations (2 per multiply-add) of prefilling n tokens after first."""
    return 2 * (n * macs_per_row + last_rows * c.hidden_size * c.vocab_size), 2 * attention_macs(first, n)


def best_rate(fn, ops: float, n: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return ops / best


rates = {"int8": 0.0, "bf16": 0.0}
for m in (150, 2048):
    for k, n in shapes:
        xi = torch.randint(-127, 127, (m, k), dtype=torch.int8)
        wi = torch.randint(-127, 127, (k, n), dtype=torch.int8)
        xb, wb = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
        rates["int8"] = max(rates["int8"], best_rate(lambda: torch._int_mm(xi, wi), 2 * m * k * n))
        rates["bf16"] = max(rates["bf16"], best_rate(lambda: torch.nn.functional.linear(xb, wb), 2 * m * k * n))
print(f"best product rate, {args.num_threads} threads: int8 {rates['int8'] / 1e9:.0f} GOP/s, "
      f"bf16 {rates['bf16'] / 1e9:.0f} GFLOP/s")

suffixes = sorted(len(s) - prefix for s in shared[1:])
median_suffix = suffixes[len(suffixes) // 2]
warm = step_ops(prefix, median_suffix, 1)
print(f"warm TTFT: {median_suffix}-token suffix (the median of the bench's 9) over {prefix} cached tokens: "
      f"products {warm[0] / 1e9:.1f} GOP, attention {warm[1] / 1e9:.1f} GOP")
first = min(args.step_tokens, len(shared[0]))  # step 1: the first prompt's first tokens, the others wait
row = [step_ops(0, first, 0), step_ops(first, len(shared[0]) - first, 1)]  # step 2: its rest ...
row += [step_ops(prefix, n, 1) for n in suffixes]  # ... and the nine others' suffixes
row_ops = (sum(r[0] for r in row), sum(r[1] for r in row))
print(f"10 x 32 row's prefills: {first} tokens cold, then {len(shared[0]) - first + sum(suffixes)} "
      f"in the second step: products {row_ops[0] / 1e9:.0f} GOP, attention {row_ops[1] / 1e9:.0f} GOP")
for name in ("int8", "bf16"):
    r = rates[name]
    w = (warm[0] + warm[1]) / r
    t = (row_ops[0] + row_ops[1]) / r + args.decode_s
    print(f"every product at the best {name} rate: warm TTFT >= {w * 1e3:.1f} ms (goal 80); "
          f"10 x 32 row >= {t:.2f} s with {args.decode_s:.2f} s of decode, <= {320 / t:.0f} tok/s (goal 120)")
w = warm[0] / rates["int8"] + warm[1] / rates["bf16"]
t = row_ops[0] / rates["int8"] + row_ops[1] / rates["bf16"] + args.decode_s
print(f"products at the int8 rate, attention at the bf16 rate (int4-int8 today): warm TTFT >= {w * 1e3:.1f} ms; "
      f"10 x 32 row >= {t:.2f} s, <= {320 / t:.0f} tok/s")
