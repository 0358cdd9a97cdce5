"""What a weight format costs in quality: perplexity on a fixed text and greedy agreement with fp32.

Per format (``float32``, ``bfloat16``, ``int8``, ``int4``, ``int4-int8``, and bfloat16, int8 and int4-int8 with
``attention_dtype="int8"``), on the same model:

- perplexity: ``exp(mean NLL)`` of the bench's RAG document (``bench/texts.py``, ~2,000 tokens),
  teacher-forced in one prefill through our own model over the paged pool (``int4``: every row as a
  generated token runs, through the C++ decoder's 4-bit layers and the 8-bit lm_head, not bf16 as
  prompt tokens run; ``int4-int8``: every row as a prompt token runs, W8A8 on bf16, and
  ``generated_rows_perplexity`` as int4 reports it);
- greedy agreement with float32 on the seed chat prompts (``sample_texts``): how many prompts give
  the identical ``max_tokens`` tokens, and the mean fraction of tokens before the first difference.
"""

from __future__ import annotations

import math

import torch

from prefixcache.bench.texts import RAG_DOCUMENT
from prefixcache.layers.attention.metadata import build_attention_metadata
from prefixcache.layers.quant import RowSplit, row_split
from prefixcache.llm import LLM
from prefixcache.models.loader import LoadedModel, load_model
from prefixcache.runner.kv_pool import allocate_kv_caches
from prefixcache.sample_texts import QUESTIONS, SYSTEM_PROMPT
from prefixcache.sampling_params import SamplingParams

FORMATS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"), "int8": ("float32", "int8"),
           "int4": ("bfloat16", "int4"), "int4-int8": ("bfloat16", "int4-int8")}
# the same weights with the prompt attention's products in int8 (attention_dtype "int8"): name -> (format, attention)
INT8_ATTENTION_FORMATS = {"bfloat16+int8-attention": ("bfloat16", "int8"), "int8+int8-attention": ("int8", "int8"),
                          "int4-int8+int8-attention": ("int4-int8", "int8")}


def format_options(name: str) -> tuple[str, str, str]:
    """(dtype, quantization, attention_dtype) of a format name of :data:`FORMATS` or :data:`INT8_ATTENTION_FORMATS`.

    Raises:
        KeyError: an unknown name.
    """
    if name in INT8_ATTENTION_FORMATS:
        weights, attention_dtype = INT8_ATTENTION_FORMATS[name]
        return (*FORMATS[weights], attention_dtype)
    return (*FORMATS[name], "float")


@torch.inference_mode()
def perplexity(loaded: LoadedModel, token_ids: list[int], block_size: int = 16,
               generated_rows: bool | None = None) -> float:
    """``exp`` of the mean negative log-likelihood of ``token_ids[1:]``, one prefill of the whole text,
    every row run as a generated token (``generated_rows``; default: for ``int4``) or as a prompt token."""
    cfg = loaded.config
    num_blocks = -(-len(token_ids) // block_size) + 32  # room for the keys padded to a multiple of 512
    kv = allocate_kv_caches(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads,
                            cfg.head_dim, loaded.dtype, "cpu")
    int4 = loaded.quantization == "int4" if generated_rows is None else generated_rows
    # int4: a prompt length of 0 makes every row a generated one (the C++ decoder, 4-bit layers, all rows
    # in one call: each row attends to its own context only) and its logits the 8-bit lm_head's
    md, positions = build_attention_metadata([(0, len(token_ids), list(range(num_blocks)))], block_size, "cpu",
                                              batch_invariant=loaded.model.batch_invariant, dtype=loaded.dtype,
                                              num_prompt_tokens=[0] if int4 else None,
                                              paged_kernel=loaded.model.paged_attention)
    ids = torch.tensor(token_ids, dtype=torch.int64)
    rows = torch.arange(len(token_ids))
    hidden = loaded.model(ids, positions, md, kv)  # [n, hidden]
    with row_split(RowSplit(int4_rows=rows, dense_rows=rows[:0]) if int4 else None):
        logits = loaded.model.compute_logits(hidden)  # [n, vocab] float32
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), ids[1:], reduction="mean")
    return math.exp(float(nll))


def greedy_agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Prompts with identical tokens, and the mean fraction of tokens before the first difference."""
    prefix = []
    for out, ref in zip(outputs, reference, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        prefix.append(n / max(len(ref), 1))
    return {"identical_prompts": sum(o == r for o, r in zip(outputs, reference)), "num_prompts": len(reference),
            "mean_matching_prefix": sum(prefix) / len(prefix)}


def weight_format_quality(model: str = "smollm2-135m", formats: tuple[str, ...] = (*FORMATS, *INT8_ATTENTION_FORMATS),
                          max_tokens: int = 32, num_threads: int | None = None, log=print) -> dict:
    """Perplexity and greedy agreement with float32 per format (see the module docstring).

    Raises:
        ValueError: an unknown format name.
    """
    known = {*FORMATS, *INT8_ATTENTION_FORMATS}
    unknown = [f for f in formats if f not in known]
    if unknown:
        raise ValueError(f"formats must be among {sorted(known)}, got {unknown}")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    results, reference = {}, None
    for name in ("float32", *[f for f in formats if f != "float32"]):
        dtype, quantization, attention_dtype = format_options(name)
        loaded = load_model(model, dtype=getattr(torch, dtype), quantization=quantization, attention_dtype=attention_dtype)
        llm = LLM(model, loaded=loaded, dtype=dtype, quantization=quantization, attention_dtype=attention_dtype,
                  num_threads=num_threads)
        text_ids = loaded.tokenizer(RAG_DOCUMENT).input_ids
        prompts = [llm.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                            {"role": "user", "content": q}]) for q in QUESTIONS]
        outputs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        reference = reference or outputs
        results[name] = {"perplexity": perplexity(loaded, text_ids), "num_text_tokens": len(text_ids),
                         **greedy_agreement(outputs, reference)}
        if quantization == "int4-int8":
            results[name]["generated_rows_perplexity"] = perplexity(loaded, text_ids, generated_rows=True)
        log(f"quality {name}: {results[name]}")
    return {name: results[name] for name in formats}
