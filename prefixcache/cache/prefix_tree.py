"""What the prefix cache holds, as a tree: namespace → chains of cached blocks, with their use.

Every cached block records its parent (``KVCacheBlock.parent``), so the cached blocks form a forest
whose roots are the chains' first blocks. Runs of blocks with one cached child each are shown as
one *segment*; a node is a segment and its children are where the cached chains fork::

    namespace tenant=acme
      [0, 64)  "You are ACME's assistant..."   hits 12
        [64, 96)  "Q: shipping"                hits 3
        [64, 80)  "Q: returns"                 hits 1

:class:`BlockUsage` counts, per cached block, the requests it served (full-block hits) and when a
request last held it; the counts belong to a block's content, so they restart when the block is
evicted (its ``generation`` changes). Nodes are ordered by the prefill tokens they served
(``hits * tokens`` over their blocks, the most reused and largest first), then by size.

Invariants: a node's ``start``/``end`` are token positions in its chain (``end - start = tokens``);
a child's ``start`` is its parent's ``end``; only blocks in the pool's hash map appear.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prefixcache.cache.block import KVCacheBlock
from prefixcache.cache.block_pool import BlockPool
from prefixcache.cache.hashing import tenant_of_extra_key

MAX_LEVELS = 32  # forks shown below a chain's root


@dataclass(slots=True)
class _Use:
    generation: int
    hits: int = 0
    last_use_s: float = 0.0


class BlockUsage:
    """Hits and last use of each cached block's content (see the module docstring).

    Attributes:
        block_hits: full-block hits recorded, over all blocks (a request's hit blocks each count).
        distinct_hit_blocks: block contents that served at least one hit.
    """

    def __init__(self) -> None:
        self._uses: dict[int, _Use] = {}
        self.block_hits = 0
        self.distinct_hit_blocks = 0

    def _use(self, block: KVCacheBlock) -> _Use:
        use = self._uses.get(block.block_id)
        if use is None or use.generation != block.generation:
            use = self._uses[block.block_id] = _Use(block.generation)
        return use

    def record(self, blocks: Sequence[KVCacheBlock], num_hit_blocks: int, now_s: float) -> None:
        """One request held ``blocks`` (its block table) and was served the first ``num_hit_blocks``."""
        for i, block in enumerate(blocks):
            if block.block_hash is None:
                continue
            use = self._use(block)
            use.last_use_s = now_s
            if i < num_hit_blocks:
                self.distinct_hit_blocks += use.hits == 0
                use.hits += 1
                self.block_hits += 1

    def get(self, block: KVCacheBlock) -> tuple[int, float | None]:
        """``(hits, last use)`` of a cached block's current content (0 and None when never used)."""
        use = self._uses.get(block.block_id)
        if use is None or use.generation != block.generation:
            return 0, None
        return use.hits, use.last_use_s


_SALT_DIGEST_KEY = os.urandom(16)  # per process: a shown digest can't be matched against guessed salts


def salt_digest(salt: str) -> str:
    """8 hex digits naming a cache_salt on the dashboard: a keyed digest (BLAKE2b, a random key per
    process), stable within the process, so a viewer can group chains by salt but can't test
    guesses of a low-entropy salt offline (an unkeyed sha256 could be)."""
    return hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), key=_SALT_DIGEST_KEY, digest_size=4).hexdigest()


def namespace_of(root_key: bytes, extra_key: bytes) -> dict:
    """The namespace of a chain, fit to show: the tenant (or ``None``), and digests of the
    cache_salt and adapter (a salt is a secret: only its digest is shown)."""
    try:
        _, salt, _, adapter = json.loads(root_key)
    except (ValueError, TypeError):
        salt, adapter = None, ""
    return {"tenant": tenant_of_extra_key(extra_key), "salt": None if salt is None else salt_digest(salt),
            "adapter": adapter[:8] or None}


class _Tree:
    """Builds the nodes of one tree query (see :func:`build_prefix_tree`)."""

    def __init__(self, pool: BlockPool, usage: BlockUsage, decode: Callable[[Sequence[int]], str] | None,
                 visible_key: Callable[[bytes], bool], now_s: float, preview_tokens: int) -> None:
        self.bs = pool.config.block_size
        self.usage, self.decode, self.visible_key = usage, decode, visible_key
        self.now_s, self.preview_tokens = now_s, preview_tokens
        self.children: dict[int, list[KVCacheBlock]] = {}
        self.roots: list[KVCacheBlock] = []
        for copies in pool.cached_block_hash_to_block.values():
            for block in copies.values():
                if block.parent is None:
                    self.roots.append(block)
                else:
                    self.children.setdefault(block.parent.block_id, []).append(block)

    def node(self, block: KVCacheBlock, level: int = 0) -> dict:
        """The segment starting at ``block``, and its subtree (forks below ``MAX_LEVELS`` are cut:
        ``truncated``)."""
        segment = [block]
        while True:
            kids = [k for k in self.children.get(segment[-1].block_id, ()) if k.extra_key == block.extra_key]
            if len(kids) != 1 or len(self.children[segment[-1].block_id]) != 1:
                break
            segment.append(kids[0])
        uses = [self.usage.get(b) for b in segment]
        last = [t for _, t in uses if t is not None]
        below = [k for k in self.children.get(segment[-1].block_id, ()) if self.visible_key(k.extra_key)]
        kids = [self.node(k, level + 1) for k in below] if level < MAX_LEVELS else []
        node = {
            "start": block.depth * self.bs, "end": (segment[-1].depth + 1) * self.bs,
            "tokens": len(segment) * self.bs, "blocks": len(segment),
            "hits": uses[0][0], "served_tokens": sum(h for h, _ in uses) * self.bs,
            "last_use_s_ago": round(self.now_s - max(last), 3) if last else None,
            "blocks_in_use": sum(b.ref_cnt > 0 for b in segment),
            "subtree_tokens": len(segment) * self.bs + sum(k["subtree_tokens"] for k in kids),
            "subtree_served_tokens": sum(h for h, _ in uses) * self.bs + sum(k["subtree_served_tokens"] for k in kids),
            "children": sort_nodes(kids),
            "truncated": len(kids) < len(below),
        }
        if self.decode is not None:
            ids = [t for b in segment for t in b.token_ids][: self.preview_tokens]
            node["preview"] = self.decode(ids)
        return node


def sort_nodes(nodes: Iterable[dict]) -> list[dict]:
    """Most prefill served first, then the largest."""
    return sorted(nodes, key=lambda n: (-n["subtree_served_tokens"], -n["subtree_tokens"], n["start"]))


def build_prefix_tree(
    pool: BlockPool,
    usage: BlockUsage,
    now_s: float,
    *,
    decode: Callable[[Sequence[int]], str] | None = None,
    visible_key: Callable[[bytes], bool] = lambda extra_key: True,
    preview_tokens: int = 32,
    max_roots: int = 50,
) -> list[dict]:
    """The cached prefixes, grouped by namespace.

    Args:
        pool: the block pool (read on its own thread: nothing here is thread-safe).
        usage: the blocks' hits and last use.
        now_s: the pool's clock now (for ``last_use_s_ago``).
        decode: token ids → text for each node's ``preview`` (its first ``preview_tokens`` tokens);
            ``None``: no previews.
        visible_key: whether blocks with this ``extra_key`` (tenant namespace, ``b""`` for none or
            an approved shared prefix) may be shown; a hidden block hides its subtree.
        max_roots: chains shown per namespace (the most served first).

    Returns:
        ``[{"namespace": {"tenant", "salt", "adapter"}, "blocks", "tokens", "chains": [node]}]``,
        namespaces with the most served tokens first; each node as :meth:`_Tree.node` builds it.
    """
    tree = _Tree(pool, usage, decode, visible_key, now_s, preview_tokens)
    groups: dict[tuple[bytes, bytes], list[dict]] = {}
    for root in tree.roots:
        if visible_key(root.extra_key):
            groups.setdefault((root.root_key or b"", root.extra_key), []).append(tree.node(root))
    out = []
    for (root_key, extra_key), nodes in groups.items():
        nodes = sort_nodes(nodes)
        out.append({"namespace": namespace_of(root_key, extra_key),
                    "blocks": sum(n["subtree_tokens"] for n in nodes) // tree.bs,
                    "tokens": sum(n["subtree_tokens"] for n in nodes),
                    "served_tokens": sum(n["subtree_served_tokens"] for n in nodes),
                    "chains": nodes[:max_roots]})
    return sorted(out, key=lambda g: (-g["served_tokens"], -g["tokens"]))
