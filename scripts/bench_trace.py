"""Trace-driven eviction benchmark (simulation: KV cache manager only, no model) → JSON.

    python scripts/bench_trace.py --seeds 0 1 2 3 4 --num-requests 3000

writes bench_results/bench_trace.json (the directory of ``prefixcache bench``'s outputs) unless
``--out`` names another file, or ``-`` for stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from prefixcache.bench.trace import run_trace_benchmark
from prefixcache.cache.eviction import EVICTION_POLICIES

DEFAULT_OUT = "bench_results/bench_trace.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    policies = [*EVICTION_POLICIES, "belady"]  # belady: offline reference (knows the future)
    parser.add_argument("--policies", nargs="+", default=policies, choices=policies)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--num-requests", type=int, default=3000)
    parser.add_argument("--num-blocks", type=int, default=2048, help="KV budget in blocks")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--service-s", type=float, default=2.0, help="seconds a request holds its blocks")
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON file, or - for stdout (default: %(default)s)")
    args = parser.parse_args(argv)
    rows = run_trace_benchmark(args.policies, args.seeds, None, args.num_requests, args.num_blocks,
                               args.block_size, args.service_s)
    for r in rows:
        print(f"{r['trace']:8s} seed {r['seed']} {r['policy']:5s} hit {r['hit_rate']:.3f} "
              f"saved {r['prefill_tokens_saved']:8d} ({r.get('saved_vs_lru', 0.0):+.1%}) "
              f"evictions {r['num_evictions']:6d} {r['requests_per_s']:6.0f} req/s", file=sys.stderr)
    text = json.dumps({"config": vars(args), "results": rows}, indent=2)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
