"""The attention layer: writes the new tokens' K/V into the pool, then attends over each sequence's
context with torch's kernels, as :mod:`prefixcache.layers.attention.metadata` laid the step out.

Sequences with one new token (decode) are grouped into one padded call with a key-padding mask (and
the decodes of a cascade group attend to their shared run once: :mod:`.cascade`); each sequence
with more new tokens (a prefill chunk) gets its own calls, a query tile at a time, with a causal mask
offset by its cached length. With ``batch_invariant`` the calls are padded as
:mod:`prefixcache.layers.attention.metadata` says.

The batch-invariant int4 format's generated tokens (``num_prompt_tokens``) never reach this module:
they run through :mod:`prefixcache.layers.decode_layers` and our own paged kernel
(:mod:`prefixcache.kernels.decode_attention`: one fixed order per row whatever its batch, shared
blocks read once into cache); its prompt tokens, and every token of int8 and bfloat16, keep one
call over the whole context, which gives a decode the bits of a prefill row.

Our paged kernel: a batch-invariant model on a CPU with AVX2 (``paged_kernel``, which the model's
``paged_attention`` decides) runs every row that reaches this module through
:mod:`prefixcache.kernels.prefill_attention` instead (``AttentionMetadata.paged``): one call per layer
for the whole step, keys read in place through the block tables, a row's bits fixed by construction,
so none of the padding of the torch path (:mod:`prefixcache.layers.attention.numerics` says which
rules the cache key names).
"""

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.kernels.prefill_attention import paged_prefill_attention
from prefixcache.layers.attention.cascade import merge_attention_states, shared_prefix_attention
from prefixcache.layers.attention.metadata import AttentionMetadata, PrefillMetadata, padded_num_queries


class Attention(nn.Module):
    """Paged causal self-attention with grouped KV heads (no parameters).

    Args:
        num_heads: Query heads.
        num_kv_heads: KV heads; divides num_heads.
        head_dim: Dimension per head.
        scale: Softmax scale, usually 1 / sqrt(head_dim).

    Attributes:
        kernel_form: the paged kernel's form this layer runs (the model sets it: its ``attention_dtype``); None:
            :func:`~prefixcache.kernels.prefill_attention.kernel_form` of the pool's dtype and window.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kernel_form: str | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Writes k/v of the new tokens into the pool, then attends over each sequence's context.

        Args:
            q: shape = [num_tokens, num_heads, head_dim], RoPE applied.
            k: shape = [num_tokens, num_kv_heads, head_dim], RoPE applied.
            v: shape = [num_tokens, num_kv_heads, head_dim].
            kv_cache: This layer's pool, shape = [2, num_blocks, block_size, num_kv_heads, head_dim].
            attn_metadata: The step's metadata.

        Returns:
            shape = [num_tokens, num_heads * head_dim].
        """
        num_tokens = q.shape[0]
        _, num_blocks, block_size = kv_cache.shape[:3]
        slots_shape = (num_blocks * block_size, self.num_kv_heads, self.head_dim)
        md = attn_metadata
        kv_cache[0].view(slots_shape).index_copy_(0, md.slot_mapping, k)  # view: [num_slots, kv_heads, head_dim]
        kv_cache[1].view(slots_shape).index_copy_(0, md.slot_mapping, v)  # view: [num_slots, kv_heads, head_dim]
        if md.paged is not None:  # our kernel, every row in one call
            return paged_prefill_attention(q, kv_cache, md.paged, self.scale, self.kernel_form).view(num_tokens, -1)
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, kv_heads, head_dim]

        if not md.prefills:  # decode-only batch: the decodes are the whole batch, in order
            out = self._decode_attention(q, k_cache, v_cache, md)  # [num_tokens, num_heads, head_dim]
        else:
            out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
            for p in md.prefills:
                out[p.token_start : p.token_end] = self._prefill_attention(q, k_cache, v_cache, p)
            if md.decode_block_table is not None:
                q_dec = q.index_select(0, md.decode_token_indices)  # [num_decodes, num_heads, head_dim]
                out.index_copy_(0, md.decode_token_indices, self._decode_attention(q_dec, k_cache, v_cache, md))
        return out.reshape(num_tokens, self.num_heads * self.head_dim)  # [num_tokens, num_heads * head_dim]

    def _prefill_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: PrefillMetadata
    ) -> torch.Tensor:
        """One sequence's chunk, a query tile at a time: shape = [num_new_tokens, num_heads, head_dim]."""
        num_read = p.block_ids.shape[0]
        kv_shape = (num_read * k_cache.shape[1], self.num_kv_heads, self.head_dim)
        if p.first_block is not None:  # consecutive blocks: a view of the pool, no copy
            k_seq = k_cache[p.first_block : p.first_block + num_read].view(kv_shape).transpose(0, 1)
            v_seq = v_cache[p.first_block : p.first_block + num_read].view(kv_shape).transpose(0, 1)
        else:
            k_seq = k_cache.index_select(0, p.block_ids).view(kv_shape).transpose(0, 1)  # [kv_heads, slots, hd]
            v_seq = v_cache.index_select(0, p.block_ids).view(kv_shape).transpose(0, 1)  # [kv_heads, slots, hd]
        q_seq = q[p.token_start : p.token_end]  # [num_new, num_heads, head_dim]
        outs = []
        for tile in p.tiles:
            q_tile = q_seq[tile.start : tile.end]  # [n, num_heads, head_dim]
            num_rows, n = tile.key_bias.shape[0], tile.end - tile.start
            if num_rows > n:  # padding rows (see metadata's module docstring): copies of the last query
                q_tile = torch.cat([q_tile, q_tile[-1:].expand(num_rows - n, -1, -1)])
            o = F.scaled_dot_product_attention(
                q_tile.transpose(0, 1).unsqueeze(0),  # [1, num_heads, num_rows, head_dim]
                k_seq[:, tile.key_start : tile.num_keys].unsqueeze(0),  # [1, kv_heads, keys read, head_dim]
                v_seq[:, tile.key_start : tile.num_keys].unsqueeze(0),
                attn_mask=tile.key_bias.to(q.dtype),  # a no-op unless built for another dtype
                scale=self.scale,
                enable_gqa=True,
            )  # [1, num_heads, num_rows, head_dim]
            outs.append(o[0, :, :n].transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode_attention(
        self, q_dec: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """All decode tokens: one padded call over their tails, one call per cascade group over its
        shared blocks, merged by log-sum-exp.

        Args:
            q_dec: shape = [num_decodes, num_heads, head_dim].

        Returns:
            shape = [num_decodes, num_heads, head_dim].
        """
        num_decodes, num_blocks = md.decode_block_table.shape
        flat_blocks = md.decode_block_table.view(num_decodes * num_blocks)  # [num_decodes * num_blocks]
        kv_shape = (num_decodes, num_blocks * k_cache.shape[1], self.num_kv_heads, self.head_dim)
        keys = slice(0, md.num_decode_keys)
        if md.decode_first_block is not None:  # one decode, consecutive blocks: a view of the pool
            first = md.decode_first_block
            k_dec = k_cache[first : first + num_blocks].view(kv_shape)[:, keys]  # [1, num_keys, kv_heads, hd]
            v_dec = v_cache[first : first + num_blocks].view(kv_shape)[:, keys]
        else:
            k_dec = k_cache.index_select(0, flat_blocks).view(kv_shape)[:, keys]  # [num_decodes, num_keys, kv_heads, hd]
            v_dec = v_cache.index_select(0, flat_blocks).view(kv_shape)[:, keys]  # [num_decodes, num_keys, kv_heads, hd]
        group = self.num_heads // self.num_kv_heads
        rows = _decode_repeats(group, md.num_decode_rows)  # repeats of each query, so that the call's rows pad right
        q = q_dec.view(num_decodes, self.num_kv_heads, group, 1, self.head_dim)
        q = q.expand(-1, -1, -1, rows, -1).reshape(num_decodes, self.num_kv_heads, group * rows, self.head_dim)
        # The query heads of one KV head as rows of one call (GQA without repeating K/V); the query
        # repeated when its heads alone are fewer rows than num_decode_rows (metadata's module docstring).
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k_dec.transpose(1, 2), v_dec.transpose(1, 2), attn_mask=md.decode_key_bias, scale=self.scale
        )[:2]  # [num_decodes, kv_heads, group * rows, head_dim], [num_decodes, kv_heads, group * rows]
        out = out.reshape(num_decodes, self.num_heads, rows, self.head_dim)[:, :, 0]  # [num_decodes, heads, hd]
        if not md.cascade_groups:
            return out
        lse = lse.reshape(num_decodes, self.num_heads, rows)[:, :, 0]  # [num_decodes, num_heads]
        for g in md.cascade_groups:
            o_shared, lse_shared = shared_prefix_attention(q_dec.index_select(0, g.members), k_cache, v_cache, g,
                                                           self.num_kv_heads, self.scale)
            merged = merge_attention_states(o_shared, lse_shared, out.index_select(0, g.members),
                                            lse.index_select(0, g.members))
            out.index_copy_(0, g.members, merged)
        return out


def _decode_repeats(group: int, min_rows: int) -> int:
    """Copies of each decode query in its call block of ``group`` query heads: the fewest giving at least
    ``min_rows`` rows that :func:`padded_num_queries` leaves as they are (no 1- to 3-row tail after
    16-row sub-blocks; 1 copy without batch invariance, ``min_rows`` 1)."""
    repeats = -(-min_rows // group)
    while min_rows > 1 and padded_num_queries(group * repeats) != group * repeats:
        repeats += 1
    return repeats
