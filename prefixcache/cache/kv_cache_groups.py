"""KV-cache groups: which layers share a block table, and how much of the context each keeps.

A model declares an attention kind per layer (:class:`LayerSpec`): full attention (a query reads
every key before it) or a sliding window of ``window`` keys (a query at position ``p`` reads keys
``p - window + 1 .. p``, itself included: transformers' and Gemma 3's rule). The layers are cut into
groups as vLLM v1's hybrid allocator does (``kv_cache_utils``: one kind per group, every group with
the same number of layers, so that ONE block pool with one page size serves all groups): the group
size is the fewest layers of any kind, and each kind's layers, in layer order, are cut into groups
of that size (a kind's last group may have fewer). Full-attention groups come first; group 0, the
*primary* group, is a full one. Gemma 3 270M (18 layers, full ones 5, 11, 17) gives one full group
{5, 11, 17} and five sliding groups of 3. A model whose layers are all full has one group holding
every layer: the pool, the block tables and every block id are what they were before groups.

A block of the pool holds the K/V of ``layers_per_group`` layers of ONE group while it is allocated
(``KVCacheBlock.group_id``): the pool keeps ``layers_per_group`` tensors, and layer ``L`` lives in
tensor ``layer_to_group[L][1]`` at its group's block ids. A request holds one block table per group;
every group caches the same token blocks under the same hash chain, the cache keying a block by
(hash, group) (:func:`group_block_hash`).

What a sliding group keeps (vLLM's ``SlidingWindowManager``): when the next token to compute is at
position ``C``, no query of the request reads a key before ``C - window + 1`` again, so the blocks
wholly before it (:meth:`KVCacheGroup.num_skipped_blocks`) are released, still hit-able until
evicted, and their table entries become null.

Invariants:
- ``groups[0]`` is a full group; the groups partition the layers; every group has at most
  ``layers_per_group`` layers and one kind.
- :func:`group_block_hash` of group 0 is the block hash itself (one-group models key as before);
  other groups' keys never equal a real hash (they are longer).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.cache.hashing import BlockHash


class AttentionKind(str, enum.Enum):
    """How much of the context a layer reads; the values are transformers' ``layer_types`` names."""

    FULL = "full_attention"
    SLIDING = "sliding_attention"


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One layer's attention kind.

    Attributes:
        kind: full or sliding.
        window: for ``SLIDING``, the keys a query reads, itself included (``>= 1``); ``None`` for full.
    """

    kind: AttentionKind
    window: int | None = None


FULL_LAYER = LayerSpec(AttentionKind.FULL)


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers of one attention kind sharing one block table per request.

    Attributes:
        group_id: index in :attr:`KVCacheGroups.groups` (0: the primary, full group).
        spec: the kind (and window) of every layer in it.
        layer_ids: its layers, ascending; layer ``layer_ids[t]`` uses pool tensor ``t``.
    """

    group_id: int
    spec: LayerSpec
    layer_ids: tuple[int, ...]

    @property
    def is_sliding(self) -> bool:
        return self.spec.kind is AttentionKind.SLIDING

    def num_skipped_blocks(self, num_computed_tokens: int, block_size: int) -> int:
        """Leading blocks no query from position ``num_computed_tokens`` on reads again (0 for a full
        group): those wholly before ``num_computed_tokens - window + 1``."""
        if not self.is_sliding:
            return 0
        return max(0, num_computed_tokens - self.spec.window + 1) // block_size

    def num_window_blocks(self, block_size: int) -> int | None:
        """Blocks a hit ending at a block boundary ``L`` needs from this group: those covering
        ``[L - window + 1, L)``, ``ceil((window - 1) / block_size)`` (fewer when ``L`` is smaller);
        ``None`` for a full group (every block of ``[0, L)``)."""
        return -(-(self.spec.window - 1) // block_size) if self.is_sliding else None

    def num_retained_blocks(self, block_size: int) -> int:
        """Blocks before the end of a cached prefix kept with retention when freed (the window a
        future hit ending there reads, and one more): ``ceil(window / block_size) + 1``; 0 for a
        full group."""
        return -(-self.spec.window // block_size) + 1 if self.is_sliding else 0


@dataclass(frozen=True, slots=True)
class KVCacheGroups:
    """A model's layers cut into KV-cache groups (see the module docstring).

    Attributes:
        groups: group 0 first (full), then the other full groups, then the sliding ones.
        layer_to_group: per layer, ``(group_id, tensor index)``: its group and its tensor among the
            pool's ``layers_per_group`` tensors.
        layers_per_group: tensors in the pool, each ``shape = [2, num_blocks, block_size,
            num_kv_heads, head_dim]``; a block's memory is one slice of each.
    """

    groups: tuple[KVCacheGroup, ...]
    layer_to_group: tuple[tuple[int, int], ...]
    layers_per_group: int

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_hybrid(self) -> bool:
        """More than one group (some layers keep less, or different blocks, than group 0)."""
        return len(self.groups) > 1

    @property
    def num_layers(self) -> int:
        return len(self.layer_to_group)

    def sliding_blocks_held(self, block_size: int) -> int:
        """Pool blocks the sliding groups hold for one running request at most: ``ceil(window / block_size) + 2``
        each (its window, the block being filled, one new block); 0 with none."""
        return sum(g.num_retained_blocks(block_size) + 1 for g in self.groups if g.is_sliding)

    def pool_too_small(self, num_blocks: int, block_size: int) -> str | None:
        """Why a pool of ``num_blocks`` blocks can serve no request (the sliding groups would hold all of it),
        naming the flags; None where it can. The engine and the command line's check before the load
        (``entrypoints/cli/preflight.py``) say the same."""
        held = self.sliding_blocks_held(block_size)
        if num_blocks > held:
            return None
        groups = sum(g.is_sliding for g in self.groups)
        return (f"a KV pool of {num_blocks} blocks leaves none for a request's full-attention layers: the model's "
                f"{groups} sliding-window KV-cache groups hold up to {held} blocks of {block_size} tokens for a "
                f"running request (window / block_size + 2 each); give more than {held} blocks (--num-blocks), or "
                "a bigger --kv-cache-memory")


def make_kv_cache_groups(specs: Sequence[LayerSpec]) -> KVCacheGroups:
    """Cuts layers into groups of equal size, one kind each (vLLM v1's uniform-page-size grouping).

    Args:
        specs: one per layer, ``len >= 1``.

    Returns:
        The groups; all-full layers give one group of every layer (tensor ``L`` for layer ``L``).

    Raises:
        ValueError: no layer, no full-attention layer (group 0 must be full), or a sliding window < 1.
    """
    if not specs:
        raise ValueError("a model needs at least one layer")
    by_kind: dict[LayerSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        if spec.kind is AttentionKind.SLIDING and (spec.window is None or spec.window < 1):
            raise ValueError(f"layer {layer}: a sliding window must be >= 1, got {spec.window}")
        by_kind.setdefault(spec, []).append(layer)
    if FULL_LAYER not in by_kind:
        raise ValueError("a model without full-attention layers is not supported (KV-cache group 0 is full)")
    group_size = min(len(layers) for layers in by_kind.values())
    kinds = [FULL_LAYER] + sorted((s for s in by_kind if s != FULL_LAYER), key=lambda s: (s.kind.value, s.window or 0))
    groups: list[KVCacheGroup] = []
    layer_to_group: list[tuple[int, int]] = [(0, 0)] * len(specs)
    for spec in kinds:
        layers = by_kind[spec]
        for start in range(0, len(layers), group_size):
            group = KVCacheGroup(len(groups), spec, tuple(layers[start : start + group_size]))
            for tensor, layer in enumerate(group.layer_ids):
                layer_to_group[layer] = (group.group_id, tensor)
            groups.append(group)
    return KVCacheGroups(tuple(groups), tuple(layer_to_group), group_size)


def single_group(num_layers: int) -> KVCacheGroups:
    """The one group of a model whose layers are all full attention."""
    return make_kv_cache_groups([FULL_LAYER] * num_layers)


def layer_specs_from_config(config: object) -> list[LayerSpec]:
    """The layers' kinds a model config declares.

    Reads ``num_hidden_layers``, and where present ``layer_types`` (transformers' names, one per
    layer: ``"full_attention"`` / ``"sliding_attention"``) and ``sliding_window`` (keys a sliding
    query reads, itself included). A config without ``layer_types``, or with none (the Llama family's
    ``ModelConfig.layer_types == ()``), is all full.

    Raises:
        ValueError: ``layer_types`` of the wrong length or with an unknown name, or sliding layers
            without a ``sliding_window``; the message names the field.
    """
    num_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:  # None or (): every layer full
        return [FULL_LAYER] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    window = getattr(config, "sliding_window", None)
    specs = []
    for layer, name in enumerate(layer_types):
        try:
            kind = AttentionKind(name)
        except ValueError:
            raise ValueError(f"layer_types[{layer}] = {name!r}: expected one of "
                             f"{[k.value for k in AttentionKind]}") from None
        if kind is AttentionKind.SLIDING and window is None:
            raise ValueError(f"layer_types[{layer}] is sliding but the config has no sliding_window")
        specs.append(LayerSpec(kind, window if kind is AttentionKind.SLIDING else None))
    return specs


_GROUP_KEY = b"\x00kv-group"


def group_block_hash(block_hash: BlockHash, group_id: int) -> BlockHash:
    """The prefix cache's key of a block of group ``group_id`` holding the prefix ``block_hash``
    names: the hash itself for group 0, the hash followed by the group for the others (so a group
    never serves another, and one-group models key exactly as before)."""
    if group_id == 0:
        return block_hash
    return BlockHash(block_hash + _GROUP_KEY + struct.pack("<H", group_id))
