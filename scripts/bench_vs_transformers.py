"""Prefill and decode throughput of prefixcache vs HF transformers, same weights, same threads.

    .venv/bin/python scripts/bench_vs_transformers.py [--threads 2] [--out bench_results/vs_hf.json]

Measures (median of --repeats runs):
- prefill tokens/s: one 512-token prompt, 1 new token (ours: caching off so it really computes;
  transformers: forward with logits_to_keep=1);
- decode tokens/s at batch 1 and batch 16: 64 new tokens after a ~40-token prompt; decode time
  is wall time minus the time to the last first token (ours) / minus a prefill-only generate
  (transformers).
This is a benchmark, not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from prefixcache import LLM, SamplingParams
from prefixcache.models.loader import load_model

BASE = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how "
    "books were made, how ideas travelled across Europe, and who could afford to read. "
)


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(BASE * (length // 20 + 2), add_special_tokens=False)
    # Distinct first tokens so nothing is shared between the batch's prompts.
    return [[100 + i] + ids[: length - 1] for i in range(n)]


def bench_ours(llm: LLM, prefill_prompt, decode_prompts, new_tokens: int, repeats: int) -> dict:
    res = {}
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        llm.generate(prefill_prompt, one, use_tqdm=False)
        times.append(time.perf_counter() - t)
    res["prefill_tok_s"] = len(prefill_prompt) / statistics.median(times)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for batch in (1, 16):
        rates = []
        for _ in range(repeats):
            t = time.perf_counter()
            outs = llm.generate(decode_prompts[:batch], params, use_tqdm=False)
            wall = time.perf_counter() - t
            decode_s = wall - max(o.ttft_s for o in outs)
            rates.append(batch * (new_tokens - 1) / decode_s)
        res[f"decode_tok_s_batch{batch}"] = statistics.median(rates)
    return res


def bench_hf(hf, prefill_prompt, decode_prompts, new_tokens: int, repeats: int, pad_id: int) -> dict:
    res = {}
    x = torch.tensor([prefill_prompt])
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            hf(x, logits_to_keep=1)
            times.append(time.perf_counter() - t)
    res["prefill_tok_s"] = len(prefill_prompt) / statistics.median(times)
    for batch in (1, 16):
        ids = torch.tensor(decode_prompts[:batch])  # equal lengths: no padding needed
        mask = torch.ones_like(ids)
        kw = dict(attention_mask=mask, do_sample=False, pad_token_id=pad_id)
        rates = []
        with torch.inference_mode():
            for _ in range(repeats):
                t = time.perf_counter()
                hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
                first = time.perf_counter() - t
                t = time.perf_counter()
                hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
                wall = time.perf_counter() - t
                rates.append(batch * (new_tokens - 1) / (wall - first))
        res[f"decode_tok_s_batch{batch}"] = statistics.median(rates)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench_results/vs_transformers.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    prefill_prompt = prompts(loaded.tokenizer, 1, 512)[0]
    decode_prompts = prompts(loaded.tokenizer, 16, 40)

    llm = LLM(args.model, loaded=loaded, enable_prefix_caching=False, num_threads=args.threads)
    llm.generate(decode_prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    ours = bench_ours(llm, prefill_prompt, decode_prompts, args.new_tokens, args.repeats)
    del llm

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(loaded.model_dir, dtype=torch.float32).eval()
    theirs = bench_hf(hf, prefill_prompt, decode_prompts, args.new_tokens, args.repeats,
                      loaded.eos_token_ids[0])

    report = {
        "machine": {"threads": args.threads, "torch": torch.__version__},
        "prefixcache": ours,
        "transformers": theirs,
        "ratio": {k: ours[k] / theirs[k] for k in ours},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"{'measure':<24}{'prefixcache':>14}{'transformers':>14}{'ratio':>8}")
    for k in ours:
        print(f"{k:<24}{ours[k]:>14.1f}{theirs[k]:>14.1f}{report['ratio'][k]:>8.2f}")


if __name__ == "__main__":
    main()
