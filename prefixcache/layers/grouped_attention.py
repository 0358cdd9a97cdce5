"""Attention metadata of a model whose layers keep different amounts of context (KV-cache groups).

The runner builds one :class:`~prefixcache.layers.attention.metadata.AttentionMetadata` per
KV-cache group (:mod:`prefixcache.cache.kv_cache_groups`) from that group's block tables, once per
group and step (:func:`build_grouped_attention_metadata`: a sliding group's window metadata alone, no
full-context one beside it), and hands the model a :class:`GroupedAttentionMetadata` with them. A
model opts in by setting the class attribute ``uses_kv_cache_groups = True`` (a model without it
gets one ``AttentionMetadata``, as the Llama family does); in its layer loop it asks for each
layer's metadata and pool tensor::

    for i, layer in enumerate(self.layers):
        md, kv_cache = attn_metadata.for_layer(i, kv_caches)
        hidden = layer(hidden, ..., kv_cache, md)   # Attention.forward(q, k, v, kv_cache, md)

Every group's metadata describes the same batch (the same new tokens, positions, prefills and
decodes); only the block ids differ. A sliding group's table holds block 0 where the block was
released: those positions lie wholly before ``position - window + 1`` for every query of the step,
so a layer masking keys outside its window (as sliding-window attention must) never reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefixcache.cache.kv_cache_groups import KVCacheGroups
from prefixcache.layers.attention.metadata import (AttentionMetadata, build_attention_metadata,
                                                   build_sliding_attention_metadata)


@dataclass(slots=True)
class GroupedAttentionMetadata:
    """Per-step attention inputs of every KV-cache group.

    Attributes:
        groups: one per group, group 0 first, each built by ``build_attention_metadata`` from that
            group's block tables: ``slot_mapping`` shape = [num_tokens] int64 (slots in that group's
            blocks), its prefills' ``block_ids`` and ``decode_block_table`` [num_decodes,
            max_blocks] that group's blocks.
        layer_to_group: per layer, ``(group id, tensor index)``: the layer reads and writes
            ``kv_caches[tensor index]`` (shape = [2, num_blocks, block_size, num_kv_heads, head_dim],
            the pool's ``layers_per_group`` tensors) at its group's block ids.
    """

    groups: list[AttentionMetadata]
    layer_to_group: tuple[tuple[int, int], ...]

    def for_layer(self, layer_idx: int, kv_caches: list[torch.Tensor]) -> tuple[AttentionMetadata, torch.Tensor]:
        """Layer ``layer_idx``'s metadata and pool tensor.

        Args:
            layer_idx: the decoder layer, ``0 <= layer_idx < len(layer_to_group)``.
            kv_caches: the pool's tensors (what the runner passes the model).

        Returns:
            ``(metadata of its group, kv_caches[its tensor index])``.
        """
        group_id, tensor = self.layer_to_group[layer_idx]
        return self.groups[group_id], kv_caches[tensor]

    @property
    def generated(self):
        """Group 0's ``generated`` (the int4 split), so code reading it on the metadata still works."""
        return self.groups[0].generated

    @property
    def paged(self):
        """Group 0's ``paged`` (our paged kernel's tables)."""
        return self.groups[0].paged


def build_grouped_attention_metadata(
    kv_cache_groups: KVCacheGroups, seqs_of_group: Callable[[int], list[tuple[int, int, list[int]]]],
    block_size: int, device: torch.device | str, **options,
) -> tuple[GroupedAttentionMetadata, torch.Tensor]:
    """A step's metadata of every KV-cache group, each built once: a full group's by
    :func:`~prefixcache.layers.attention.metadata.build_attention_metadata`, a sliding group's by
    :func:`~prefixcache.layers.attention.metadata.build_sliding_attention_metadata` with its window
    (the tensors ``build_attention_metadata(..., sliding_window=window).sliding`` holds).

    Args:
        kv_cache_groups: the model's groups (their windows and ``layer_to_group``).
        seqs_of_group: group id -> the step's sequences over that group's tables, per sequence
            ``(num_computed_tokens, num_new_tokens, block_ids)`` in batch order.
        block_size: tokens per block.
        device: the model's device.
        **options: ``batch_invariant``, ``dtype``, ``num_pool_blocks``, ``num_prompt_tokens``,
            ``paged_kernel``, as ``build_attention_metadata`` takes them.

    Returns:
        (metadata, positions), positions shape = [num_tokens] int64 (the same for every group).

    Raises:
        ValueError: as the builders raise (e.g. a window with ``paged_kernel``).
    """
    groups, positions = [], None
    for group in kv_cache_groups.groups:
        seqs = seqs_of_group(group.group_id)
        if group.is_sliding:
            metadata, positions = build_sliding_attention_metadata(seqs, block_size, device, group.spec.window,
                                                                   **options)
        else:
            metadata, positions = build_attention_metadata(seqs, block_size, device, **options)
        groups.append(metadata)
    return GroupedAttentionMetadata(groups, kv_cache_groups.layer_to_group), positions
