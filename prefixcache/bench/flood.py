"""``--workload flood``: an agent's long shared system prompt against a flood of one-off long prompts, through a
pool that can't hold both, with the system prompt under a cache breakpoint (a pin, :mod:`prefixcache.cache.pins`)
and without, under each eviction policy.

Each round: one agent request (the shared prefix + a few new tokens; with ``breakpoint`` the prefix is pinned
for the whole run), then ``floods_per_round`` one-off prompts that share nothing. No model runs: the real
:class:`~prefixcache.cache.kv_cache_manager.KVCacheManager` admits, computes (in its accounting), caches, pins
and frees each request in turn, so the block counts are exact and the same on every machine. The workload's
maximum is every agent request after the first hitting the prefix's full blocks; plain LRU keeps only what the
last flood left of it (the report from SGLang's issue tracker: 5,770 one-off requests evicted a 10.8k-token
shared prefix). Pins hold at most ``max_pinned_fraction`` of the pool (``--max-pinned-fraction``).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from prefixcache.cache.config import CacheConfig
from prefixcache.cache.eviction import EVICTION_POLICIES
from prefixcache.cache.hashing import BlockHasher, make_root_key
from prefixcache.cache.kv_cache_manager import KVCacheManager
from prefixcache.cache.pins import CacheBreakpoint, check_breakpoints
from prefixcache.request import Request
from prefixcache.sampling_params import SamplingParams


@dataclass(frozen=True)
class FloodOptions:
    """The workload's sizes (defaults: a 4,096-token system prompt, three 1,600-token one-off prompts per agent
    request, a 400-block pool of 16 tokens: the prefix takes 256 blocks, each flood prompt 100, so the pool holds
    the prefix and one flood prompt, never the prefix and a round's flood)."""

    block_size: int = 16
    num_blocks: int = 400
    prefix_tokens: int = 4096  # the agent's shared system prompt
    suffix_tokens: int = 20  # each agent request's own tokens after it
    flood_tokens: int = 1600  # each one-off prompt
    floods_per_round: int = 3
    rounds: int = 6  # agent requests
    max_pinned_fraction: float = 0.7

    def validate(self) -> None:
        """Raises ValueError naming the field when a request can't fit the pool beside the pinned prefix."""
        for name in ("block_size", "num_blocks", "prefix_tokens", "flood_tokens", "floods_per_round", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        blocks = lambda tokens: -(-tokens // self.block_size)  # noqa: E731
        if blocks(self.prefix_tokens + self.suffix_tokens) > self.num_blocks:
            raise ValueError(f"num_blocks: the agent request needs {blocks(self.prefix_tokens + self.suffix_tokens)} "
                             f"blocks, the pool has {self.num_blocks}")
        if self.prefix_tokens // self.block_size + blocks(self.flood_tokens) > self.num_blocks:
            raise ValueError(f"num_blocks: a one-off prompt ({blocks(self.flood_tokens)} blocks) does not fit beside "
                             f"the pinned prefix ({self.prefix_tokens // self.block_size} blocks)")


def run_flood(policy: str, breakpoint: bool, opts: FloodOptions = FloodOptions()) -> list[int]:
    """Replays the workload once; returns each agent request's hit tokens, in order.

    Raises:
        ValueError: an unknown policy, or sizes that can't run (:meth:`FloodOptions.validate`).
    """
    opts.validate()
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"policy must be one of {sorted(EVICTION_POLICIES)}, got {policy!r}")
    config = dataclasses.replace(CacheConfig(block_size=opts.block_size), eviction_policy=policy,
                                 max_pinned_fraction=opts.max_pinned_fraction)
    clock = [0.0]  # one second a request: far inside any pin's ttl
    kv = KVCacheManager(opts.num_blocks, config, clock=lambda: clock[0])
    hasher, root = BlockHasher(opts.block_size), make_root_key(b"flood-model", None)
    prefix = list(range(10_000, 10_000 + opts.prefix_tokens))
    fresh = itertools.count(10_000 + opts.prefix_tokens)
    hits = []

    def run(request_id: str, prompt: list[int], breakpoints: tuple[CacheBreakpoint, ...] = ()) -> int:
        clock[0] += 1.0
        request = Request(request_id, prompt, SamplingParams(max_tokens=1), hasher, root)
        request.cache_breakpoints = check_breakpoints(list(breakpoints), len(prompt)) if breakpoints else ()
        admission = kv.admit(request, request.num_tokens)
        if admission is None:
            raise ValueError(f"request {request_id} did not fit the pool")
        request.num_computed_tokens += admission.num_new_tokens
        kv.end_step()
        if breakpoints:
            kv.pin_prefix(request)
        kv.free(request)
        return admission.num_hit_tokens

    for r in range(opts.rounds):
        agent = prefix + [next(fresh) for _ in range(opts.suffix_tokens)]
        hits.append(run(f"agent-{r}", agent, (CacheBreakpoint(len(prefix), ttl_s=3600.0),) if breakpoint else ()))
        for k in range(opts.floods_per_round):
            run(f"flood-{r}.{k}", [next(fresh) for _ in range(opts.flood_tokens)])
    return hits


def run_flood_benchmark(opts: FloodOptions = FloodOptions()) -> list[dict]:
    """One row per eviction policy and breakpoint (with / without): the agent requests' hit tokens after the
    first, their hit rate on the prefix and the workload's maximum (every later agent request hits the prefix's
    full blocks)."""
    maximum = (opts.rounds - 1) * (opts.prefix_tokens // opts.block_size * opts.block_size)
    rows = []
    for policy in sorted(EVICTION_POLICIES):
        for breakpoint in (True, False):
            hits = run_flood(policy, breakpoint, opts)
            rows.append({"policy": policy, "breakpoint": breakpoint, "agent_hit_tokens": hits,
                         "hit_tokens": sum(hits[1:]), "max_hit_tokens": maximum,
                         "hit_rate": sum(hits[1:]) / maximum if maximum else 0.0})
    return rows


def flood_markdown(rows: list[dict], opts: FloodOptions = FloodOptions()) -> str:
    """The rows as the benchmarks page's table."""
    lines = [f"Agent flood: a {opts.prefix_tokens}-token system prompt, {opts.floods_per_round} one-off "
             f"{opts.flood_tokens}-token prompts between agent requests, {opts.rounds} agent requests, a "
             f"{opts.num_blocks}-block pool of {opts.block_size} tokens, pins up to {opts.max_pinned_fraction:g} of it. "
             "Hit tokens of the agent requests after the first, against the workload's maximum:", "",
             "| eviction policy | with the breakpoint | without |", "|---|---|---|"]
    by = {(r["policy"], r["breakpoint"]): r for r in rows}
    for policy in sorted({r["policy"] for r in rows}):
        cells = [f"{by[policy, b]['hit_tokens']} / {by[policy, b]['max_hit_tokens']} ({by[policy, b]['hit_rate']:.0%})"
                 for b in (True, False)]
        lines.append(f"| `{policy}` | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"
