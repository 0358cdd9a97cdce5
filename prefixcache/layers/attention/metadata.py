"""Per-step attention metadata: slots, prefill tiles, decode tables, cascade groups, the window of
local layers, built once per step by :func:`build_attention_metadata` (the per-layer work in
:mod:`prefixcache.layers.attention.torch_attention` is tensor ops only).

Batch invariance (a query's output is the same bits whichever other queries share its call): torch's
CPU flash-attention kernel (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) splits the keys into
blocks of 512 and the queries into blocks of 32, 64 or 256 rows, and merges key blocks by online
softmax. Its GEMMs run a query block in sub-blocks of 16 rows: a row gets the same bits in a call
of 4 to 16 rows and in any full sub-block, other bits in a call of 1 to 3 rows or in a 2- or 3-row
tail after full sub-blocks (on SmolLM2's head shape the rows 128-129 of an unpadded 130-token prefill,
a 2-row tail, round differently from the same rows after a 112-token cached prefix), and a key block shorter
than 512 sums in another order. With ``batch_invariant`` every call has its keys padded, masked, to a multiple of 512
(`padded_num_keys`), always an explicit mask, and its queries padded to 4..16 rows or a multiple
of 16 (`padded_num_queries`; a decode's call takes the query heads of one KV head as its rows,
and its query is repeated to the fewest copies that make such a count: ``ceil(4 / heads per KV head)``
up to 16 heads, twice for SmolLM2's 3). A query then gets the
same bits in a decode, in a prefill chunk of any length after any cached prefix, and in any batch
(`tests/layers/test_attention_invariance.py`). The runner turns it on for the batch-invariant
formats (int8, whose linear layers are exact; bfloat16 and int4, whose GEMMs run in row tiles that
give a row its one-row bits), so cache on and off give bit-identical logits; float32's GEMMs round
differently by batch size anyway, so it keeps the cheaper unpadded calls. The padding costs
compute only: masked key blocks add exact zeros. (float32 activations without GQA are a known
exception: a decode row then differs from its prefill row in the last bits.)

Those row counts are what MKL's AVX-512 GEMMs, behind torch's kernel, give the same bits for. MKL's AVX2 path (an
AVX2-only CPU, or MKL_ENABLE_INSTRUCTIONS=AVX2) runs other row blocks, and no padding rule above holds there:
:func:`torch_attention_batch_invariant` checks the rule on this machine's kernels once. Our paged kernel
(``paged_kernel``), whose bits are fixed by construction, runs a batch-invariant model's bf16 pool on every CPU
with AVX2, and its float32 pool or sliding windows where that check fails; the torch path serves the rest (CPUs
without AVX2, ``PREFIXCACHE_KERNELS=reference``, head shapes the kernel doesn't take, float32 pools and windows
where the rule holds), and where the check fails there its formats agree with cache off only to float rounding
(logged at start-up).
"""

from dataclasses import dataclass
from functools import cache

import torch

from prefixcache.kernels.decode_attention import DecodeRows, build_decode_rows
from prefixcache.kernels.prefill_attention import PagedRows, build_paged_rows
from prefixcache.layers.attention.cascade import CascadeGroup, build_cascade_groups, is_consecutive

KV_SPLIT = 512  # keys per block of torch's CPU flash-attention kernel (batch-invariant calls pad to a multiple)
MIN_Q_ROWS = 4  # a call of 1 to 3 query rows takes another GEMM path (other rounding)
Q_ROW_QUANTUM = 16  # rows of the GEMMs' sub-blocks: a 2- or 3-row tail after them rounds differently too


def padded_num_keys(context_len: int, batch_invariant: bool = True) -> int:
    """Keys a call attends over: ``context_len`` rounded up to a multiple of :data:`KV_SPLIT`
    (``context_len`` itself when not ``batch_invariant``)."""
    return -(-context_len // KV_SPLIT) * KV_SPLIT if batch_invariant else context_len


def padded_num_queries(num_queries: int, batch_invariant: bool = True) -> int:
    """Query rows a call computes: :data:`MIN_Q_ROWS` to :data:`Q_ROW_QUANTUM` rows as they are (at
    least 4), more rounded up to a multiple of 16, so no row ever falls in a 1- to 3-row call or tail;
    ``num_queries`` when not ``batch_invariant``."""
    if not batch_invariant:
        return num_queries
    n = max(num_queries, MIN_Q_ROWS)
    return n if n <= Q_ROW_QUANTUM else -(-n // Q_ROW_QUANTUM) * Q_ROW_QUANTUM


@cache
def torch_attention_batch_invariant() -> bool:
    """Whether torch's CPU attention kernel, called as the batch-invariant path calls it, gives a query row the
    same bits in a call of any padded row count (:func:`padded_num_queries`: 4 to 16, or a multiple of 16) at any
    place in the call, with rows masked to different key counts. Checked once per process on this machine's
    kernels (float32 and bfloat16; SmolLM2's head shape and a 2-heads-per-KV-head one), about 0.1 s: the answer
    depends on which GEMM path MKL and oneDNN take on this CPU, which no feature flag names."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    keys, rows = 2 * KV_SPLIT, 80
    lens = torch.randint(1, keys + 1, (rows,), generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        bias = torch.where(torch.arange(keys)[None] < lens[:, None], 0.0, float("-inf")).to(dtype)
        for heads, kv_heads, head_dim in ((9, 3, 64), (4, 2, 32)):
            q = torch.randn(1, heads, rows, head_dim, generator=g).to(dtype)
            k = torch.randn(1, kv_heads, keys, head_dim, generator=g).to(dtype)
            v = torch.randn(1, kv_heads, keys, head_dim, generator=g).to(dtype)

            def call(a: int, b: int) -> torch.Tensor:
                return F.scaled_dot_product_attention(q[:, :, a:b], k, v, attn_mask=bias[a:b], scale=head_dim**-0.5,
                                                      enable_gqa=True)[0]  # [heads, b - a, head_dim]

            try:
                whole = call(0, rows)
                for n in [*range(MIN_Q_ROWS, Q_ROW_QUANTUM + 1), 2 * Q_ROW_QUANTUM, 4 * Q_ROW_QUANTUM]:
                    for a in (0, 3, rows - n):
                        if not torch.equal(call(a, a + n), whole[:, a : a + n]):
                            return False
            except RuntimeError:  # a kernel that can't run here at all (a capped build): nothing to promise
                return False
    return True


Q_TILE = 256  # new tokens of a prefill attended per call: each call reads only the keys up to its tile


@dataclass(slots=True)
class QueryTile:
    """Up to Q_TILE consecutive new tokens of one prefill, attended in one call."""

    start: int  # first new token of the tile, counted from the sequence's first new token
    end: int  # one past its last
    num_keys: int  # padded_num_keys(keys up to its last token)
    key_bias: torch.Tensor  # [padded_num_queries(end - start), num_keys - key_start] model dtype, 0 = attend
    # (causal, no padded key), -inf = masked; the padding query rows repeat the last real row. Built once per
    # step: a bool mask would be turned into this by the kernel's caller in every layer (the same bits)
    key_start: int = 0  # first key read: 0, or with a sliding window the first one its first query's window
    # reaches (rounded down to a multiple of KV_SPLIT when batch-invariant, so the keys read stay whole blocks)


@dataclass(slots=True)
class PrefillMetadata:
    """One sequence with more than one new token."""

    token_start: int  # index of its first new token in the batch
    token_end: int  # one past its last new token in the batch
    context_len: int  # cached + new tokens
    block_ids: torch.Tensor  # [ceil(num_keys / block_size)] int64: its context's blocks, in order, padded
    # with block 0
    first_block: int | None  # its blocks are consecutive in the pool from this one (padding blocks
    # included): K/V are read as a view of the pool, no copy; None: gathered by block_ids
    num_keys: int  # padded_num_keys(context_len): keys gathered (the last tile's)
    tiles: list[QueryTile]  # its new tokens, Q_TILE at a time


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step inputs of every attention layer, built once by `build_attention_metadata`."""

    slot_mapping: torch.Tensor  # [num_tokens] int64; pool slot of each new token
    prefills: list[PrefillMetadata]  # sequences with more than one new token, in batch order
    decode_token_indices: torch.Tensor | None  # [num_decodes] int64 batch index of each decode token; None
    # when the decodes are the whole batch, in order (no gather/scatter needed)
    decode_block_table: torch.Tensor | None  # [num_decodes, max_decode_blocks] int64, padded with block 0;
    # None: no decodes. Each decode's tail: its context's blocks after its cascade group's shared run (all
    # of them outside a group). K/V are gathered a whole block at a time; the first num_decode_keys are used.
    decode_attn_mask: torch.Tensor | None  # [num_decodes, 1, 1, num_decode_keys] bool, True = a real
    # tail token; None: no decodes
    decode_key_bias: torch.Tensor | None  # decode_attn_mask as the kernel takes it: 0 where True, -inf
    # elsewhere, in the model's dtype
    decode_first_block: int | None  # a single decode whose tail blocks are consecutive in the pool from
    # this one: read as a view of the pool (masked padding blocks are whatever follows), no copy
    cascade_groups: list[CascadeGroup]  # shared-prefix groups of decodes; empty when batch-invariant
    num_decode_rows: int  # rows each (decode, KV head) call block needs: MIN_Q_ROWS when batch-invariant,
    # else 1; its query heads count, so each query is repeated torch_attention._decode_repeats(heads per
    # KV head, this) times
    num_decode_keys: int  # tail keys: padded_num_keys(longest decode tail); 0 without decodes
    batch_invariant: bool  # built with the padding rules of the module docstring
    num_tokens: int  # new tokens in the batch
    generated: DecodeRows | None = None  # generated tokens (num_prompt_tokens given): run by the model's
    # layers.decode_layers, never by Attention; every other field describes the remaining rows only
    dense_token_indices: torch.Tensor | None = None  # [num_tokens] int64: with `generated`, the batch
    # index of each remaining (prompt) row, the sub-batch the other fields describe
    paged: PagedRows | None = None  # built with ``paged_kernel``: every row runs our paged kernel, and
    # prefills / decode fields are empty
    sliding: "AttentionMetadata | None" = None  # built with ``sliding_window``: the same rows and slots,
    # each query attending only to the last sliding_window positions (itself included); the metadata of
    # a model's local layers. None: no layer of the model has a window


def build_attention_metadata(
    seqs: list[tuple[int, int, list[int]]], block_size: int, device: torch.device | str,
    batch_invariant: bool = False, dtype: torch.dtype = torch.float32, num_pool_blocks: int = 0,
    num_prompt_tokens: list[int] | None = None, paged_kernel: bool = False, sliding_window: int | None = None,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Builds a step's attention metadata and token positions.

    Args:
        seqs: Per sequence (num_computed_tokens, num_new_tokens, block_ids). The batch's new tokens are laid
            out sequence after sequence in this order. block_ids covers at least
            num_computed_tokens + num_new_tokens tokens.
        block_size: Tokens per KV block.
        device: Device of the model.
        batch_invariant: pad keys and queries as the module docstring says, so that a query's output
            has the same bits in any call (worth it only when the rest of the model is batch-invariant
            too: int8, bfloat16, int4); else each call attends over exactly its keys, and decodes sharing
            prefix blocks attend to them once (:mod:`prefixcache.layers.attention.cascade`).
        dtype: the model's activation dtype (of the key biases).
        num_pool_blocks: blocks in the pool (0: unknown). A sequence whose blocks are consecutive
            and whose padded key range ends inside the pool is read as a view instead of a gather
            (same bits: masked keys add exact zeros whatever finite values they hold; the pool
            starts zeroed).
        num_prompt_tokens: per sequence, its request's prompt length; given (with
            ``batch_invariant``), every new token at a position >= it (a generated token) goes to
            ``generated`` (the int4 format runs them through :mod:`prefixcache.layers.decode_layers`;
            their blocks are keyed apart) and the rest of the metadata describes the other tokens,
            ``dense_token_indices`` (none when every token is generated).
        paged_kernel: (with ``batch_invariant``) the (prompt) rows run our paged kernel
            (:mod:`prefixcache.kernels.prefill_attention`, ``paged``; with ``sliding_window``, the local
            layers' ``paged`` carries the window), which needs no padding; the model decides, as its cache
            key names it (``LlamaForCausalLM.paged_attention``).
        sliding_window: (a model with local layers, e.g. Gemma 3) also build ``sliding``: the
            metadata of its local layers, where the query at position q attends to the keys at
            positions ``q - sliding_window < k <= q`` (transformers' ``sliding_window_overlay``: the
            window counts the query itself). Every layer keeps the whole context in the pool; the
            window is a mask (a decode reads only the blocks its window reaches). Not with
            ``num_prompt_tokens``.

    Returns:
        (metadata, positions), positions shape = [num_tokens] int64, num_computed_tokens +
        arange(num_new_tokens) per sequence.

    Raises:
        ValueError: Empty batch, a sequence with no new token or negative computed tokens, block_ids too
            short for the sequence's context, or a sliding_window < 1 or given with num_prompt_tokens.
    """
    if paged_kernel and not batch_invariant:
        raise ValueError("paged_kernel needs batch_invariant")
    if sliding_window is not None:
        _check_window(sliding_window, num_prompt_tokens)
        metadata, positions = _build_metadata(seqs, block_size, device, batch_invariant, dtype, num_pool_blocks,
                                              paged_kernel)
        metadata.sliding = _build_metadata(seqs, block_size, device, batch_invariant, dtype, num_pool_blocks,
                                           paged_kernel, window=sliding_window)[0]
        return metadata, positions
    if num_prompt_tokens is not None and batch_invariant:
        return _split_metadata(seqs, block_size, device, dtype, num_pool_blocks, num_prompt_tokens, paged_kernel)
    return _build_metadata(seqs, block_size, device, batch_invariant, dtype, num_pool_blocks, paged_kernel)


def build_sliding_attention_metadata(
    seqs: list[tuple[int, int, list[int]]], block_size: int, device: torch.device | str, sliding_window: int,
    batch_invariant: bool = False, dtype: torch.dtype = torch.float32, num_pool_blocks: int = 0,
    num_prompt_tokens: list[int] | None = None, paged_kernel: bool = False,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """The local layers' metadata alone: what ``build_attention_metadata(..., sliding_window=...)``
    puts in ``sliding`` (the same tensors), built without the full-context metadata beside it, which
    a KV-cache group of local layers never reads (:mod:`prefixcache.layers.grouped_attention`).

    Args and Raises: as :func:`build_attention_metadata` with ``sliding_window`` given.

    Returns:
        (metadata, positions): ``sliding`` None on the metadata itself; positions shape = [num_tokens]
        int64, as :func:`build_attention_metadata` gives them.
    """
    if paged_kernel and not batch_invariant:
        raise ValueError("paged_kernel needs batch_invariant")
    _check_window(sliding_window, num_prompt_tokens)
    return _build_metadata(seqs, block_size, device, batch_invariant, dtype, num_pool_blocks, paged_kernel,
                           window=sliding_window)


def _check_window(sliding_window: int, num_prompt_tokens: list[int] | None) -> None:
    """Raises ValueError naming ``sliding_window`` when it is < 1 or given with num_prompt_tokens
    (the int4 split's decoder masks no window)."""
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if num_prompt_tokens is not None:
        raise ValueError("sliding_window is not supported with num_prompt_tokens")


def _build_metadata(
    seqs: list[tuple[int, int, list[int]]], block_size: int, device: torch.device | str, inv: bool,
    dtype: torch.dtype, num_pool_blocks: int, paged_kernel: bool = False, window: int | None = None,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """build_attention_metadata without generated rows; with ``window``, a local layers' metadata (no
    cascade groups: a group's shared run may lie outside a member's window)."""
    if paged_kernel:
        return _paged_metadata(seqs, block_size, device, window or 0)
    block_table = _padded_block_table(seqs, block_size, inv)  # [num_seqs, max_num_blocks]
    slot_mapping, positions = _slots_and_positions(seqs, block_table, block_size)
    prefills, decode_rows, decode_token_indices = _split_prefills_and_decodes(seqs, block_table, block_size, device,
                                                                              dtype, inv, num_pool_blocks, window)
    decode_block_table, decode_attn_mask, decode_key_bias, decode_index_tensor = None, None, None, None
    cascade_groups, num_decode_keys, decode_first_block = [], 0, None
    if decode_rows:
        cascade_groups = [] if inv or window is not None else build_cascade_groups(seqs, block_table, decode_rows,
                                                                              block_size, device)
        decode_block_table, decode_attn_mask, num_decode_keys = _decode_tables(
            seqs, block_table, decode_rows, cascade_groups, block_size, device, inv, window
        )
        decode_key_bias = torch.zeros(decode_attn_mask.shape, dtype=dtype, device=device).masked_fill_(
            ~decode_attn_mask, float("-inf"))
        if len(decode_rows) != len(seqs):
            decode_index_tensor = torch.tensor(decode_token_indices, dtype=torch.int64, device=device)
        if len(decode_rows) == 1 and not cascade_groups and window is None:
            row = decode_rows[0]
            decode_first_block = _consecutive_from(block_table[row], -(-(seqs[row][0] + seqs[row][1]) // block_size),
                                                   decode_block_table.shape[1], num_pool_blocks)
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        prefills=prefills,
        decode_token_indices=decode_index_tensor,
        decode_block_table=decode_block_table,
        decode_attn_mask=decode_attn_mask,
        decode_key_bias=decode_key_bias,
        decode_first_block=decode_first_block,
        cascade_groups=cascade_groups,
        num_decode_keys=num_decode_keys,
        num_decode_rows=MIN_Q_ROWS if inv else 1,
        batch_invariant=inv,
        num_tokens=sum(num_new for _, num_new, _ in seqs),
    )
    return metadata, positions.to(device)


def _paged_metadata(
    seqs: list[tuple[int, int, list[int]]], block_size: int, device: torch.device | str, window: int = 0,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """build_attention_metadata for our paged kernel: slots, positions and the kernel's tables only
    (``window`` > 0: a local layers' rows, each reading its last ``window`` positions)."""
    block_table = _padded_block_table(seqs, block_size, False)  # [num_seqs, max_num_blocks]; validates
    slot_mapping, positions = _slots_and_positions(seqs, block_table, block_size)
    paged = build_paged_rows([c for c, _, _ in seqs], [n for _, n, _ in seqs], block_table, window)
    return _metadata_without_calls(slot_mapping.to(device), paged), positions.to(device)


def _metadata_without_calls(slot_mapping: torch.Tensor, paged: PagedRows | None) -> AttentionMetadata:
    """Batch-invariant metadata with no torch attention calls: every row on our paged kernel
    (``paged``), or no rows at all for Attention (``paged`` None: a step of generated rows only)."""
    return AttentionMetadata(
        slot_mapping=slot_mapping, prefills=[], decode_token_indices=None, decode_block_table=None,
        decode_attn_mask=None, decode_key_bias=None, decode_first_block=None, cascade_groups=[],
        num_decode_rows=MIN_Q_ROWS, num_decode_keys=0, batch_invariant=True, num_tokens=slot_mapping.shape[0],
        paged=paged)


def _split_metadata(
    seqs: list[tuple[int, int, list[int]]], block_size: int, device: torch.device | str, dtype: torch.dtype,
    num_pool_blocks: int, num_prompt_tokens: list[int], paged_kernel: bool = False,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """build_attention_metadata with ``num_prompt_tokens``: the generated rows apart, the batch-invariant
    metadata of the prompt rows (each sequence's new tokens before its prompt length) in the rest."""
    block_table = _padded_block_table(seqs, block_size, True)  # [num_seqs, max_num_blocks]; validates
    _, positions = _slots_and_positions(seqs, block_table, block_size)
    dense_seqs, dense_indices, gen_indices, context_lens, seq_of_row = [], [], [], [], []
    start = 0
    for i, ((num_comp, num_new, block_ids), prompt_len) in enumerate(zip(seqs, num_prompt_tokens, strict=True)):
        num_dense = min(max(prompt_len - num_comp, 0), num_new)
        if num_dense:
            dense_seqs.append((num_comp, num_dense, block_ids))
            dense_indices.extend(range(start, start + num_dense))
        for pos in range(num_comp + num_dense, num_comp + num_new):
            gen_indices.append(start + pos - num_comp)
            context_lens.append(pos + 1)
            seq_of_row.append(i)
        start += num_new
    if not gen_indices:
        return _build_metadata(seqs, block_size, device, True, dtype, num_pool_blocks, paged_kernel)
    if dense_seqs:
        metadata, _ = _build_metadata(dense_seqs, block_size, device, True, dtype, num_pool_blocks, paged_kernel)
    else:
        metadata = _metadata_without_calls(torch.empty(0, dtype=torch.int64, device=device), None)
    metadata.generated = build_decode_rows(gen_indices, context_lens, block_table[seq_of_row], block_size, device)
    metadata.dense_token_indices = torch.tensor(dense_indices, dtype=torch.int64, device=device)
    return metadata, positions.to(device)


def _padded_block_table(seqs: list[tuple[int, int, list[int]]], block_size: int,
                        batch_invariant: bool) -> torch.Tensor:
    """[num_seqs, max_num_blocks] int64: each sequence's context blocks, padded with block 0 (masked
    out by the callers) up to the blocks of the longest context's padded keys."""
    num_blocks_per_seq = _num_blocks_per_seq(seqs, block_size)
    max_num_blocks = -(-padded_num_keys(max(c + n for c, n, _ in seqs), batch_invariant) // block_size)
    return torch.tensor(
        [list(ids[:nb]) + [0] * (max_num_blocks - nb) for (_, _, ids), nb in zip(seqs, num_blocks_per_seq)],
        dtype=torch.int64,
    )


def _num_blocks_per_seq(seqs: list[tuple[int, int, list[int]]], block_size: int) -> list[int]:
    """Blocks each sequence's context spans; validates the sequences (see build_attention_metadata)."""
    if not seqs:
        raise ValueError("build_attention_metadata needs at least one sequence")
    num_blocks_per_seq = []
    for i, (num_computed, num_new, block_ids) in enumerate(seqs):
        if num_new < 1 or num_computed < 0:
            raise ValueError(f"sequence {i}: num_new_tokens={num_new} must be >= 1, num_computed_tokens >= 0")
        num_blocks = -(-(num_computed + num_new) // block_size)
        if len(block_ids) < num_blocks:
            raise ValueError(
                f"sequence {i}: {len(block_ids)} block_ids cannot hold {num_computed + num_new} tokens "
                f"(block_size={block_size})"
            )
        num_blocks_per_seq.append(num_blocks)
    return num_blocks_per_seq


def _slots_and_positions(
    seqs: list[tuple[int, int, list[int]]], block_table: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool slot and position of every new token, sequence after sequence: two [num_tokens] int64."""
    num_seqs, max_num_blocks = block_table.shape
    num_computed = torch.tensor([s[0] for s in seqs], dtype=torch.int64)  # [num_seqs]
    context_lens = torch.tensor([s[0] + s[1] for s in seqs], dtype=torch.int64)  # [num_seqs]
    max_context_len = int(context_lens.max())
    offsets = torch.arange(block_size, dtype=torch.int64)
    slots = block_table[:, :, None] * block_size + offsets  # [num_seqs, max_num_blocks, block_size]
    slots = slots.reshape(num_seqs, max_num_blocks * block_size)  # [num_seqs, max_num_blocks * block_size]
    slots = slots[:, :max_context_len]  # [num_seqs, max_context_len]
    token_pos = torch.arange(max_context_len, dtype=torch.int64).expand(num_seqs, max_context_len)
    is_valid = token_pos < context_lens[:, None]  # [num_seqs, max_context_len]
    is_new = is_valid & (token_pos >= num_computed[:, None])
    # Boolean indexing is row-major: sequence after sequence, as the batch is laid out.
    return slots[is_new], token_pos[is_new]  # [num_tokens], [num_tokens]


def _split_prefills_and_decodes(
    seqs: list[tuple[int, int, list[int]]],
    block_table: torch.Tensor,
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
    batch_invariant: bool,
    num_pool_blocks: int = 0,
    window: int | None = None,
) -> tuple[list[PrefillMetadata], list[int], list[int]]:
    """Prefill metadata of the sequences with several new tokens (their tiles masked to ``window``
    when given); the decodes' rows and token indices."""
    prefills, decode_rows, decode_token_indices = [], [], []
    token_start = 0
    for i, (num_comp, num_new, _) in enumerate(seqs):
        context_len = num_comp + num_new
        if num_new == 1:
            decode_rows.append(i)
            decode_token_indices.append(token_start)
        else:
            num_keys = padded_num_keys(context_len, batch_invariant)
            num_key_blocks = -(-num_keys // block_size)
            prefills.append(
                PrefillMetadata(
                    token_start=token_start,
                    token_end=token_start + num_new,
                    context_len=context_len,
                    block_ids=block_table[i, :num_key_blocks].to(device),
                    first_block=_consecutive_from(block_table[i], -(-context_len // block_size), num_key_blocks,
                                                  num_pool_blocks),
                    num_keys=num_keys,
                    tiles=[_query_tile(num_comp, start, min(start + Q_TILE, num_new), device, dtype, batch_invariant,
                                       window) for start in range(0, num_new, Q_TILE)],
                )
            )
        token_start += num_new
    return prefills, decode_rows, decode_token_indices


def _consecutive_from(block_ids: torch.Tensor, num_real: int, num_read: int, num_pool_blocks: int) -> int | None:
    """The first block when a context's ``num_real`` blocks are consecutive in the pool and the
    ``num_read`` blocks read from there (padding included) end inside it; else None."""
    first = int(block_ids[0])
    if first + num_read > num_pool_blocks:
        return None
    return first if is_consecutive(block_ids[:num_real]) else None


def _query_tile(num_computed: int, start: int, end: int, device: torch.device | str, dtype: torch.dtype,
                batch_invariant: bool, window: int | None = None) -> QueryTile:
    """The tile of new tokens [start, end) of a sequence with num_computed cached tokens; with
    ``window``, each query also masks the keys at or before its position - window."""
    num_keys = padded_num_keys(num_computed + end, batch_invariant)
    num_rows = padded_num_queries(end - start, batch_invariant)
    query_pos = num_computed + start + torch.arange(num_rows, dtype=torch.int64).clamp_(max=end - start - 1)
    key_start = 0
    if window is not None:  # keys before the first query's window are masked for every query: not read
        key_start = max(0, num_computed + start - window + 1)
        key_start -= key_start % KV_SPLIT if batch_invariant else 0
    key_pos = torch.arange(key_start, num_keys, dtype=torch.int64)
    masked = key_pos[None, :] > query_pos[:, None]  # [num_rows, keys read]; the padded keys come after every query
    if window is not None:
        masked |= key_pos[None, :] <= query_pos[:, None] - window
    key_bias = torch.zeros(masked.shape, dtype=dtype).masked_fill_(masked, float("-inf"))
    return QueryTile(start=start, end=end, num_keys=num_keys, key_bias=key_bias.to(device), key_start=key_start)


def _decode_tables(
    seqs: list[tuple[int, int, list[int]]],
    block_table: torch.Tensor,
    decode_rows: list[int],
    cascade_groups: list[CascadeGroup],
    block_size: int,
    device: torch.device | str,
    batch_invariant: bool,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The decodes' tail block table [num_decodes, blocks of num_keys], key mask [num_decodes, 1, 1,
    num_keys] and num_keys (the longest tail, padded): each decode's context after its group's shared
    blocks; with ``window`` (no groups), from the block holding its window's first key, the keys
    before that key masked."""
    first_tail_block = [0] * len(decode_rows)
    for g in cascade_groups:
        for d in g.members.tolist():
            first_tail_block[d] = g.num_keys // block_size
    if window is not None:
        first_tail_block = [max(0, seqs[r][0] + seqs[r][1] - window) // block_size for r in decode_rows]
    tail_lens = [seqs[r][0] + seqs[r][1] - b * block_size for r, b in zip(decode_rows, first_tail_block)]
    num_keys = padded_num_keys(max(tail_lens), batch_invariant)
    num_blocks = -(-num_keys // block_size)
    table = torch.zeros(len(decode_rows), num_blocks, dtype=torch.int64)  # padded with block 0 (masked)
    for d, (r, b) in enumerate(zip(decode_rows, first_tail_block)):
        tail = block_table[r, b : b + num_blocks]
        table[d, : tail.shape[0]] = tail
    key_pos = torch.arange(num_keys, dtype=torch.int64)
    mask = key_pos[None, :] < torch.tensor(tail_lens, dtype=torch.int64)[:, None]  # [num_decodes, num_keys]
    if window is not None:  # the window's first key, counted from the tail's first block
        mask &= key_pos[None, :] > torch.tensor(tail_lens, dtype=torch.int64)[:, None] - 1 - window
    return table.to(device), mask[:, None, None, :].to(device), num_keys
