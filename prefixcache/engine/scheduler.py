"""Continuous-batching scheduler with chunked prefill (vLLM v1's unified token-budget scheduler).

Each step spends a token budget (``max_num_batched_tokens``):

1. Running requests first, in admission order: a decode takes 1 token, an unfinished prefill
   takes its next chunk. When the pool can't grow a request, the newest running request is
   preempted (blocks freed, recomputed later from its prompt + output). While short requests wait
   at the queue's head (prompts of at most ``long_prefill_token_threshold`` tokens, together at most
   that many), prefill chunks leave their tokens in the budget, so a short request is admitted in
   the next step instead of after a long prompt's whole prefill (the concern of vLLM's
   ``long_prefill_token_threshold`` and V0's partial-prefill limits). A chunk also leaves one token
   to each running decode after it; but every prefill chunk keeps at least half of the budget it
   finds, so each running prefill progresses in every step.
2. Then waiting requests, in the order of the scheduling policy (``fcfs``, ``lpm``: see
   :mod:`prefixcache.engine.sched_policy`; ``priority`` first), while budget, ``max_num_seqs`` and
   the pool allow: :meth:`KVCacheManager.admit` takes each one's longest cached prefix by reference
   and allocates (a chunk of) the rest. When the pool can't serve the next one, admission stops
   (it stays first).

Prefix-cache statistics are recorded once per request, at its first admission; a preempted
request may reuse its own still-cached blocks when it is readmitted, but that is not a hit.

Invariants:
- every running request holds blocks covering ``num_computed_tokens`` and is scheduled at most once
  per step;
- a request samples a token only in the step that computes its last token;
- ``running`` and ``waiting`` are ordered dicts, so a finish or abort removes a request
  in O(1).

Parallel sampling: a request with ``n > 1`` runs alone until its prompt is computed; in that step
the runner samples ``n`` tokens from its last logits and :meth:`update_from_output` forks the other
``n - 1`` samples, sharing its blocks (copy-on-write, see ``KVCacheManager.fork``). From then on
each sample is an ordinary running request. Such a request is admitted only when its ``n`` seats
fit under ``max_num_seqs`` (or nothing else runs).

A model with several KV-cache groups (sliding-window layers): each scheduled sequence carries every
group's block table (``ScheduledSeq.group_block_ids``), and after each step a request's
sliding-window blocks that no query of it reads again are released
(``KVCacheManager.remove_skipped_blocks``). A prefill chunk that doesn't fit the pool is halved
until it does before anyone is preempted or admission stops: every group takes the chunk's blocks
and the sliding ones give most back only after the step.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from prefixcache.cache.kv_cache_manager import KVCacheManager
from prefixcache.config import SchedulerConfig
from prefixcache.engine.sched_policy import make_scheduling_policy
from prefixcache.prompt_logprobs import PromptLogprobsChunk, PromptLogprobsState
from prefixcache.request import Request, RequestStatus, sample_request_id
from prefixcache.sampling_params import SamplingParams
from prefixcache.scheduler_output import ScheduledSeq, SchedulerOutput


class Scheduler:
    """Decides which requests run each step and how many of their tokens.

    Args:
        kv_cache_manager: owner of the block pool and block tables.
        config: ``max_num_seqs`` (requests running at once), ``max_num_batched_tokens`` (tokens per
            step) and the scheduling policy's options.
        clock: current time in seconds, the clock of ``Request.arrival_s`` (virtual in simulations).
    """

    def __init__(self, kv_cache_manager: KVCacheManager, config: SchedulerConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        config.validate()
        self.kv_cache_manager = kv_cache_manager
        self.policy = make_scheduling_policy(kv_cache_manager, config, clock)
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.requests: dict[str, Request] = {}
        self.waiting: OrderedDict[str, Request] = OrderedDict()  # queue order: head first
        self.running: dict[str, Request] = {}  # admission order: newest last
        self._finished_req_ids: list[str] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting[request.request_id] = request
        self.policy.on_add(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = []
        budget = self.max_num_batched_tokens
        kv = self.kv_cache_manager
        reserve, short = self._reserve_for_short_waiting()
        # Decodes of requests admitted after a prefill keep their token: the chunk leaves it to them.
        decodes = sum(r.num_tokens - r.num_computed_tokens == 1 for r in self.running.values())

        for request in list(self.running.values()):
            if budget <= 0 or request.status != RequestStatus.RUNNING:
                break  # out of budget, or preempted below (and so is everything after it)
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining == 1:
                decodes -= 1
                num_new = 1
            else:  # what the reserve (not for a short prefill: it is one) and the decodes leave, but
                # at least half of the budget it finds: every prefill progresses in every step
                left = budget - decodes - (0 if remaining <= short else reserve)
                num_new = min(remaining, max(left, budget // 2, 1))
            while kv.allocate_slots(request, num_new) is None:
                if kv.is_hybrid and num_new > 1 and remaining > 1:  # a smaller chunk first (see _admit)
                    num_new //= 2
                    continue
                victim = self._preempt_newest()
                out.preempted_req_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.seqs.append(self._make_seq(request, num_new))
                budget -= num_new

        if not out.preempted_req_ids:
            self._admit_waiting(out, budget)
        out.copy_ops = list(kv.pending_copy_ops)
        out.load_ops = list(kv.pending_load_ops)
        return out

    def _reserve_for_short_waiting(self) -> tuple[int, int]:
        """Tokens of this step that running prefills leave to the short requests waiting first (the
        lowest ``priority``, in arrival order, up to the first longer one or one without a seat):
        their prompt tokens, at most ``long_prefill_token_threshold`` together and less than half the
        step; and that limit (a prefill with no more left is itself short: no reserve for it).
        ``(0, limit)`` when none waits or fits a seat; ``(0, 0)`` when the threshold is 0."""
        limit = min(self.long_prefill_token_threshold, (self.max_num_batched_tokens - 1) // 2)
        if limit <= 0 or not self.waiting:
            return 0, max(limit, 0)
        first = min(r.priority for r in self.waiting.values())
        seats = len(self.running) + sum(len(r.fork_params) for r in self.running.values())
        reserve = 0
        for request in self.waiting.values():  # _admit_waiting's seat rule
            if request.priority != first:
                continue
            seats += 1 + len(request.fork_params)
            if reserve + request.num_tokens > limit or seats > self.max_num_seqs:
                break
            reserve += request.num_tokens
        return reserve, limit

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admits waiting requests in the policy's order while budget, seats and the pool allow."""
        # Seats: a request with n samples will run as n sequences once its prompt is done.
        seats = len(self.running) + sum(len(r.fork_params) for r in self.running.values())
        admitted = []
        for request in self.policy.order(self.waiting) if self.waiting else ():
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            need = 1 + len(request.fork_params)
            if self.running and seats + need > self.max_num_seqs:  # (alone, it may exceed)
                break
            admission = self._admit(request, budget)
            if admission is None:
                break
            seats += need
            self.policy.on_admit(request, self.waiting)
            admitted.append(request)
            request.status = RequestStatus.RUNNING
            self.running[request.request_id] = request
            if request.sampling_params.prompt_logprobs is not None:
                self._take_cached_prompt_logprobs(request, admission.num_hit_tokens)
            out.seqs.append(self._make_seq(request, admission.num_new_tokens))
            budget -= admission.num_new_tokens
        for request in admitted:
            del self.waiting[request.request_id]
            self.policy.on_remove(request)

    def _admit(self, request: Request, budget: int):
        """``kv.admit(request, budget)``; with several KV-cache groups, on failure again with half
        the budget, down to one token. Every group allocates a prefill chunk's blocks before the
        sliding groups release what their window left behind (after the step), so a long prompt in
        one chunk can need the pool several times over while it fits in smaller chunks; with one
        group a smaller chunk never fits where a larger one did not (the hit is the same).

        Returns:
            The :class:`~prefixcache.cache.kv_cache_manager.Admission`, or None (nothing changed).
        """
        kv = self.kv_cache_manager
        admission = kv.admit(request, budget)
        while admission is None and kv.is_hybrid and budget > 1:
            budget //= 2
            admission = kv.admit(request, budget)
        return admission

    def _take_cached_prompt_logprobs(self, request: Request, num_hit_tokens: int) -> None:
        """Fills a prompt-logprobs request's entries from its cache-hit blocks (each has them:
        :meth:`KVCacheManager.admit` stops its hits at the first block without)."""
        kv = self.kv_cache_manager
        if request.prompt_logprobs is None:
            request.prompt_logprobs = PromptLogprobsState(request.num_prompt_tokens, kv.block_size)
        for i, block in enumerate(kv.get_blocks(request.request_id)[: num_hit_tokens // kv.block_size]):
            request.prompt_logprobs.add_cached_block(i, block.prompt_logprobs)

    def store_prompt_logprobs(self, chunks: dict[str, PromptLogprobsChunk]) -> None:
        """Records the step's computed prompt logprobs on their requests, and on each prompt block
        they complete, so that later requests are served them from the cache."""
        for request_id, chunk in chunks.items():
            request = self.requests.get(request_id)
            if request is None or request.prompt_logprobs is None:
                continue
            request.prompt_logprobs.add_chunk(chunk)
            for block_index in chunk.block_hidden:
                data = request.prompt_logprobs.block_entries(block_index)
                if data is not None:
                    self.kv_cache_manager.store_prompt_logprobs(request, block_index, data)

    def _make_seq(self, request: Request, num_new: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        completes = start + num_new == request.num_tokens
        forks = []
        if completes and request.fork_params:
            forks = [
                (sample_request_id(request.group_id, i), params)
                for i, params in enumerate(request.fork_params, start=1)
            ]
        kv = self.kv_cache_manager
        group_block_ids = kv.get_group_block_ids(request.request_id) if kv.is_hybrid else None
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new],
            num_computed_tokens=start,
            block_ids=group_block_ids[0] if group_block_ids else kv.get_block_ids(request.request_id),
            group_block_ids=group_block_ids,
            sampling_params=request.sampling_params if completes else None,
            lora=request.lora,
            forks=forks,
            num_prompt_tokens=request.num_prompt_tokens,
            prompt_logprobs=None if request.prompt_logprobs is None else request.prompt_logprobs.work(
                start, start + num_new, request.all_token_ids),
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
        )

    def _preempt_newest(self) -> Request:
        """Frees the newest running request's blocks and puts it back at the queue's head."""
        _, request = self.running.popitem()
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting[request.request_id] = request
        self.waiting.move_to_end(request.request_id, last=False)
        self.policy.on_add(request)
        return request

    def update_from_output(self, scheduler_output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advances computed counts and appends sampled tokens.

        Args:
            scheduler_output: the step that ran.
            sampled: request id → sampled token id, for requests that sampled.

        Returns:
            The requests that received a new token (the caller checks their stop conditions).
        """
        kv = self.kv_cache_manager
        kv.end_step()  # the step's K/V is written: unpin partial-hit sources
        updated = []
        for seq in scheduler_output.seqs:
            request = self.requests[seq.request_id]
            request.num_computed_tokens += len(seq.token_ids)
            if kv.is_hybrid:  # sliding-window blocks no query of it reads again
                kv.remove_skipped_blocks(request)
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
            self.running[child_id] = child
            children.append(child)
        request.fork_params = []
        return children

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request (stop, length, abort or error) and frees its blocks; unknown ids → None."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.running.pop(request_id, None)
        if self.waiting.pop(request_id, None) is not None:
            self.policy.on_remove(request)
        request.status = status
        self.kv_cache_manager.free(request)
        self._finished_req_ids.append(request_id)
        return request
