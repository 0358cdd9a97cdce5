"""int8's perplexity cost on texts unlike its calibration text (the demo's English system prompt and
questions), with SmoothQuant's smoothing as shipped (channel maxima raised to their median), without
that floor, and without smoothing; each against float32 on the same 1,200 tokens.

    .venv/bin/python scripts/probe_int8_smoothing.py [--num-threads 2]

Texts: code (prefixcache/engine/scheduler.py), the bench's English RAG document, and French and Russian
from GnuPG's help files where the system has them (/usr/share/gnupg/help.{fr,ru}.txt).
"""

import argparse
from pathlib import Path

import torch

import prefixcache.models.llama as llama
from prefixcache.bench.quality import perplexity
from prefixcache.bench.texts import RAG_DOCUMENT
from prefixcache.layers.quant import SMOOTH_ALPHA
from prefixcache.models.loader import load_model

p = argparse.ArgumentParser()
p.add_argument("--num-threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.num_threads)
texts = {"code": (Path(llama.__file__).parents[1] / "engine" / "scheduler.py").read_text()[:6000],
         "english (RAG)": RAG_DOCUMENT[:6000]}
for lang in ("fr", "ru"):
    path = Path(f"/usr/share/gnupg/help.{lang}.txt")
    if path.exists():
        texts[lang] = path.read_text()[1000:7000]
fp32 = load_model("smollm2-135m")
ids = {name: fp32.tokenizer(text).input_ids[:1200] for name, text in texts.items()}
ref = {name: perplexity(fp32, v) for name, v in ids.items()}
int8 = load_model("smollm2-135m", quantization="int8")
shipped = llama.smooth_factors


def no_floor(act_amax, weight, alpha=SMOOTH_ALPHA):
    w = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
    return (act_amax.float().clamp(min=1e-5).pow(alpha) / w.pow(1 - alpha)).clamp(min=1e-5)


for variant in ("smoothed (median floor)", "smoothed, no floor", "unsmoothed"):
    llama.smooth_factors = no_floor if variant == "smoothed, no floor" else shipped
    int8.model.int8_smoothing = variant != "unsmoothed"
    int8.model.quantize("int8")
    costs = {name: f"{100 * (perplexity(int8, v) / ref[name] - 1):+.2f} %" for name, v in ids.items()}
    print(f"{variant}: {costs}", flush=True)
print("float32 perplexities:", {name: round(v, 3) for name, v in ref.items()})
