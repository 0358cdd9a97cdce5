"""The no-sharing workload on two engines, caching on and off (bf16 + int4, one loaded model), timed in
alternating back-to-back pairs as the speed table's on / off row is: every pair's wall times and the median of
the pairs' off / on time ratios (= on / off output tok/s). ``--num-requests`` makes longer runs,
``--off-first`` creates the caching-off engine first, ``--profile`` prints each mode's top functions under
cProfile (the caching-on engine's extra Python work).

    .venv/bin/python scripts/probe_on_off_pairs.py [--pairs 10] [--num-requests 24] [--off-first] [--profile]
"""

import argparse
import cProfile
import io
import pstats
import statistics

import torch

from prefixcache.bench import runner
from prefixcache.bench.options import BenchOptions
from prefixcache.llm import LLM
from prefixcache.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--off-first", action="store_true")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    engine = dict(dtype="bfloat16", quantization="int4")
    opts = BenchOptions(engine_options=engine, num_threads=2)
    config = runner.EngineConfig.from_kwargs(**engine)
    loaded = runner.load_model(opts.model, dtype=config.torch_dtype, quantization=config.quantization)
    workload = runner.build_workload("no-sharing", loaded.tokenizer, loaded.eos_token_ids,
                                     args.num_requests or opts.num_requests)
    params = SamplingParams(temperature=0, max_tokens=opts.max_tokens, ignore_eos=True)
    base = dict(block_size=opts.block_size, num_threads=2, **engine)
    num_blocks = runner._num_blocks_for([workload.build_round(0, [])], opts, runner._default_pool_blocks(loaded, opts))
    llms = {}
    for caching in ((False, True) if args.off_first else (True, False)):
        llms["on" if caching else "off"] = LLM(opts.model, loaded=loaded, enable_prefix_caching=caching,
                                               num_blocks=num_blocks, **base)
    for llm in llms.values():
        runner._warm_up(llm)
    rounds = runner.run_rounds(llms["on"], workload, params).rounds
    walls: dict[str, list[float]] = {"on": [], "off": []}
    profiles = {name: cProfile.Profile() for name in llms}
    for i in range(args.pairs):
        for name in (("on", "off") if i % 2 == 0 else ("off", "on")):
            if name == "on":
                llms[name].reset_prefix_cache()
            if args.profile:
                profiles[name].enable()
            walls[name].append(runner.run_rounds(llms[name], workload, params, rounds).wall_s)
            if args.profile:
                profiles[name].disable()
    ratios = [off / on for on, off in zip(walls["on"], walls["off"])]
    for name in ("on", "off"):
        print(name, " ".join(f"{w:.3f}" for w in walls[name]))
    print("off / on per pair:", " ".join(f"{r:.3f}" for r in ratios), f"median {statistics.median(ratios):.4f}")
    if args.profile:
        for name, profile in profiles.items():
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
            print(name, out.getvalue())


if __name__ == "__main__":
    main()
