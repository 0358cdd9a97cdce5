"""``prefixcache analyze prompts.jsonl``: what a prefix cache would do with a file of prompts, offline.

Each line is a JSON object: a completion prompt ``{"prompt": "..."}`` (or token ids), a chat request
``{"messages": [...]}`` (rendered with the model's chat template, as the server renders it), or a JSON
string (a prompt). ``"tenant"`` and ``"cache_salt"`` keys, if present, are the request's namespace:
prompts are only compared within one.

The report:

- ``exact_repeat_rate``: prompts equal to an earlier prompt of their namespace;
- ``prefix_repeat_rate``: prompts that share at least one full block with an earlier one;
- ``hit_rate``: prompt tokens an unbounded full-block cache serves / all prompt tokens, prompts taken
  in file order (:func:`prefixcache.bench.accounting.ideal_accounting`, the engine's exact count when
  its pool never evicts);
- ``breakers``: the top cache breakers (:mod:`prefixcache.cache.breakers`), each with
  ``hit_rate_if_moved``: the hit rate once that breaker's spans, in every prompt it involves (the
  breaking prompts, the chain they broke from, and the prompts equal to, or a prefix of, one of those),
  are moved to the end of their prompt (token ids moved as they are, not re-tokenized);
  ``hit_rate_if_all_moved`` does so for every breaker found.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prefixcache.bench.accounting import ideal_accounting
from prefixcache.cache.breakers import BreakerTracker
from prefixcache.cache.config import DEFAULT_BLOCK_SIZE
from prefixcache.config import DEFAULT_MODEL
from prefixcache.errors import InvalidInputError


@dataclass(frozen=True)
class Prompt:
    namespace: tuple[str | None, str | None]  # (tenant, cache_salt)
    token_ids: list[int]


def read_prompts(path: str | Path, tokenizer) -> list[Prompt]:
    """Reads and tokenizes a JSONL file of prompts (module docstring).

    Raises:
        InvalidInputError: (field ``prompts.jsonl:LINE``) a line that is not one of the forms.
    """
    prompts = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        field = f"{Path(path).name}:{n}"
        try:
            item = json.loads(line)
        except ValueError as e:
            raise InvalidInputError(field, f"{field}: not JSON: {e}") from e
        item = {"prompt": item} if isinstance(item, str) else item
        if not isinstance(item, dict):
            raise InvalidInputError(field, f"{field}: each line must be a JSON object or string")
        prompts.append(Prompt((item.get("tenant"), item.get("cache_salt")), _tokenize(item, tokenizer, field)))
    return prompts


def _tokenize(item: dict, tokenizer, field: str) -> list[int]:
    if isinstance(item.get("messages"), list):
        try:
            text = tokenizer.apply_chat_template(item["messages"], tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja's own errors
            raise InvalidInputError(field, f"{field}: messages could not be rendered with the chat template: {e}") from e
        return tokenizer.encode(text, add_special_tokens=False)
    prompt = item.get("prompt")
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise InvalidInputError(field, f'{field}: expected {{"prompt": text or token ids}} or {{"messages": [...]}}')


def _hit_stats(prompts: Sequence[Prompt], block_size: int) -> tuple[int, int, int]:
    """(prompt tokens, hit tokens, requests with a hit) of an unbounded cache, per namespace in order."""
    by_ns: dict = {}
    for p in prompts:
        by_ns.setdefault(p.namespace, []).append(p.token_ids)
    total = hits = hit_requests = 0
    for seqs in by_ns.values():
        acc = ideal_accounting([[s] for s in seqs], block_size)
        total, hits, hit_requests = total + acc.prompt_tokens, hits + acc.ideal_hit_tokens, \
            hit_requests + acc.ideal_hit_requests
    return total, hits, hit_requests


def _moved(prompts: Sequence[Prompt], spans: dict[int, tuple[int, int]]) -> list[Prompt]:
    """The prompts with ``spans[i] = (start, length)`` of prompt ``i`` moved to its end."""
    out = []
    for i, p in enumerate(prompts):
        if i in spans:
            s, n = spans[i]
            ids = p.token_ids[:s] + p.token_ids[s + n :] + p.token_ids[s : s + n]
            p = Prompt(p.namespace, ids)
        out.append(p)
    return out


def analyze(prompts: Sequence[Prompt], block_size: int, decode, top: int = 10) -> dict:
    """The report of the module docstring, as a dict.

    Args:
        prompts: tokenized prompts in arrival order.
        block_size: tokens per KV block.
        decode: token ids → text (for the breakers' classes and spans).
        top: breaker groups reported.
    """
    tracker = BreakerTracker(block_size, decode, max_chains=len(prompts) + 1, max_chain_tokens=1 << 40,
                             max_total_tokens=1 << 40, max_groups=len(prompts) + 1)  # everything kept: exact
    chain_prompt: dict[int, int] = {}  # chain id -> prompt index
    spans: dict[tuple, dict[int, tuple[int, int]]] = {}  # breaker group key -> prompt index -> span
    alias: dict[int, int] = {}  # a prompt that is a prefix of an earlier one -> that one (moved with it)
    seen: dict = {}
    exact = 0
    for i, p in enumerate(prompts):
        key = (p.namespace, tuple(p.token_ids))
        exact += key in seen
        seen.setdefault(key, i)
        b = tracker.observe(p.namespace, p.token_ids)
        if tracker.last_chain_id is not None:
            chain_prompt[tracker.last_chain_id] = i
        elif tracker.last_match_id is not None:
            alias[i] = chain_prompt[tracker.last_match_id]
        if b is not None:
            group = spans.setdefault((p.namespace, b.chain_id, b.position, b.kind), {})
            group.setdefault(i, (b.position, b.span_tokens))
            group.setdefault(chain_prompt[b.chain_id], (b.position, b.chain_span_tokens))
    for group in spans.values():
        for i, k in alias.items():
            if k in group and sum(group[k]) <= len(prompts[i].token_ids):
                group.setdefault(i, group[k])
    total, hits, hit_requests = _hit_stats(prompts, block_size)
    everything: dict[int, tuple[int, int]] = {}
    breakers = []
    for g in tracker.top(top):
        moved = spans[(g.namespace, g.chain_id, g.position, g.kind)]
        _, moved_hits, _ = _hit_stats(_moved(prompts, moved), block_size)
        breakers.append({**g.to_dict(with_text=True), "namespace": list(g.namespace),
                         "hit_rate_if_moved": moved_hits / total if total else 0.0})
    for group in spans.values():
        for i, span in group.items():
            everything.setdefault(i, span)
    _, all_hits, _ = _hit_stats(_moved(prompts, everything), block_size)
    n = len(prompts)
    return {
        "num_prompts": n, "prompt_tokens": total, "block_size": block_size,
        "exact_repeat_rate": exact / n if n else 0.0,
        "prefix_repeat_rate": hit_requests / n if n else 0.0,
        "hit_tokens": hits, "hit_rate": hits / total if total else 0.0,
        "num_breakers": tracker.num_breakers, "breaker_tokens_lost": tracker.tokens_lost,
        "breakers": breakers,
        "hit_rate_if_all_moved": all_hits / total if total else 0.0,
    }


def format_report(r: dict) -> str:
    lines = [
        f"{r['num_prompts']} prompts, {r['prompt_tokens']} tokens (block size {r['block_size']})",
        f"exact repeats:     {r['exact_repeat_rate']:.1%} of prompts",
        f"prefix repeats:    {r['prefix_repeat_rate']:.1%} of prompts share a full block with an earlier one",
        f"cache hit rate:    {r['hit_rate']:.1%} of prompt tokens ({r['hit_tokens']} tokens)",
        f"cache breakers:    {r['num_breakers']} ({r['breaker_tokens_lost']} tokens lost); "
        f"hit rate with every breaker moved to the end: {r['hit_rate_if_all_moved']:.1%}",
    ]
    for b in r["breakers"]:
        ex = b["examples"][0] if b["examples"] else {"request": "", "chain": ""}
        lines.append(f"  {b['kind']:<10} at token {b['position']} (block {b['block']}): {b['count']}x, "
                     f"{b['tokens_lost']} tokens lost, e.g. {ex['request']!r} vs {ex['chain']!r}; "
                     f"hit rate if moved to the end: {b['hit_rate_if_moved']:.1%}")
    return "\n".join(lines)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", help="JSONL file: {\"prompt\": ...} or {\"messages\": [...]} per line")
    p.add_argument("--model", default=DEFAULT_MODEL, help="whose tokenizer and chat template to use")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    p.add_argument("--top", type=int, default=10, help="breaker groups to report")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def run_cli(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from prefixcache.models.loader import resolve_model_dir

    if args.block_size < 1 or args.top < 1:
        raise ValueError("--block-size and --top must be >= 1")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model), local_files_only=True)
    try:
        prompts = read_prompts(args.prompts, tokenizer)
    except OSError as e:
        raise ValueError(f"cannot read {args.prompts}: {e}") from e
    report = analyze(prompts, args.block_size, lambda ids: tokenizer.decode(list(ids)), args.top)
    print(json.dumps(report, indent=1) if args.json else format_report(report), file=sys.stdout)
    return 0
