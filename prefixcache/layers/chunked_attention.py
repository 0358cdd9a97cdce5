"""Chunked attention for generated tokens: 256-key chunks merged by log-sum-exp, shared chunks once.

A query row (one token, all heads) attends over its context ``[0, position]`` split into chunks of
:data:`CHUNK_KEYS` keys at fixed absolute offsets (chunk ``j`` = keys ``[256 j, 256 (j + 1))``). Each
chunk is one batch entry of torch's CPU flash-attention kernel, whose key block (``min(512, keys)``)
is exactly one chunk (padded and masked past the row's position), so a row gets a chunk's
``(out_j, lse_j)`` with the same bits in any call (query blocks of >= :data:`MIN_Q_ROWS` rows, see
:mod:`prefixcache.layers.attention`). The chunks are then merged in chunk order::

    m = max_j lse_j,  w_j = exp(lse_j - m),  out = (sum_j out_j * w_j) / (sum_j w_j)

element-wise in float32, each sum a running sum over the chunks one after another (``cumsum``: a
scan, whatever the number of rows; a chunk a row does not have adds exact zeros), so the result
depends only on the row's own keys: the same bits in a decode, a recompute after preemption and any
batch. (``sum(0)`` would not do: torch's reduction changes its order with the number of rows.)

Why 256-key chunks: a decode's own chunks (those holding its tokens, gathered per decode) then carry
at most 255 keys it shares with others, a shared prefix splits into whole chunks down to 256 keys,
and a short context is still one chunk (one kernel entry). One layer, bf16, SmolLM2's shape
(``scripts/bench_chunk_sizes.py``, 2026-12-01): 10 decodes over a shared 2,032-token prefix 1.51 /
1.61 / 1.93 ms with 128- / 256- / 512-key chunks; one decode over 70-180 keys 0.13 / 0.11 / 0.13 ms;
one decode at ~8,100 keys 1.14 / 1.19 / 1.08 ms. Keys are gathered in runs of
``gcd(block_size, CHUNK_KEYS)`` consecutive slots (whole 16-token blocks by default), not slot by
slot.

Because a chunk's result does not depend on what else shares the call, chunks that several rows
have in common (whole chunks of a shared prefix: requests over one system prompt, the samples of an
``n > 1`` request) are computed once for all of them: one call whose query rows are every member's
heads, over the chunk's keys read in place when the blocks are consecutive in the pool. This is
shared-prefix (cascade) attention (FlashInfer's cascade inference, Ye et al. 2024; vLLM's
``use_cascade_attention``) made batch-invariant by fixing the split points and the merge order.

It rounds differently from one kernel call over the whole context (the kernel merges its key blocks
in float32 without rounding each block's output to the model's dtype), so a model uses it only for
rows whose K/V no prompt row ever reuses: the generated tokens of the int4 format, whose blocks are
keyed apart (:class:`prefixcache.cache.hashing.BlockHasher` ``output_block_key``). Prompt rows keep
the one-call form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KV_SPLIT = 512  # keys per block of torch's CPU flash-attention kernel (the one-call form pads to a multiple)
CHUNK_KEYS = 256  # keys per chunk here (<= KV_SPLIT: the kernel's key block is then the whole chunk)
MIN_Q_ROWS = 3  # a query block of 1 or 2 rows takes a different GEMM path (other rounding)


def common_run_length(ids: torch.Tensor) -> int:
    """Leading columns of ``ids`` [num_rows, n] on which every row agrees: the rows' common run of
    blocks (also used by :mod:`prefixcache.layers.attention`'s cascade groups)."""
    same = (ids == ids[0]).all(0)  # [n]
    return ids.shape[1] if bool(same.all()) else int(same.to(torch.int8).argmin())


def is_consecutive(blocks: torch.Tensor) -> bool:
    """Whether block ids [n] are first, first + 1, ...: readable as one view of the pool."""
    return bool((blocks == blocks[0] + torch.arange(blocks.shape[0])).all())


@dataclass(slots=True)
class SharedChunks:
    """The first ``num_chunks`` chunks of >= 2 rows' contexts, the same pool blocks for all of them."""

    rows: torch.Tensor  # [num_members] int64: indices into the ChunkedRows' rows
    num_chunks: int
    first_slot: int | None  # the chunks' keys are consecutive pool slots from here (read as a view)
    runs: torch.Tensor | None  # [num_chunks * CHUNK_KEYS // run] int64 slot runs (slot // run) when not
    # consecutive, run = ChunkedRows.run
    bias: torch.Tensor  # [num_chunks, 1, 1, CHUNK_KEYS] zeros: every key visible (an explicit mask, as the jobs')


@dataclass(slots=True)
class ChunkedRows:
    """A step's rows attended chunk by chunk (see the module docstring), built by `build_chunked_rows`."""

    token_indices: torch.Tensor  # [num_rows] int64: each row's index in the step's batch
    num_chunks: int  # chunks of the longest context
    shared: list[SharedChunks]
    job_rows: torch.Tensor  # [num_jobs] int64: the row of each (row, chunk) not in a shared group
    job_chunks: torch.Tensor  # [num_jobs] int64: its chunk
    run: int  # slots gathered together: gcd(block_size, CHUNK_KEYS), a run never crosses a block
    job_runs: torch.Tensor  # [num_jobs * CHUNK_KEYS // run] int64: the chunk's slot runs (slot // run; run 0
    # past the context)
    job_first_slot: int | None  # the jobs' real keys are consecutive slots from here, in job order, and the
    # padded range ends inside the pool: read as a view (a lone decode on consecutive blocks), no gather
    job_bias: torch.Tensor  # [num_jobs, 1, 1, CHUNK_KEYS] model dtype: 0 for the row's keys, -inf after its
    # position
    job_dest: torch.Tensor  # [num_jobs] int64: chunk * num_rows + row, where a job's result goes
    job_rows_are_rows: bool  # one job per row, in row order (job_rows == arange(num_rows))
    rectangular: bool  # no shared chunks and every row has every chunk: jobs are [num_rows, num_chunks]


def build_chunked_rows(
    token_indices: list[int], context_lens: list[int], block_table: torch.Tensor, block_size: int,
    device: torch.device | str, dtype: torch.dtype, min_shared_chunks: int = 1, num_pool_slots: int = 0,
) -> ChunkedRows:
    """Plans the chunk calls of a step's chunked rows.

    Args:
        token_indices: each row's index in the batch.
        context_lens: each row's keys: its position + 1 (>= 1).
        block_table: shape = [num_rows, max_blocks] int64 CPU, each row's sequence's blocks (covering
            its context; what follows is ignored).
        block_size: tokens per block.
        device: the model's device.
        dtype: the model's activation dtype (of the key bias).
        min_shared_chunks: whole shared chunks below which rows are not grouped.
        num_pool_slots: slots in the pool (0: unknown, never a view).

    Returns:
        The plan: shared chunk groups (rows whose block tables agree on whole chunks before every
        member's position) and one job per remaining (row, chunk).
    """
    num_chunks_per_row = [-(-c // CHUNK_KEYS) for c in context_lens]
    first_job_chunk = [0] * len(context_lens)
    shared = []
    run = math.gcd(block_size, CHUNK_KEYS)
    for members, num_shared in _shared_groups(context_lens, block_table, block_size, min_shared_chunks):
        for r in members:
            first_job_chunk[r] = num_shared
        shared.append(_shared_chunks(members, num_shared, block_table[members[0]], block_size, run, device, dtype))
    jobs = [(r, j) for r, n in enumerate(num_chunks_per_row) for j in range(first_job_chunk[r], n)]
    job_rows = torch.tensor([r for r, _ in jobs], dtype=torch.int64)
    job_chunks = torch.tensor([j for _, j in jobs], dtype=torch.int64)
    pos = job_chunks[:, None] * CHUNK_KEYS + torch.arange(CHUNK_KEYS)  # [num_jobs, CHUNK_KEYS] key positions
    lens = torch.tensor(context_lens, dtype=torch.int64)[job_rows][:, None]  # [num_jobs, 1]
    visible = pos < lens
    last_block = (lens - 1) // block_size  # [num_jobs, 1]: past it, read the row's last block (masked)
    blocks = block_table[job_rows[:, None], torch.minimum(pos // block_size, last_block)]
    slots = torch.where(visible, blocks * block_size + pos % block_size, 0)
    bias = torch.zeros(len(jobs), 1, 1, CHUNK_KEYS, dtype=dtype).masked_fill_(~visible[:, None, None, :],
                                                                             float("-inf"))
    first_slot = None
    if jobs and int(slots[0, 0]) + len(jobs) * CHUNK_KEYS <= num_pool_slots:
        in_order = int(slots[0, 0]) + torch.arange(len(jobs) * CHUNK_KEYS).view(len(jobs), CHUNK_KEYS)
        first_slot = int(slots[0, 0]) if bool((slots == in_order)[visible].all()) else None
    num_chunks = max(num_chunks_per_row)
    return ChunkedRows(
        token_indices=torch.tensor(token_indices, dtype=torch.int64, device=device),
        num_chunks=num_chunks,
        shared=shared,
        job_rows=job_rows.to(device),
        job_chunks=job_chunks.to(device),
        run=run,
        job_runs=(slots[:, ::run] // run).reshape(-1).to(device),  # a run's first key is real if any is
        job_first_slot=first_slot,
        job_bias=bias.to(device),
        job_dest=(job_chunks * len(context_lens) + job_rows).to(device),
        job_rows_are_rows=job_rows.tolist() == list(range(len(context_lens))),
        rectangular=not shared and len(jobs) == num_chunks * len(context_lens),
    )


def _shared_groups(context_lens: list[int], block_table: torch.Tensor, block_size: int,
                   min_shared_chunks: int) -> list[tuple[list[int], int]]:
    """(members, whole chunks they share) for each group of >= 2 rows whose block tables agree on
    whole chunks that lie before every member's position."""
    by_first: dict[int, list[int]] = {}
    for r, c in enumerate(context_lens):
        if (c - 1) // CHUNK_KEYS >= min_shared_chunks:  # whole chunks before its position
            by_first.setdefault(int(block_table[r, 0]), []).append(r)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        max_chunks = min((context_lens[r] - 1) // CHUNK_KEYS for r in members)
        ids = block_table[members, : -(-max_chunks * CHUNK_KEYS // block_size)]  # [num_members, blocks]
        num_shared = min(common_run_length(ids) * block_size // CHUNK_KEYS, max_chunks)
        if num_shared >= min_shared_chunks:
            groups.append((members, num_shared))
    return groups


def _shared_chunks(members: list[int], num_chunks: int, block_ids: torch.Tensor, block_size: int, run: int,
                   device: torch.device | str, dtype: torch.dtype) -> SharedChunks:
    """A group's shared chunks: a slot range when their blocks are consecutive, else the slot runs
    (``run`` slots each: ``ChunkedRows.run``)."""
    num_tokens = num_chunks * CHUNK_KEYS
    blocks = block_ids[: -(-num_tokens // block_size)]
    consecutive = is_consecutive(blocks)
    pos = torch.arange(0, num_tokens, run, dtype=torch.int64)  # each run's first key
    return SharedChunks(
        rows=torch.tensor(members, dtype=torch.int64, device=device),
        num_chunks=num_chunks,
        first_slot=int(blocks[0]) * block_size if consecutive else None,
        runs=None if consecutive else ((blocks[pos // block_size] * block_size + pos % block_size) // run).to(device),
        bias=torch.zeros(num_chunks, 1, 1, CHUNK_KEYS, dtype=dtype, device=device),
    )


def chunked_attention(
    q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, plan: ChunkedRows, scale: float
) -> torch.Tensor:
    """The rows' attention outputs, chunk by chunk (see the module docstring).

    Args:
        q: shape = [num_rows, num_heads, head_dim], the plan's rows in order, RoPE applied.
        k_slots: this layer's keys by pool slot, shape = [num_slots, num_kv_heads, head_dim]
            (the rows' own K already written).
        v_slots: values, the same shape.
        plan: from `build_chunked_rows`.
        scale: softmax scale.

    Returns:
        shape = [num_rows, num_heads, head_dim], q's dtype.
    """
    num_rows, num_heads, head_dim = q.shape
    out, lse = None, None
    if plan.job_rows.numel():
        num_jobs = plan.job_rows.shape[0]
        if plan.job_first_slot is not None:  # consecutive: a view of the pool (masked keys: whatever follows)
            keys = slice(plan.job_first_slot, plan.job_first_slot + num_jobs * CHUNK_KEYS)
            k, v = k_slots[keys], v_slots[keys]
        else:
            k, v = _gather_runs(k_slots, plan.job_runs, plan.run), _gather_runs(v_slots, plan.job_runs, plan.run)
        k = k.view(num_jobs, CHUNK_KEYS, *k_slots.shape[1:])
        v = v.view(num_jobs, CHUNK_KEYS, *v_slots.shape[1:])
        q_jobs = q if plan.job_rows_are_rows else q.index_select(0, plan.job_rows)
        out, lse = _chunk_call(q_jobs[:, None], k, v, plan.job_bias, scale)  # [num_jobs, 1, ...]
        if plan.rectangular and plan.num_chunks == 1:  # one chunk each: its output is the row's
            return out.view(num_rows, num_heads, head_dim)
        if plan.rectangular:  # row-major jobs, every row all num_chunks chunks: a view, no scatter
            out = out.view(num_rows, plan.num_chunks, num_heads, head_dim).transpose(0, 1)
            lse = lse.view(num_rows, plan.num_chunks, num_heads).transpose(0, 1)
            return merge_chunks(out.float(), lse).to(q.dtype)
    out_all = q.new_zeros((plan.num_chunks * num_rows, num_heads, head_dim), dtype=torch.float32)
    lse_all = q.new_full((plan.num_chunks * num_rows, num_heads), float("-inf"), dtype=torch.float32)
    if out is not None:  # job (r, j) at j * num_rows + r
        out_all.index_copy_(0, plan.job_dest, out[:, 0].float())
        lse_all.index_copy_(0, plan.job_dest, lse[:, 0])
    out_all = out_all.view(plan.num_chunks, num_rows, num_heads, head_dim)
    lse_all = lse_all.view(plan.num_chunks, num_rows, num_heads)
    for g in plan.shared:
        num_keys = g.num_chunks * CHUNK_KEYS
        if g.first_slot is not None:  # consecutive blocks: a view of the pool, no copy
            k, v = k_slots[g.first_slot : g.first_slot + num_keys], v_slots[g.first_slot : g.first_slot + num_keys]
        else:
            k, v = _gather_runs(k_slots, g.runs, plan.run), _gather_runs(v_slots, g.runs, plan.run)
        q_members = q.index_select(0, g.rows)  # [num_members, num_heads, head_dim]
        out, lse = _chunk_call(q_members[None].expand(g.num_chunks, -1, -1, -1),
                               k.view(g.num_chunks, CHUNK_KEYS, *k.shape[1:]),
                               v.view(g.num_chunks, CHUNK_KEYS, *v.shape[1:]), g.bias, scale)
        out_all[: g.num_chunks].index_copy_(1, g.rows, out.float())
        lse_all[: g.num_chunks].index_copy_(1, g.rows, lse)
    return merge_chunks(out_all, lse_all).to(q.dtype)


def _gather_runs(slots: torch.Tensor, runs: torch.Tensor, run: int) -> torch.Tensor:
    """The keys of ``runs`` (each ``run`` consecutive slots), in order: [len(runs) * run, kv_heads, hd]."""
    return slots.view(-1, run, *slots.shape[1:]).index_select(0, runs).view(-1, *slots.shape[1:])


def _chunk_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel call, a chunk per batch entry, every row of an entry over the entry's keys.

    Args:
        q: shape = [num_entries, num_rows, num_heads, head_dim].
        k, v: shape = [num_entries, CHUNK_KEYS, num_kv_heads, head_dim].
        bias: shape = [num_entries, 1, 1, CHUNK_KEYS], 0 or -inf.

    Returns:
        (out, lse): shape = [num_entries, num_rows, num_heads, head_dim] and [num_entries, num_rows,
        num_heads] float32.
    """
    entries, num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    rep = -(-MIN_Q_ROWS // (group * num_rows))  # repeats so that a query block has >= MIN_Q_ROWS rows
    # [entries, kv_heads, num_rows * group * rep, head_dim]: the rows' heads of one KV head as rows of one
    # call (GQA without repeating K/V)
    if num_rows == 1 and rep == 1:  # a decode's heads as they are: no copy
        rows = q.reshape(entries, num_kv_heads, group, head_dim)
    else:
        rows = q.reshape(entries, num_rows, num_kv_heads, group, 1, head_dim).expand(-1, -1, -1, -1, rep, -1)
        rows = rows.permute(0, 2, 1, 3, 4, 5).reshape(entries, num_kv_heads, num_rows * group * rep, head_dim)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        rows, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, scale=scale)[:2]
    if num_rows == 1 and rep == 1:
        return out.reshape(entries, 1, num_heads, head_dim), lse.reshape(entries, 1, num_heads)
    out = out.reshape(entries, num_kv_heads, num_rows, group, rep, head_dim)[:, :, :, :, 0]
    lse = lse.reshape(entries, num_kv_heads, num_rows, group, rep)[:, :, :, :, 0]
    return (out.permute(0, 2, 1, 3, 4).reshape(entries, num_rows, num_heads, head_dim),
            lse.permute(0, 2, 1, 3).reshape(entries, num_rows, num_heads))


def merge_chunks(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Attention over all chunks from each chunk's: the merge of the module docstring, in chunk order.

    Args:
        out: shape = [num_chunks, num_rows, num_heads, head_dim] float32 (0 where a row lacks the chunk).
        lse: shape = [num_chunks, num_rows, num_heads] float32 (-inf where a row lacks the chunk).

    Returns:
        shape = [num_rows, num_heads, head_dim] float32.
    """
    if out.shape[0] == 1:
        return out[0]
    w = torch.exp(lse - lse.amax(0)).unsqueeze(-1)  # [num_chunks, num_rows, num_heads, 1]
    return (out * w).cumsum(0)[-1] / w.cumsum(0)[-1]  # running sums in chunk order (module docstring)
