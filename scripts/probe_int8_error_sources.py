"""Where int8's perplexity cost comes from, in fake quantization on the float32 model (every linear layer
and the lm_head through a patched ``F.linear``; no int8 kernel): weights per output channel alone (W),
activations per token alone (A), both (WA), activations per group of 32 features (A32), and both with
SmoothQuant's smoothing at a few strengths (calibrated on the demo's system prompt and questions,
without the shipped median floor). Perplexity of the bench's RAG document, 2,699 tokens.

    .venv/bin/python scripts/probe_int8_error_sources.py [--num-threads 2]

Measured 2026-12-03 (float32 21.567): W 21.690, A 22.185, WA 22.285, A32 21.601; smoothed WA at
alpha 0.3 / 0.4 / 0.5 / 0.55 / 0.65 / 0.8: 22.035 / 21.898 / 21.628 / 21.803 / 21.879 / 22.427.
"""

import argparse

import torch
import torch.nn.functional as F

from prefixcache.bench.quality import perplexity
from prefixcache.bench.texts import RAG_DOCUMENT
from prefixcache.models.loader import CALIBRATION_TEXT, load_model

p = argparse.ArgumentParser()
p.add_argument("--num-threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.num_threads)
plain_linear = F.linear
state = {"mode": "", "alpha": 0.0, "amax": {}, "calibrating": False, "cache": {}}


def weight_q(w):
    s = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
    return torch.round(w / s).clamp(-127, 127) * s


def act_q(x, group=None):
    xs = x if group is None else x.reshape(*x.shape[:-1], -1, group)
    s = (xs.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
    return (torch.round(xs / s) * s).reshape(x.shape)


def fake_linear(x, w, b=None):
    if w.dim() != 2 or w.numel() <= 10000 or not state["mode"]:
        return plain_linear(x, w, b)
    key, mode = id(w), state["mode"]
    if state["calibrating"]:
        seen = x.detach().float().abs().reshape(-1, x.shape[-1]).amax(0)
        state["amax"][key] = torch.maximum(state["amax"][key], seen) if key in state["amax"] else seen
        return plain_linear(x, w, b)
    if key not in state["cache"]:
        wf, alpha = w.float(), state["alpha"]
        s = (state["amax"][key].clamp(min=1e-5) ** alpha / wf.abs().amax(0).clamp(min=1e-5) ** (1 - alpha)
             if alpha else torch.ones(w.shape[1]))
        state["cache"][key] = (s, weight_q(wf * s) if "W" in mode else wf * s)
    s, ws = state["cache"][key]
    xs = x.float() / s
    if "A" in mode:
        xs = act_q(xs, 32 if "32" in mode else None)
    return plain_linear(xs, ws, b)


F.linear = fake_linear
loaded = load_model("smollm2-135m")
ids = loaded.tokenizer(RAG_DOCUMENT).input_ids
with torch.inference_mode():
    print("float32", round(perplexity(loaded, ids), 3), flush=True)
    state.update(mode="WA", calibrating=True)
    perplexity(loaded, loaded.tokenizer(CALIBRATION_TEXT).input_ids)
    state["calibrating"] = False
    for mode, alpha in [("W", 0), ("A", 0), ("WA", 0), ("A32", 0)] + [("WA", a) for a in (0.3, 0.4, 0.5, 0.55, 0.65, 0.8)]:
        state.update(mode=mode, alpha=alpha, cache={})
        print(mode, f"alpha {alpha}" if alpha else "", round(perplexity(loaded, ids), 3), flush=True)
