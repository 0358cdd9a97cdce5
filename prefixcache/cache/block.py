"""One KV-cache block's metadata, and the rule that makes a cached block a genuine hit
(:func:`verified_chain_length`, and :func:`follows` for one block).

Kept apart from the pool so the eviction policies and the pool both see the block type without an
import cycle. The K/V itself lives in the runner's KV pool (``runner/kv_pool.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixcache.cache.hashing import BlockHash

if TYPE_CHECKING:  # a torch-holding module: not imported by the flag checks of the command line
    from prefixcache.prompt_logprobs import BlockPromptLogprobs


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one KV-cache block.

    Compared by identity (``eq=False``): two blocks are the same block only if they are the same
    object.

    Attributes:
        block_id: index of the block in the pool, ``0 <= block_id < num_blocks``.
        ref_cnt: number of running requests whose block table holds this block.
        block_hash: the chained hash of the block; set iff the block is full and cached.
        token_ids: the block's ``block_size`` tokens, stored when cached (verified on a hit).
        token_bytes: ``token_ids`` as :func:`~prefixcache.cache.hashing.pack_token_ids` bytes,
            what a full hit compares (with ``Request.token_bytes``).
        parent: the previous block of the chain when cached; ``None`` for a first block.
        parent_generation: ``parent.generation`` at caching time.
        root_key: for a chain's first block, the caching request's root key; else ``None``.
        extra_key: the caching request's extra key for this block (tenant namespace, or ``b""``).
        generation: bumped each time the block is evicted or reset, i.e. each time its content
            stops being what was cached.
        depth: blocks before this one in its chain when cached (0 for a first block).
        cached_s: when the block was cached (the pool's clock, seconds).
        num_cached_children: cached blocks whose live parent is this block.
        prompt_logprobs: its tokens' prompt logprobs and its last hidden state, when the request
            that computed it asked for prompt logprobs; cleared with the rest of the content.
        group_id: the KV-cache group whose layers' K/V it holds since it was last allocated
            (:mod:`prefixcache.cache.kv_cache_groups`; always 0 for a one-group model). A block of
            another group than 0 is cached with ``parent`` = the group-0 block of the same position
            of the same prefix (its *anchor*), not the previous block of its own group.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    token_bytes: bytes | None = None
    parent: KVCacheBlock | None = None
    parent_generation: int = 0
    root_key: bytes | None = None
    extra_key: bytes = b""
    generation: int = 0
    depth: int = 0
    cached_s: float = 0.0
    num_cached_children: int = 0
    prompt_logprobs: BlockPromptLogprobs | None = None
    group_id: int = 0

    def __repr__(self) -> str:
        cached = f", hash={self.block_hash.hex()[:8]}" if self.block_hash is not None else ""
        parent = f", parent={self.parent.block_id}" if self.parent is not None else ""
        return (
            f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}{cached}{parent}, "
            f"gen={self.generation})"
        )


def follows(block: KVCacheBlock, parent: KVCacheBlock | None, root_key: bytes, extra_key: bytes) -> bool:
    """Whether cached ``block`` was cached right after ``parent``'s prefix, in the same namespace
    (:func:`verified_chain_length` of the one-block chain).

    Args:
        block: a cached block (``block_hash`` set).
        parent: the block verified for the previous block of the request; ``None`` for its first.
        root_key: the request's root key (model, salt, adapter, hash seed).
        extra_key: the request's extra key for this block (``Request.block_extra_key``).
    """
    return verified_chain_length((block,), parent, root_key, extra_key, 0) == 1


def verified_chain_length(
    blocks: Sequence[KVCacheBlock],
    parent: KVCacheBlock | None,
    root_key: bytes,
    tenant_key: bytes,
    num_unkeyed: int,
    first_output: int | None = None,
    output_key: bytes = b"",
) -> int:
    """How many of ``blocks``, from the first, form a verified chain continuing ``parent``.

    The one hit rule (besides the stored tokens, which a full hit compares whole and a partial hit
    by prefix, and the eviction policy's ``is_hit_allowed``): each block's recorded parent is the
    block before it (``parent`` for the first) at the generation that block had when this one was
    cached, or, for a chain's first block (``parent is None``), the block is a chain root cached
    under ``root_key``; and its ``extra_key`` (tenant namespace) is the request's for it. By
    induction over a verified chain, the whole prefix, and so the K/V, is the request's, whatever
    the hash function does; and a tenant-keyed block only ever serves its tenant.

    Args:
        blocks: cached blocks, consecutive positions of one request.
        parent: the block verified for the position before ``blocks[0]``; ``None`` if it is first.
        root_key: the request's root key (model, salt, adapter, hash seed).
        tenant_key: the request's tenant namespace (``b""`` for none).
        num_unkeyed: blocks of ``blocks`` keyed without ``tenant_key`` (those inside an approved
            shared prefix), counted from ``blocks[0]``.
        first_output: the first of ``blocks``, counted from ``blocks[0]``, whose key ends with
            ``output_key`` (an int4 request's blocks holding a generated token,
            ``BlockHasher.output_key``); ``None`` for none.

    Returns:
        The length of the longest verified head of ``blocks``.
    """
    for n, block in enumerate(blocks):
        if parent is None:
            if block.parent is not None or block.root_key != root_key:
                return n
        elif block.parent is not parent or block.parent_generation != parent.generation:
            return n
        key = tenant_key if n >= num_unkeyed else b""
        if first_output is not None and n >= first_output:
            key += output_key
        if block.extra_key != key:
            return n
        parent = block
    return len(blocks)


def matching_token_blocks(blocks: Sequence[KVCacheBlock], token_bytes: bytes | bytearray, block_size: int) -> int:
    """How many of ``blocks``, from the first, store the tokens of ``token_bytes`` (a request's
    ``Request.token_bytes``) at their positions: one bytes compare for all when every block matches.
    """
    width = 4 * block_size
    if b"".join([block.token_bytes for block in blocks]) == token_bytes[: len(blocks) * width]:
        return len(blocks)
    for n, (block, off) in enumerate(zip(blocks, range(0, len(token_bytes), width))):
        if block.token_bytes != token_bytes[off : off + width]:
            return n
    return min(len(blocks), len(token_bytes) // width)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of equal leading items of ``a`` and ``b`` (a partial hit's length, a prompt's shared
    part with an approved prefix)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
