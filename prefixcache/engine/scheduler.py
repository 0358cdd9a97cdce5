"""Continuous-batching scheduler with chunked prefill (vLLM v1's unified token-budget scheduler).

Each step spends a token budget (``max_num_batched_tokens``):

1. Running requests first, in admission order: a decode takes 1 token, an unfinished prefill
   takes its next chunk. When the pool can't grow a request, the newest running request is
   preempted (blocks freed, recomputed later from its prompt + output).
2. Then waiting requests, first come first served, while budget, ``max_num_seqs`` and the pool
   allow: each looks up its longest cached prefix, takes those blocks by reference and schedules
   (a chunk of) the rest. A request the pool can't serve waits at the head of the queue.

Prefix-cache statistics are recorded once per request, at its first admission; a preempted
request may reuse its own still-cached blocks when it is readmitted, but that is not a hit.

Invariants:
- every running request holds blocks covering ``num_computed_tokens`` and is scheduled at most once
  per step;
- a request samples a token only in the step that computes its last token.

Parallel sampling: a request with ``n > 1`` runs alone until its prompt is computed; in that step
the runner samples ``n`` tokens from its last logits and :meth:`update_from_output` forks the other
``n - 1`` samples, sharing its blocks (copy-on-write, see ``KVCacheManager.fork``). From then on
each sample is an ordinary running request. Such a request is admitted only when its ``n`` seats
fit under ``max_num_seqs`` (or nothing else runs).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from prefixcache.cache.kv_cache_manager import CopyOp, KVCacheManager
from prefixcache.engine.request import Request, RequestStatus, sample_request_id
from prefixcache.layers.lora import LoRAAdapter
from prefixcache.sampling_params import SamplingParams


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


@dataclass
class SchedulerOutput:
    """The scheduler's decision for one step."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # finished since the last step
    # Partial-block reuse: slot copies the runner does before the forward pass.
    copy_ops: list[CopyOp] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


class Scheduler:
    """Decides which requests run each step and how many of their tokens.

    Args:
        kv_cache_manager: owner of the block pool and block tables.
        max_num_seqs: requests running at once.
        max_num_batched_tokens: tokens per step.
    """

    def __init__(
        self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_req_ids: list[str] = []
        self.num_preemptions = 0
        # Prompt tokens run through the model, recomputes after preemption included.
        self.num_prompt_tokens_computed = 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = []
        budget = self.max_num_batched_tokens
        kv = self.kv_cache_manager

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while kv.allocate_slots(request, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.seqs.append(self._make_seq(request, num_new))
                budget -= num_new
                i += 1

        if not out.preempted_req_ids:
            # Seats: a request with n samples will run as n sequences once its prompt is done.
            seats = len(self.running) + sum(len(r.fork_params) for r in self.running)
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                need = 1 + len(request.fork_params)
                if self.running and seats + need > self.max_num_seqs:  # (alone, it may exceed)
                    break
                seats += need
                hit_blocks, num_hit = kv.get_computed_blocks(request)
                partial = kv.get_partial_hit(request, hit_blocks)
                num_partial = partial.num_tokens if partial is not None else 0
                num_new = min(request.num_tokens - num_hit - num_partial, budget)
                if kv.allocate_slots(request, num_new, hit_blocks, num_hit, partial) is None:
                    break
                self.waiting.popleft()
                if request.num_cached_tokens is None:  # first admission, not a recompute
                    request.num_cached_tokens = num_hit + num_partial
                    kv.stats.record(request.num_tokens, num_hit, num_partial)
                request.num_computed_tokens = num_hit + num_partial
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                out.seqs.append(self._make_seq(request, num_new))
                budget -= num_new
        out.copy_ops = list(kv.pending_copy_ops)
        return out

    def _make_seq(self, request: Request, num_new: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        completes = start + num_new == request.num_tokens
        forks = []
        if completes and request.fork_params:
            forks = [
                (sample_request_id(request.group_id, i), params)
                for i, params in enumerate(request.fork_params, start=1)
            ]
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new],
            num_computed_tokens=start,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            sampling_params=request.sampling_params if completes else None,
            lora=request.lora,
            forks=forks,
        )

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, int]
    ) -> list[Request]:
        """Advances computed counts and appends sampled tokens.

        Args:
            scheduler_output: the step that ran.
            sampled: request id → sampled token id, for requests that sampled.

        Returns:
            The requests that received a new token (the caller checks their stop conditions).
        """
        self.kv_cache_manager.end_step()  # the step's K/V is written: unpin partial-hit sources
        updated = []
        for seq in scheduler_output.seqs:
            request = self.requests[seq.request_id]
            request.num_computed_tokens += len(seq.token_ids)
            self.num_prompt_tokens_computed += max(
                0, min(request.num_computed_tokens, request.num_prompt_tokens) - seq.num_computed_tokens
            )
            token = sampled.get(seq.request_id)
            if token is not None:
                children = self._fork(request, seq.forks) if seq.forks else []
                request.append_output_token_ids(token)
                updated.append(request)
                for child in children:
                    child.append_output_token_ids(sampled[child.request_id])
                    updated.append(child)
        return updated

    def _fork(self, request: Request, forks: list[tuple[str, SamplingParams]]) -> list[Request]:
        """Creates the other samples of ``request``'s group, sharing its blocks; they run next."""
        children = []
        for index, (child_id, params) in enumerate(forks, start=1):
            child = request.fork(child_id, params, index)
            self.kv_cache_manager.fork(request, child)
            self.requests[child_id] = child
            self.running.append(child)
            children.append(child)
        request.fork_params = []
        return children

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request (stop, length or abort) and frees its blocks; unknown ids → None."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv_cache_manager.free(request)
        self._finished_req_ids.append(request_id)
        return request
