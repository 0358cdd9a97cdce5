"""What the scheduler hands the model runner for one step: the contract between the two.

A low-level data module (the runner and the cache see it without importing the engine). The runner
makes no scheduling decision: it writes the blocks loaded from KV tiers, does the slot copies, runs
the tokens of every scheduled sequence in one forward pass, and samples where ``sampling_params``
is set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prefixcache.prompt_logprobs import PromptLogprobsWork
from prefixcache.sampling_params import SamplingParams

if TYPE_CHECKING:
    from prefixcache.layers.lora import LoRAAdapter


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy slots ``[0, num_tokens)`` of ``src_block_id`` into ``dst_block_id``, all layers, K and V.

    Partial-block reuse (a cached block's first slots into a request's first new block) and
    copy-on-write (a shared block's written slots into a sample's private block).
    """

    src_block_id: int
    dst_block_id: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class LoadOp:
    """Write a block's K/V loaded from a KV tier into ``block_id``, all layers, all slots.

    ``payload``: ``shape = [num_layers, 2, block_size, num_kv_heads, head_dim]`` in the pool's dtype,
    C order, as bytes (verified against the request by the tier stack before it gets here).
    """

    block_id: int
    payload: bytes | bytearray | memoryview


@dataclass(slots=True)
class ScheduledSeq:
    """One request's work in a step: everything the model runner needs, nothing more.

    ``token_ids`` are the new tokens to compute, at positions
    ``num_computed_tokens .. num_computed_tokens + len(token_ids) - 1``.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sampling_params: SamplingParams | None  # None: no token is sampled this step (mid-prefill)
    lora: LoRAAdapter | None = None  # adapter applied to this request's tokens
    # Parallel sampling: (request id, params) of samples forked from this step's logits.
    forks: list[tuple[str, SamplingParams]] = field(default_factory=list)
    num_prompt_tokens: int = 0  # the request's prompt length in tokens (positions below it are prompt)
    prompt_logprobs: PromptLogprobsWork | None = None  # set: compute the chunk's prompt logprobs
    # The request's prompt and generated tokens so far, by reference (no copy; read-only for the
    # runner: the scheduler appends this step's token after the step). The sampler's penalties
    # and min_tokens read them; None where the caller has none (treated as empty).
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    # A model with several KV-cache groups (prefixcache/cache/kv_cache_groups.py): every group's block
    # table, group 0 first (== block_ids), each as long as block_ids, block 0 where a sliding group
    # released the block (outside every window this step reads). None with one group.
    group_block_ids: list[list[int]] | None = None


@dataclass(slots=True)
class SchedulerOutput:
    """The scheduler's decision for one step."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # finished since the last step
    # Partial-block reuse and copy-on-write: slot copies the runner does before the forward pass.
    copy_ops: list[CopyOp] = field(default_factory=list)
    # KV tier loads: blocks the runner fills from tier entries, before the copies and the forward pass.
    load_ops: list[LoadOp] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)
