"""A request's state as the scheduler, the KV cache manager and the output processor see it.

Token ranges of a request (vLLM v1's picture)::

    | prompt                                  | output          |
    | num_computed_tokens   | scheduled now   | not yet         |

``block_hashes`` holds one hash per *full* block of ``all_token_ids`` and grows as tokens are
appended, so each block is hashed exactly once.

A low-level data module: the cache and the engine both see :class:`Request`; it imports nothing
above it at run time.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prefixcache.sampling_params import SamplingParams

if TYPE_CHECKING:
    from prefixcache.cache.hashing import BlockHash, BlockHasher
    from prefixcache.cache.pins import CacheBreakpoint, PinResult
    from prefixcache.engine.detokenizer import IncrementalDetokenizer
    from prefixcache.outputs import SampleLogprobs
    from prefixcache.layers.lora import LoRAAdapter
    from prefixcache.prompt_logprobs import PromptLogprobsState


def sample_request_id(group_id: str, sample_index: int) -> str:
    """The engine's id of sample ``sample_index`` of a parallel-sampling group (0 is the group id)."""
    return group_id if sample_index == 0 else f"{group_id}#{sample_index}"


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # the step that ran it failed (the engine goes on)

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASON

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    """One generation request (or one sample of an ``n > 1`` request).

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt, ``len >= 1``.
        sampling_params: validated sampling parameters.
        block_hasher: computes the chained block hashes.
        root_key: the request's cache-key root (model fingerprint, cache_salt, adapter, seed).
        arrival_s: arrival time (``time.monotonic()`` seconds); now when ``None``.
        stream: report an output after every step that adds a token, not only at the finish.
        lora: the LoRA adapter applied to this request (its digest is part of ``root_key``).
        tenant_key: the tenant namespace (:func:`~prefixcache.cache.hashing.tenant_extra_key`),
            mixed into the hash of, and verified on, every block from ``num_shared_blocks`` on.
        num_shared_blocks: leading full blocks that lie inside an approved shared prefix and are
            keyed without ``tenant_key``.
        prompt: the prompt text, when given as text.
        priority: scheduling priority, lower = earlier (vLLM's ``priority``); the outer key of every
            scheduling policy (:mod:`prefixcache.engine.sched_policy`).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_hasher: BlockHasher
    root_key: bytes
    arrival_s: float | None = None
    stream: bool = False
    lora: LoRAAdapter | None = None
    tenant_key: bytes = b""
    num_shared_blocks: int = 0
    prompt: str | None = None
    priority: int = 0
    # Parallel sampling (n > 1): this request is sample ``sample_index`` of group ``group_id``;
    # sample 0 carries the params of the samples forked from it once its prompt is computed.
    group_id: str = field(init=False)
    sample_index: int = field(init=False, default=0)
    fork_params: list[SamplingParams] = field(init=False)
    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(init=False, default_factory=list)
    block_hashes: list[BlockHash] = field(init=False, default_factory=list)
    # The tokens of its full blocks as pack_token_ids bytes (4 bytes per token, ``len(block_hashes)
    # * block_size`` tokens): what a cache hit's stored tokens are compared with.
    token_bytes: bytearray = field(init=False, default_factory=bytearray, repr=False)
    num_computed_tokens: int = field(init=False, default=0)
    # Tokens served from the prefix cache at first admission; None until admitted.
    num_cached_tokens: int | None = field(init=False, default=None)
    # Of those, the tokens loaded from each KV tier (tier name -> tokens); the rest came from the pool.
    cached_tier_tokens: dict[str, int] = field(init=False, default_factory=dict)
    num_preemptions: int = field(init=False, default=0)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    stop_reason: int | str | None = field(init=False, default=None)
    first_token_s: float | None = field(init=False, default=None)
    finish_s: float | None = field(init=False, default=None)
    # Output text bookkeeping (the output processor's): where the text ends when a stop string
    # matched, and how much of the decoded text is settled (searched for stop strings already).
    stop_text_end: int | None = field(init=False, default=None)
    stop_token_hidden: bool = field(init=False, default=False)  # stopped by a stop token / EOS, its text left out
    num_checked_chars: int = field(init=False, default=0)
    # The output text so far, grown token by token (an IncrementalDetokenizer; None until needed).
    detokenizer: IncrementalDetokenizer | None = field(init=False, default=None, repr=False, compare=False)
    error: str | None = field(init=False, default=None)  # why it finished with FINISHED_ERROR
    # With sampling_params.prompt_logprobs: the entries so far (set at first admission; the samples
    # of an n > 1 request share it, their prompt is one).
    prompt_logprobs: PromptLogprobsState | None = field(init=False, default=None)
    # With sampling_params.logprobs set: one dict per output token (see outputs.SampleLogprobs).
    logprobs: SampleLogprobs = field(init=False, default_factory=list)
    # Cache breakpoints (cache/pins.py): prefixes pinned once the prompt is computed, and what
    # the budget let each pin (None until then).
    cache_breakpoints: tuple[CacheBreakpoint, ...] = field(init=False, default=())
    pinned: tuple[PinResult, ...] | None = field(init=False, default=None)
    # Retention in the disk tier (prompt_cache_retention "24h"): seconds the prompt's full blocks
    # are kept once computed (None: not asked), and the tokens kept within the budget (None until then).
    retain_s: float | None = field(init=False, default=None)
    num_retained_tokens: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.group_id = self.request_id
        params = self.sampling_params
        self.fork_params = [
            dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i) for i in range(1, params.n)
        ]
        if self.arrival_s is None:
            self.arrival_s = time.monotonic()
        self.token_bytes += self.block_hasher.extend(
            self.block_hashes, self.all_token_ids, self.root_key, self.tenant_key, self.num_shared_blocks,
            self.num_prompt_tokens,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def fork(self, request_id: str, sampling_params: SamplingParams, sample_index: int) -> Request:
        """A new sample of this request's group, at the same point (prompt computed, no output).

        The child copies every field; each mutable one (token lists, hashes) is its own copy, so
        the two never share state (``tests/engine/test_scheduler.py`` checks every field). Its blocks
        are shared by the KV cache manager (:meth:`KVCacheManager.fork`).
        """
        child = copy.copy(self)
        child.request_id = request_id
        child.sampling_params = sampling_params
        child.sample_index = sample_index
        child.fork_params = []
        child.prompt_token_ids = list(self.prompt_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        child.output_token_ids = list(self.output_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.token_bytes = bytearray(self.token_bytes)
        child.logprobs = list(self.logprobs)
        child.cached_tier_tokens = dict(self.cached_tier_tokens)
        child.detokenizer = None  # its own text, decoded from its own tokens when first needed
        return child

    def block_extra_key(self, block_index: int) -> bytes:
        """The extra key of block ``block_index``: the tenant's, unless inside the shared prefix; then,
        for a block holding a generated token, the hasher's ``output_key`` (int4 models: its
        ``output_block_key`` and where generation starts), the same bytes its hash was chained with."""
        key = self.tenant_key if block_index >= self.num_shared_blocks else b""
        first_output = self.block_hasher.first_output_block(self.num_prompt_tokens)
        if first_output is None or block_index < first_output:
            return key
        return key + self.block_hasher.output_key(self.num_prompt_tokens)

    def append_output_token_ids(self, token_id: int) -> None:
        """Appends one sampled token and hashes any block it completes."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.token_bytes += self.block_hasher.extend(
            self.block_hashes, self.all_token_ids, self.root_key, self.tenant_key, self.num_shared_blocks,
            self.num_prompt_tokens,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
