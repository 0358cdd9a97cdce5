"""The scheduler's view of the paged KV cache (vLLM v1's ``KVCacheManager`` contract).

The scheduler admits a request in two calls, back to back::

    blocks, num_hit_tokens = manager.get_computed_blocks(request)      # lookup, no side effect
    new_blocks = manager.allocate_slots(request, num_new_tokens, blocks, num_hit_tokens)
    if new_blocks is None: ...                                          # wait or preempt

and each later step of a running request calls ``allocate_slots(request, num_new_tokens)``.
``free(request)`` releases everything when it finishes or is preempted.

Invariants:
- ``req_to_blocks[id]`` is the request's block table: block ``i`` holds the K/V of its tokens
  ``[i * block_size, (i + 1) * block_size)``, and it covers every token allocated so far.
- ``num_cached_block[id]`` blocks at the head of that table are in the prefix-cache map (or were
  hits); a block is cached once its tokens are all known (its hash exists on the request).
- A lookup never returns the block holding the request's last token, so at least one token is
  computed and yields logits.
- ``allocate_slots`` either allocates everything asked for or changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixcache.cache.block_pool import BlockPool, KVCacheBlock
from prefixcache.cache.metrics import PrefixCacheStats
from prefixcache.engine.request import Request


class KVCacheManager:
    """Allocates KV-cache blocks to requests and finds their cached prefixes.

    Args:
        num_blocks: blocks in the pool, ``>= 1``.
        block_size: tokens per block, ``>= 1``; must match the requests' block hasher.
        enable_caching: automatic prefix caching on or off.

    Raises:
        ValueError: ``num_blocks < 1`` or ``block_size < 1``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Finds the longest verified cached prefix of the request, in full blocks.

        The last token is never served from the cache, so at most
        ``(request.num_tokens - 1) // block_size`` blocks are returned. Neither ref counts nor
        stats change; the caller records stats once per admission with ``stats.record``.

        Args:
            request: a request with no blocks allocated yet.

        Returns:
            ``(blocks, num_computed_tokens)`` with ``num_computed_tokens = len(blocks) *
            block_size``; ``([], 0)`` when caching is disabled.
        """
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        max_blocks = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        tokens = request.all_token_ids
        # All verified copies matched at block i-1 are candidate parents at block i (duplicates
        # of one block each carry their own chain); any block of the deepest level, followed
        # back along its parents, is a longest verified prefix.
        matches: list[KVCacheBlock] | None = None
        for i in range(max_blocks):
            level = self.block_pool.find_cached_blocks(
                request.block_hashes[i], tokens[i * bs : (i + 1) * bs], matches, request.root_key
            )
            if not level:
                break
            matches = level
        blocks: list[KVCacheBlock] = []
        if matches:
            block: KVCacheBlock | None = matches[0]
            while block is not None:
                blocks.append(block)
                block = block.parent
            blocks.reverse()
        return blocks, len(blocks) * bs

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Adds blocks for ``num_new_tokens`` more tokens, taking the cache hits first.

        Token ranges of the request::

            | num_computed_tokens | new computed (hits) | num_new_tokens (computed now) |
            |<------------------ covered by the block table afterwards -------------->|

        Full blocks are cached as soon as they are allocated, before the forward pass writes
        their K/V: the engine writes all K/V of a step before any attention reads, so a request
        scheduled later in the same step may already hit them (as in vLLM v1).

        Args:
            request: the request; ``request.num_computed_tokens`` is not changed here.
            num_new_tokens: tokens to compute in this step, ``>= 0``.
            new_computed_blocks: hits from :meth:`get_computed_blocks`, only for a request with
                no blocks yet, passed right after the lookup.
            num_new_computed_tokens: tokens those hits cover (``len * block_size``).

        Returns:
            The newly allocated blocks (not the hits), or ``None`` if the pool has too few free
            blocks, in which case nothing changed.

        Raises:
            ValueError: ``num_new_tokens < 0``, hits given for a request that already has
                blocks, or ``num_new_computed_tokens`` inconsistent with the hits.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid)
        if new_computed_blocks:
            if req_blocks:
                raise ValueError(f"request {rid!r} already has blocks; cache hits are for admission")
            if num_new_computed_tokens != len(new_computed_blocks) * self.block_size:
                raise ValueError(
                    f"num_new_computed_tokens ({num_new_computed_tokens}) must equal "
                    f"{len(new_computed_blocks)} hit blocks * block_size {self.block_size}"
                )
        elif num_new_computed_tokens != 0:
            raise ValueError("num_new_computed_tokens given without new_computed_blocks")

        num_blocks_held = len(req_blocks) if req_blocks else 0
        num_total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-num_total_tokens // self.block_size)
        num_new_blocks = max(0, num_required - num_blocks_held - len(new_computed_blocks))
        # Hits that sit in the free queue stop being allocatable once touched.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_free_hits:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
            self.num_cached_block[rid] = len(new_computed_blocks)
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)  # before allocating: hits must not be evicted
            req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            num_full_blocks = min(num_total_tokens // self.block_size, len(request.block_hashes))
            num_cached = self.num_cached_block[rid]
            if num_full_blocks > num_cached:
                self.block_pool.cache_full_blocks(
                    request, req_blocks, num_cached, num_full_blocks, self.block_size
                )
                self.num_cached_block[rid] = num_full_blocks
        return new_blocks

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first (so tails are evicted before heads).

        Cached blocks stay hit-able until evicted. Unknown or already freed requests are ignored.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids; ``[]`` for an unknown request."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache; refused (``False``) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests, in ``[0, 1]``."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated (free cached blocks included)."""
        return self.block_pool.get_num_free_blocks()

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently in the prefix-cache map."""
        return self.block_pool.num_cached_blocks

    def __repr__(self) -> str:
        return (
            f"KVCacheManager(block_size={self.block_size}, requests={len(self.req_to_blocks)}, "
            f"{self.block_pool!r})"
        )
