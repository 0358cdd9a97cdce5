"""The engine: add requests, step (schedule → run model → postprocess), collect outputs.

``LLMEngine`` wires the parts and keeps ``step()`` short (vLLM v1's split):

- :class:`~prefixcache.engine.input_processor.InputProcessor`: validation, tokenization, cache keys;
- :class:`~prefixcache.engine.scheduler.Scheduler` over the
  :class:`~prefixcache.cache.kv_cache_manager.KVCacheManager`: what runs each step;
- :class:`~prefixcache.runner.model_runner.ModelRunner`: the forward pass and sampling;
- :class:`~prefixcache.engine.output_processor.OutputProcessor`: stop conditions, text, outputs;
- :class:`~prefixcache.engine.lora_manager.LoRAManager` and
  :class:`~prefixcache.engine.parallel_sampling.SampleGroups`: adapters and ``n > 1`` samples.

A step that raises fails only its own requests (finish_reason ``"error"``): the blocks cached in
that step are dropped from the cache (their K/V was never written, or only partly), the requests'
blocks are freed, and the engine goes on serving the others. A request whose sampling failed in a
step that ran (its grammar, ``ModelRunnerOutput.failed``) finishes with ``"error"`` alone; the
step's K/V and the other requests' tokens stand.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from prefixcache.cache.config import check_int
from prefixcache.cache.kv_cache_manager import KVCacheManager
from prefixcache.cache.kv_events import MEDIUM_CPU, MEDIUM_GPU, KVEventRecorder
from prefixcache.cache.metrics import PrefixCacheSnapshot
from prefixcache.cache.pins import CacheBreakpoint, check_breakpoints
from prefixcache.cache.tiers.stack import make_kv_tiers
from prefixcache.config import DEFAULT_KV_CACHE_MEMORY_BYTES, INT4_DECODER_FORMATS, EngineConfig
from prefixcache.engine.input_processor import InputProcessor, ProcessedPrompt
from prefixcache.engine.lora_manager import LoRAManager
from prefixcache.engine.output_processor import OutputProcessor
from prefixcache.engine.parallel_sampling import SampleGroups
from prefixcache.engine.scheduler import Scheduler
from prefixcache.errors import InvalidInputError
from prefixcache.host_memory import pool_memory_limit
from prefixcache.layers.lora import LoRARequest
from prefixcache.layers.sampler import TokenLogprobs
from prefixcache.models.loader import LoadedModel, load_model
from prefixcache.outputs import RequestOutput
from prefixcache.request import Request, RequestStatus
from prefixcache.runner.kv_pool import (kv_block_layout, kv_cache_bytes_per_block, kv_cache_groups_of,
                                        num_blocks_for_memory)
from prefixcache.runner.model_runner import ModelRunner, ModelRunnerOutput
from prefixcache.sampling_params import SamplingParams
from prefixcache.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from prefixcache.cache.block import KVCacheBlock
    from prefixcache.engine.kv_event_publisher import ZmqEventPublisher


@dataclass(frozen=True)
class EngineMetrics(PrefixCacheSnapshot):
    """A snapshot of the engine's counters: the cache's (tokens in tokens, blocks in blocks) plus
    the engine's own."""

    prompt_tokens_computed: int = 0  # prompt tokens run through the model (recomputes included)
    num_preemptions: int = 0
    # Per KV tier (by name): its counters, see prefixcache/cache/tiers/stack.py. Its hits are part of
    # prefix_cache_hits (prefix_cache_tier_hits is their sum), as they are of num_cached_tokens.
    kv_tiers: dict[str, dict] = field(default_factory=dict)


def _serialized(method: Callable) -> Callable:
    """Runs ``method`` holding the engine's lock: one thread at a time changes the engine's state
    (the offline API may be called from several threads: a ``reset_prefix_cache`` from another
    thread landed inside a step's frees and broke the pool for good; the server's engine thread
    never waits on it)."""
    @functools.wraps(method)
    def run(self: LLMEngine, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


class LLMEngine:
    """Continuous-batching engine over a paged KV pool with automatic prefix caching.

    Thread-safe: every method that changes state (adding, aborting, stepping, resetting, loading
    weights, approving prefixes, taking metrics) holds one lock, so calls from several threads run
    one after another, never inside each other.

    Args:
        config: validated engine options.
        loaded: an already loaded model (tests reuse one); loaded from ``config.model`` if None.

    Raises:
        ValueError: bad options; ``ModelLoadError`` (a ValueError) when the model can't be loaded.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        config.validate()
        self.config = config
        self._lock = threading.RLock()
        self.device = _resolve_device(config.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.resolved_num_threads())
        # its own model: each weight held once (the float copies its format doesn't read are released)
        self.loaded = loaded or load_model(config.model, dtype=config.torch_dtype, device=self.device,
                                           quantization=config.quantization, keep_float_weights=False,
                                           attention_dtype=config.attention_dtype)
        if self.loaded.quantization != config.quantization:
            raise InvalidInputError("quantization", f"quantization={config.quantization!r} but the given model "
                                                    f"was loaded with {self.loaded.quantization!r}")
        if self.loaded.model.attention_dtype != config.attention_dtype:
            raise InvalidInputError("attention_dtype", f"attention_dtype={config.attention_dtype!r} but the given "
                                                       f"model was loaded with {self.loaded.model.attention_dtype!r}")
        if config.max_model_len is not None and config.max_model_len > self.loaded.max_model_len:
            raise InvalidInputError("max_model_len", f"max_model_len {config.max_model_len} is more than the model's "
                                                     f"context of {self.loaded.max_model_len} tokens (its "
                                                     "max_position_embeddings); positions beyond it were never trained")
        self.loaded.users.add(self)
        self.tokenizer = self.loaded.tokenizer
        mcfg = self.loaded.config
        self.max_model_len = config.max_model_len or self.loaded.max_model_len
        # One block holds the K/V of one KV-cache group's layers (every layer for the Llama family).
        self.kv_cache_groups = kv_cache_groups_of(self.loaded.model, mcfg)
        layers_per_block = self.kv_cache_groups.layers_per_group
        self.kv_cache_bytes_per_block = kv_cache_bytes_per_block(
            layers_per_block, config.block_size, mcfg.num_key_value_heads, mcfg.head_dim, self.loaded.dtype
        )
        self.num_blocks = config.num_blocks or num_blocks_for_memory(
            config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES, layers_per_block,
            config.block_size, mcfg.num_key_value_heads, mcfg.head_dim, self.loaded.dtype,
        )
        self._check_pool_fits()
        # A tier entry holds one pool block: every layer with one group, one group's layers otherwise
        # (each group's entries keyed apart, see prefixcache/cache/tiers/stack.py).
        self.kv_tiers = make_kv_tiers(config, kv_block_layout(
            layers_per_block, config.block_size, mcfg.num_key_value_heads, mcfg.head_dim, self.loaded.dtype))
        self.kv_cache_manager = KVCacheManager(self.num_blocks, config, bytes_per_block=self.kv_cache_bytes_per_block,
                                               tiers=self.kv_tiers, kv_cache_groups=self.kv_cache_groups)
        self.scheduler = Scheduler(self.kv_cache_manager, config)
        self.runner = ModelRunner(self.loaded, self.num_blocks, config.block_size, self.device, config.seed,
                                  self.kv_cache_groups)
        # held back from one request's full-attention context, which the input checks size max_tokens against, so
        # that a request that passes them always runs to the end instead of waiting for room forever
        held = self.kv_cache_groups.sliding_blocks_held(config.block_size)
        self.input_processor = InputProcessor(config, self.loaded, self.max_model_len, self.num_blocks - held, held)
        self.output_processor = OutputProcessor(self.tokenizer, self.loaded.eos_token_ids, self.max_model_len)
        self.lora_manager = LoRAManager(self.loaded.model, self.kv_cache_manager)
        self.sample_groups = SampleGroups()
        self._weights_fingerprint = self.loaded.fingerprint
        self._counter = itertools.count()
        # Called with each request as it finishes, before its blocks are freed (the dashboard's
        # CacheInsight); on the engine thread, so a hook must be quick and must not raise.
        self.finish_hooks: list[Callable[[Request], None]] = []
        self.kv_event_recorder, self.kv_event_publisher = self._start_kv_events()

    def _check_pool_fits(self) -> None:
        """Refuses, before anything is allocated, a block larger than the model's context and a KV
        pool larger than the memory it goes to (the command line checks the same before the load:
        ``entrypoints/cli/preflight.py``).

        Raises:
            InvalidInputError: ``block_size``, or ``num_blocks`` / ``kv_cache_memory``.
        """
        config, context = self.config, self.loaded.max_model_len
        if config.block_size > context:
            raise InvalidInputError("block_size", f"block_size {config.block_size} is more than the model's context "
                                                  f"of {context} tokens (its max_position_embeddings): such a block "
                                                  "never fills")
        too_small = self.kv_cache_groups.pool_too_small(self.num_blocks, config.block_size)
        if too_small is not None:
            field = "num_blocks" if config.num_blocks else "kv_cache_memory"
            raise InvalidInputError(field, f"{field}: {too_small}")
        need = self.num_blocks * self.kv_cache_bytes_per_block
        limit = pool_memory_limit(str(self.device), need)
        if limit is not None:
            field = "num_blocks" if config.num_blocks else "kv_cache_memory"
            raise InvalidInputError(field, f"{field}: a KV pool of {self.num_blocks} blocks of {config.block_size} "
                                           f"tokens needs {need} bytes ({self.kv_cache_bytes_per_block} per block), "
                                           f"more than the {limit[0]} bytes of {limit[1]}")

    @property
    def cache_fingerprint(self) -> bytes:
        """The cache key's model part (weights fingerprint and dtype)."""
        return self.input_processor.model_key

    # ------------------------------------------------------------------ requests
    @_serialized
    def add_request(
        self,
        prompt: str | list[int] | ProcessedPrompt,
        sampling_params: SamplingParams | None = None,
        cache_salt: str | None = None,
        request_id: str | None = None,
        stream: bool = False,
        lora: LoRARequest | None = None,
        tenant: str | None = None,
        priority: int = 0,
        cache_control: CacheBreakpoint | Sequence[CacheBreakpoint] | None = None,
        retain_s: float | None = None,
    ) -> str:
        """Validates and queues a request.

        Args:
            prompt: text (tokenized with the model's tokenizer), token ids, or an already
                tokenized :class:`ProcessedPrompt` (the async engine tokenizes off this thread).
            sampling_params: defaults to ``SamplingParams()``.
            cache_salt: isolates this request's cache entries; equal salts share.
            request_id: defaults to a fresh counter value.
            stream: have :meth:`step` report this request's progress after every token.
            lora: a LoRA adapter to apply (loaded on first use, reloaded when its files change).
            tenant: the request's tenant namespace: its blocks are shared only within the tenant,
                except full blocks inside an approved shared prefix (:meth:`add_approved_prefix`),
                which every tenant shares unless the request has a ``cache_salt``. ``None``: no
                namespace.
            priority: scheduling priority, an int, lower = earlier (vLLM's ``priority``): the
                outer key of the waiting queue's order, whatever ``scheduling_policy``.
            cache_control: cache breakpoints: each prefix is pinned in the pool for its ttl once
                the prompt is computed, refreshed on every hit, within ``max_pinned_fraction`` of
                the pool (:mod:`prefixcache.cache.pins`); the output's ``pinned`` says what each got.
            retain_s: keep the prompt's full blocks in the disk tier for this many seconds once it
                is computed, out of the tier's size-cap eviction, within ``max_retained_disk_fraction``
                of it (OpenAI's ``prompt_cache_retention: "24h"``); the output's
                ``num_retained_tokens`` says how much was kept. Needs ``kv_disk_dir``.

        Returns:
            The request id.

        Raises:
            InvalidInputError: naming the field: empty/oversized prompt, token id outside the
                vocabulary, prompt + max_tokens beyond the context or the KV pool, bad cache_salt,
                tenant or adapter (or any adapter with quantization 'int4' or 'int4-int8'), duplicate request_id, a ``structured_outputs`` schema or regex
                that doesn't compile, a priority that is not a 64-bit int, a ``retain_s`` that
                is not a finite number > 0 or without a disk tier that retains.
        """
        check_int("priority", priority, -(2**63), 2**63 - 1)
        params = self.input_processor.check_request(sampling_params, cache_salt, tenant)
        self.runner.structured_output.compile(params.structured_outputs)  # a bad schema fails here, not in a step
        prompt = self.input_processor.tokenize(prompt)
        self.input_processor.check_fits(len(prompt.token_ids), params)
        breakpoints = () if cache_control is None else check_breakpoints(cache_control, len(prompt.token_ids))
        if retain_s is not None:
            self._check_retain(retain_s)
        if lora is not None and self.runner.model.quantization in INT4_DECODER_FORMATS:
            raise InvalidInputError("lora", f"lora: adapters need quantization 'none' or 'int8'; "
                                            f"{self.runner.model.quantization!r} runs generated tokens in fused "
                                            f"kernels without LoRA deltas")
        adapter = self.lora_manager.get(lora) if lora is not None else None
        if adapter is not None and self.kv_event_recorder is not None:
            self.kv_event_recorder.note_adapter(adapter.digest, adapter.name)
        if request_id is None:
            request_id = self._fresh_request_id(params.n)
        _check_request_id(request_id)
        used = self._sample_id_in_use(request_id, params.n)
        if used is not None:
            raise InvalidInputError("request_id", f"request_id {used!r} is already in use")
        self._follow_weights()
        request = self.input_processor.make_request(request_id, prompt, params, cache_salt, adapter, tenant, stream)
        request.priority = priority
        request.cache_breakpoints = breakpoints
        request.retain_s = retain_s
        self.sample_groups.add(request_id, params.n)
        self.scheduler.add_request(request)
        return request_id

    def _check_retain(self, retain_s: object) -> None:
        """Raises :class:`InvalidInputError` (``retain_s``) unless ``retain_s`` is a finite number
        > 0 and a tier retains (a disk tier with a retention budget)."""
        if isinstance(retain_s, bool) or not isinstance(retain_s, (int, float)) or not 0 < retain_s < math.inf:
            raise InvalidInputError("retain_s", f"retain_s must be a finite number > 0, got {retain_s!r}")
        if self.kv_tiers is None or not self.kv_tiers.retaining_tiers:
            raise InvalidInputError("retain_s", "retain_s keeps a prompt in the disk tier: it needs kv_disk_dir "
                                                "and max_retained_disk_fraction > 0")

    def _retain(self, request: Request) -> None:
        """Keeps the computed prompt's full blocks in the disk tier for ``request.retain_s``
        (:meth:`KVTierStack.retain`), storing again the ones it no longer holds; sets
        ``request.num_retained_tokens``.

        With several KV-cache groups a tier hit needs what the pool hit needs (the hit rule of
        :mod:`prefixcache.cache.kv_cache_manager`): every block of ``[0, L)`` in a full group, the
        window's blocks before ``L`` in a sliding one. So each group keeps its part for the end
        ``L`` group 0 kept; a full group that kept less lowers ``L``, and a sliding group that
        can't keep its whole window there leaves no retained hit (0 tokens: nothing promised)."""
        manager, block_size = self.kv_cache_manager, self.config.block_size
        blocks = manager.get_blocks(request.request_id)
        num_blocks = min(request.num_prompt_tokens // block_size, len(blocks),
                         manager.req_to_num_cached_blocks.get(request.request_id, 0))
        # every group retains blocks before num_blocks: their keys share one chain of prefix digests
        digests = self.kv_tiers.prefix_digests(request, num_blocks)
        end = self._retain_group(request, 0, 0, num_blocks, blocks, digests)
        tables = manager.req_to_group_blocks.get(request.request_id, [])
        for group, table in zip(self.kv_cache_groups.groups[1:], tables):
            need = group.num_window_blocks(block_size)
            start = 0 if need is None else max(0, end - need)
            kept = self._retain_group(request, group.group_id, start, end, table, digests)
            end = kept if need is None else (end if kept == end else 0)
        request.num_retained_tokens = end * block_size

    def _retain_group(self, request: Request, group_id: int, start: int, stop: int,
                      table: list[KVCacheBlock | None], digests: Sequence[bytes]) -> int:
        """Retains group ``group_id``'s entries of blocks ``[start, stop)`` and stores again the ones
        no retaining tier holds, from the request's blocks in ``table``; returns the end kept (a
        block the request no longer holds, released by a sliding group, can't be stored again and
        ends it). ``digests``: the request's prefix digests of at least ``stop`` blocks
        (:meth:`KVTierStack.prefix_digests`)."""
        end, missing = self.kv_tiers.retain(request, stop, request.retain_s, group_id, start, digests)
        lost = [i for i in missing if i >= len(table) or table[i] is None]
        if lost:
            end, missing = lost[0], [i for i in missing if i < lost[0]]
        if missing:
            keys = self.kv_tiers.entry_keys(request, start, end, group_id, digests)
            payloads = self.runner.read_blocks([table[i].block_id for i in missing])
            self.kv_tiers.submit([(keys[i - start], p) for i, p in zip(missing, payloads)],
                                 self.kv_tiers.retaining_tiers)
        return end

    def _sample_id_in_use(self, request_id: str, n: int) -> str | None:
        """The first of ``request_id``'s ``n`` sample ids a request already uses, or None."""
        return next((rid for rid in self.sample_groups.sample_ids(request_id, n)
                     if rid in self.scheduler.requests or self.sample_groups.is_reserved(rid)), None)

    def _fresh_request_id(self, n: int) -> str:
        """The counter's next value whose sample ids no request uses (a caller may have chosen "1")."""
        while True:
            request_id = str(next(self._counter))
            if self._sample_id_in_use(request_id, n) is None:
                return request_id

    def root_key(self, cache_salt: str | None = None, adapter=None) -> bytes:
        """The cache-key root of a request: model fingerprint, dtype, hash seed, cache_salt, adapter."""
        return self.input_processor.root_key(cache_salt, adapter)

    @_serialized
    def add_approved_prefix(self, prompt: str | list[int]) -> int:
        """Declares a public prefix every tenant may share; returns its length in tokens."""
        return self.input_processor.add_approved_prefix(prompt)

    @_serialized
    def add_approved_system_prompt(self, content: str) -> int:
        """Approves a chat system message every tenant may share; returns its length in tokens."""
        return self.input_processor.add_approved_system_prompt(content)

    def apply_chat_template(self, conversation: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Renders one conversation with the model's chat template → prompt token ids."""
        return self.input_processor.apply_chat_template(conversation, add_generation_prompt)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a request (all samples of an ``n > 1`` request) and frees its blocks.

        Returns:
            The aborted request's output (its first unfinished sample's), or None for unknown or
            finished ids.
        """
        outputs = self.abort_request_samples(request_id)
        return outputs[0] if outputs else None

    @_serialized
    def abort_request_samples(self, request_id: str) -> list[RequestOutput]:
        """Like :meth:`abort_request`, returning the output of every sample it stopped.

        ``request_id`` is the id given to :meth:`add_request`; an engine-internal sample id
        (``"id#i"``) stops that sample only, and only once it exists.

        Raises:
            InvalidInputError: ``request_id`` is not a non-empty string.
        """
        _check_request_id(request_id)
        stopped = [self.scheduler.requests.get(rid) for rid in self.sample_groups.members(request_id)]
        return self._finish([r for r in stopped if r is not None], RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ step
    @_serialized
    def step(self) -> list[RequestOutput]:
        """Runs one engine step (then publishes its KV events, when on).

        Returns:
            Outputs of the requests that finished in this step, and (with ``finished=False``) of
            streaming requests that got a token and go on. If the forward pass or sampling raised,
            the outputs of the step's requests, finished with ``"error"``.
        """
        try:
            return self._step()
        finally:
            if self.kv_event_publisher is not None:
                self.publish_kv_events()

    def _step(self) -> list[RequestOutput]:
        self.kv_cache_manager.sweep_expired()
        scheduler_output = self.scheduler.schedule()
        start = time.perf_counter()
        try:
            runner_output = self.runner.execute_model(scheduler_output)
        except BaseException as e:
            outputs = self._fail_step(scheduler_output, e)
            if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: cleaned up, then go
                raise
            return outputs
        if self.kv_tiers is not None:  # what computing costs, for the tiers' load-or-recompute rule
            self.kv_tiers.observe_compute(time.perf_counter() - start, sum(len(s.token_ids) for s in scheduler_output.seqs))
        self._store_to_tiers()
        sampled, failed = self._drop_failed(scheduler_output, runner_output)
        updated = self.scheduler.update_from_output(scheduler_output, sampled)
        self.scheduler.store_prompt_logprobs(runner_output.prompt_logprobs)
        outputs = self._postprocess(updated, runner_output.logprobs)
        for request_id, message in failed.items():
            self.scheduler.requests[request_id].error = message
        return outputs + self._finish([self.scheduler.requests[rid] for rid in failed], RequestStatus.FINISHED_ERROR)

    @staticmethod
    def _drop_failed(scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> tuple[dict[str, int], dict[str, str]]:
        """The step's sampled tokens without those of requests whose sampling failed, and those
        requests (id → why). A failed fork's parent fails with it (its samples are created from
        its token, which is dropped: the group ends with ``"error"``)."""
        if not runner_output.failed:
            return runner_output.sampled_token_ids, {}
        failed: dict[str, str] = {}
        for seq in scheduler_output.seqs:
            ids = [seq.request_id] + [fork_id for fork_id, _ in seq.forks]
            message = next((runner_output.failed[i] for i in ids if i in runner_output.failed), None)
            if message is not None:
                failed[seq.request_id] = message
        dropped = set(failed) | {f for s in scheduler_output.seqs if s.request_id in failed for f, _ in s.forks}
        return {rid: t for rid, t in runner_output.sampled_token_ids.items() if rid not in dropped}, failed

    def _store_to_tiers(self) -> None:
        """Hands the K/V of the blocks this step computed to the KV tiers' writer (write-through)."""
        if self.kv_tiers is None:
            return
        stores = self.kv_cache_manager.take_tier_stores()
        if stores:
            payloads = self.runner.read_blocks([block_id for block_id, _ in stores])
            self.kv_tiers.submit([(key, payload) for (_, key), payload in zip(stores, payloads)])

    def _start_kv_events(self) -> tuple[KVEventRecorder | None, ZmqEventPublisher | None]:
        """The KV event recorder (attached to the block pool) and publisher; ``(None, None)`` when
        ``kv_events_config`` is off."""
        events = self.config.kv_events_config
        if events is None or not events.enabled:
            return None, None
        import zmq

        from prefixcache.engine.kv_event_publisher import ZmqEventPublisher  # zmq only when on

        medium = MEDIUM_GPU if self.device.type == "cuda" else MEDIUM_CPU
        recorder = KVEventRecorder(self.config.block_size, medium)
        try:
            publisher = ZmqEventPublisher(events)
        except zmq.ZMQError as e:
            raise InvalidInputError("kv_events_config", f"kv_events_config: cannot open {events.endpoint!r} "
                                                        f"/ {events.replay_endpoint!r}: {e}") from e
        self.kv_cache_manager.block_pool.kv_events = recorder
        return recorder, publisher

    def publish_kv_events(self) -> None:
        """Hands the cache events recorded since the last call to the publisher, as one batch
        (after every step, reset and metrics sweep; nothing when events are off or none happened)."""
        if self.kv_event_publisher is not None:
            batch = self.kv_event_recorder.take_batch()
            if batch is not None:
                self.kv_event_publisher.publish(batch)

    @_serialized
    def close(self) -> None:
        """Stores the blocks still queued for the KV tiers and closes them; publishes the last KV
        events and stops their publisher."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()
        if self.kv_event_publisher is not None:
            self.publish_kv_events()
            self.kv_event_publisher.close()
            self.kv_cache_manager.block_pool.kv_events = None
            self.kv_event_recorder = self.kv_event_publisher = None

    def _postprocess(self, updated: list[Request], logprobs: Mapping[str, TokenLogprobs]) -> list[RequestOutput]:
        """Logprobs, stop checks and outputs for the requests that got a token this step."""
        now = time.monotonic()
        outputs, finished = [], []
        for request in updated:
            if request.first_token_s is None:
                request.first_token_s = now
                if request.cache_breakpoints:  # the prompt is computed: pin its breakpoints' prefixes
                    self.kv_cache_manager.pin_prefix(request)
                if request.retain_s is not None and self.kv_tiers is not None:  # and keep it on disk
                    self._retain(request)
            if request.request_id in logprobs:
                self.output_processor.append_logprobs(request, logprobs[request.request_id])
            status = self.output_processor.check_stop(request)
            if status is not None:
                finished.append((request, status))
            elif request.stream:
                outputs.append(self.output_processor.make_output(request))
        for request, status in finished:
            outputs += self._finish([request], status, now)
        return outputs

    def _fail_step(self, scheduler_output: SchedulerOutput, error: BaseException) -> list[RequestOutput]:
        """Fails the step's requests (see :meth:`_fail`)."""
        return self._fail([s.request_id for s in scheduler_output.seqs], f"engine step failed: {error!r}")

    @_serialized
    def fail_all_requests(self, message: str) -> list[RequestOutput]:
        """Fails every request in flight (see :meth:`_fail`); after an unexpected fault, to start
        clean."""
        return self._fail(list(self.scheduler.requests), message)

    def _fail(self, request_ids: list[str], message: str) -> list[RequestOutput]:
        """Drops the blocks cached in the interrupted step (their K/V was never written, or only
        partly), then finishes the requests with ``"error"`` (``message`` in their outputs) and frees
        their blocks."""
        self.kv_cache_manager.forget_step()
        failed = [self.scheduler.requests[rid] for rid in request_ids if rid in self.scheduler.requests]
        for request in failed:
            request.error = message
        return self._finish(failed, RequestStatus.FINISHED_ERROR)

    def _finish(self, requests: list[Request], status: RequestStatus, now: float | None = None) -> list[RequestOutput]:
        """Ends requests with ``status``, frees their blocks; returns their final outputs."""
        now = time.monotonic() if now is None else now
        outputs = []
        for request in requests:
            for hook in self.finish_hooks:
                hook(request)
            self.scheduler.finish_request(request.request_id, status)
            self.sample_groups.finish(request)
            request.finish_s = now
            outputs.append(self.output_processor.make_output(request))
        return outputs

    # ------------------------------------------------------------------ cache control
    @_serialized
    def load_weights(self, weights: str | Path | Mapping[str, torch.Tensor]) -> None:
        """Replaces model weights in place; no request ever reads K/V of the old weights.

        The weights' fingerprint (the cache key's model part) is re-derived from the new content,
        so every engine sharing this model keys new requests apart from the old blocks; this
        engine's cached blocks are dropped at once (the others' when they next take a request).

        Args:
            weights: an HF model directory with *.safetensors of the same architecture, or a
                mapping ``parameter name -> tensor`` (a partial update is fine).

        Raises:
            ValueError: requests are still running or waiting in an engine sharing the model (finish
                or abort them first), an unknown parameter name, a value that is not a floating-point
                tensor with data, a shape mismatch, or a NaN / infinite value (a mapping is checked
                whole before anything is copied).
        """
        if any(engine.has_unfinished_requests() for engine in list(self.loaded.users)):
            raise ValueError("load_weights: requests are still in flight; wait for them or abort them first")
        try:
            self.loaded.replace_weights(weights)
        finally:  # re-keyed even if the copy failed half-way
            self._follow_weights()
            self.publish_kv_events()  # the dropped blocks' BlockRemoved, now (as reset_prefix_cache)

    def _follow_weights(self) -> None:
        """Drops this engine's cached blocks once the shared model's weights changed."""
        if self._weights_fingerprint != self.loaded.fingerprint:
            if not self.kv_cache_manager.reset_prefix_cache():  # blocks in use: evict the rest now
                self.kv_cache_manager.invalidate_chains(lambda root_key: True)
            self._weights_fingerprint = self.loaded.fingerprint

    @_serialized
    def reset_prefix_cache(self) -> bool:
        """Drops every cached block; refused (False) while any request holds blocks."""
        done = self.kv_cache_manager.reset_prefix_cache()
        self.publish_kv_events()
        return done

    @_serialized
    def get_metrics(self) -> EngineMetrics:
        """The engine's counters now (expired blocks swept first, so the cache numbers are live)."""
        kv = self.kv_cache_manager
        kv.sweep_expired()
        self.publish_kv_events()
        snapshot = kv.make_snapshot()
        return EngineMetrics(
            **{f: getattr(snapshot, f) for f in snapshot.__dataclass_fields__},
            prompt_tokens_computed=self.runner.num_prompt_tokens_computed,
            num_preemptions=self.scheduler.num_preemptions,
            kv_tiers=self.kv_tiers.snapshot() if self.kv_tiers is not None else {},
        )


def _check_request_id(request_id: object) -> None:
    """Raises InvalidInputError (``request_id``) unless ``request_id`` is a non-empty str."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidInputError("request_id", f"request_id must be a non-empty string, got {request_id!r:.60}")


def _resolve_device(name: str | None) -> torch.device:
    """``name`` as a torch device (default: CUDA when present).

    Raises:
        InvalidInputError: (field ``device``) unknown, or CUDA asked for without CUDA.
    """
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise InvalidInputError("device", f"device must be a torch device name such as 'cpu' or 'cuda', "
                                          f"got {name!r}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError("device", f"device {name!r}: CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise InvalidInputError("device", f"device must be 'cpu' or 'cuda[:N]', got {name!r}")
    return device
