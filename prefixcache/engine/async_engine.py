"""Asyncio front of :class:`LLMEngine`: one background loop steps the engine for all requests.

The engine is not thread-safe, so every engine call (add, abort, step, metrics, reset) runs on one
dedicated thread, a single-worker executor; calls queue there in order and run between steps. The
event loop never touches engine state, it only routes each step's outputs to per-request queues.
Tokenization and chat templates run on a second thread with its own copy of the tokenizer,
so a huge prompt never stalls the steps that stream other clients' tokens::

    HTTP handlers ──tokenize──▶ [input thread: tokenize | render template ...]
          │
          └──add/abort──▶ [engine thread: add | step | step | abort | step ...]
         ▲                                         │
         └──── per-request asyncio.Queue ◀──outputs┘   (dispatched on the event loop)

Many concurrent requests are thus batched by the scheduler, never served one at a time.

A step that fails fails only its own requests (the engine says so in their outputs). If the
engine raises anywhere else, every request in flight is failed and the engine is reset (queues
emptied, prefix cache dropped); it goes on serving. Only if that recovery fails is the engine
dead (:attr:`error` set, every call raises :class:`EngineDeadError`, ``/health`` says 503).

Requests added together (:meth:`AsyncLLMEngine.generate_batch`: the prompts of one completion
request) are added in one call on the engine thread, all or none, and share one queue and one
stream, so their outputs arrive in the order the engine made them.

Invariants:
- a request id is in ``_queues`` from just before its add is submitted until its stream ends;
- a stream that ends early (client gone, task cancelled, a sample failed) submits an abort of each
  of its requests, which frees their blocks;
- a request id is in ``_unfinished`` until ``on_finish`` has heard its last sample: an abort's
  outputs reach the event loop after those of every step that ran before it on the engine thread,
  so a sample the step in flight finished still counts as one of the request's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from prefixcache.cache.pins import CacheBreakpoint
from prefixcache.engine.input_processor import ProcessedPrompt
from prefixcache.engine.llm_engine import EngineMetrics, LLMEngine
from prefixcache.errors import InvalidInputError
from prefixcache.layers.lora import LoRARequest
from prefixcache.models.loader import return_freed_memory
from prefixcache.outputs import RequestOutput
from prefixcache.sampling_params import SamplingParams


IDLE_STATS_WAIT_S = 0.25  # get_stats' wait for fresh counters from an idle engine thread (seconds)
# When the loop goes idle after serving, at most once per this many seconds, the heap's free pages go back to the
# system (glibc's malloc_trim): steps of new batch shapes free large temporaries that glibc otherwise keeps for
# reuse, so a soaked server's resident set grew in steps though its live memory did not (tools/soak.py's check).
TRIM_INTERVAL_S = 10.0


class EngineDeadError(RuntimeError):
    """The background loop stopped on an unexpected error; the engine serves no more requests."""


@dataclass(frozen=True)
class EngineStats:
    """Engine counters plus the scheduler's queue lengths, taken together on the engine thread."""

    metrics: EngineMetrics
    num_running: int  # requests in the running batch
    num_waiting: int  # requests queued (new or preempted)


def take_stats(engine: LLMEngine) -> EngineStats:
    """The engine's counters and queue lengths, together (on the engine thread)."""
    return EngineStats(engine.get_metrics(), len(engine.scheduler.running), len(engine.scheduler.waiting))


class AsyncLLMEngine:
    """Serves many concurrent requests from one :class:`LLMEngine`.

    Args:
        engine: the engine to drive; only this object's thread may call it from now on.
        on_finish: called on the event loop as ``on_finish(out, request_done)`` once with each
            finished (or aborted) sample's output; ``request_done`` is True exactly once per request,
            with its last call (metrics hook). A failed sample ends its request: its siblings, aborted,
            come first, then it, done.

    Call :meth:`start` from the event loop that will serve requests, :meth:`shutdown` at the end.
    """

    def __init__(
        self, engine: LLMEngine, on_finish: Callable[[RequestOutput, bool], None] | None = None
    ) -> None:
        self.engine = engine
        self.on_finish = on_finish
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="prefixcache-engine", initializer=self._init_thread
        )
        self._closed = False  # shutdown closed the engine
        self._shutting_down = False  # shutdown began: no more calls on the engine thread
        # Tokenization and chat templates: one thread with its own copy of the tokenizer (the engine
        # thread detokenizes with the model's meanwhile). Template edits after this don't reach it.
        self._input_executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="prefixcache-input"
        )
        self._tokenizer = copy.deepcopy(engine.tokenizer)
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._unfinished: dict[str, int] = {}  # request id -> samples on_finish hasn't heard yet (n)
        self._failed: dict[str, RequestOutput] = {}  # request id -> its failed sample, told once its siblings are aborted
        self._counter = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._busy_since_trim, self._last_trim = False, 0.0  # return_freed_memory when the loop idles
        self.error: BaseException | None = None
        self.num_recoveries = 0  # times the engine was reset after an unexpected error
        # The most requests seen in one step (a batching check for tests and benchmarks).
        self.max_step_num_reqs = 0
        # Counters and queue lengths as of the engine thread's last step or call: what get_stats
        # answers without waiting for a running step (a multi-second prefill must not stall a scrape).
        self._stats = take_stats(engine)

    def _init_thread(self) -> None:
        if self.engine.device.type == "cpu":  # torch's thread count is per calling thread
            torch.set_num_threads(self.engine.config.resolved_num_threads())

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and self.error is None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Starts the background step loop on the running event loop (idempotent)."""
        if self._task is not None and not self._task.done():
            return
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._task = self._loop.create_task(self._run_loop(), name="prefixcache-engine-loop")

    async def shutdown(self) -> None:
        """Stops the loop, aborts what is left, closes the engine (the KV tiers' writer stores what
        it has queued) and releases the engine thread. Calls after it starts raise
        :class:`EngineDeadError` ("server is shutting down"); :meth:`get_stats` answers the last stats."""
        self._shutting_down = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for request_id in list(self._queues):
            self._queues.pop(request_id).put_nowait(EngineDeadError("server is shutting down"))
            self._executor.submit(self.engine.abort_request, request_id)
        if not self._closed:  # shutdown may run twice (a second Ctrl-C): the executor is gone then
            self._closed = True
            self._executor.submit(self.engine.close)
        self._executor.shutdown(wait=True)
        self._input_executor.shutdown(wait=True)

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self._queues:
                    if self._busy_since_trim and time.monotonic() - self._last_trim >= TRIM_INTERVAL_S:
                        await loop.run_in_executor(self._executor, return_freed_memory)
                        self._busy_since_trim, self._last_trim = False, time.monotonic()
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                self._busy_since_trim = True
                try:
                    outputs = await loop.run_in_executor(self._executor, self._step)
                except Exception as e:  # a bug outside the forward pass: fail what runs, reset
                    outputs = await loop.run_in_executor(self._executor, self._recover, e)
                for out in outputs:
                    self._dispatch(out)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # recovery failed too: fail every stream rather than hang
            self.error = e
            for queue in self._queues.values():
                queue.put_nowait(EngineDeadError(f"engine loop failed: {e!r}"))
            self._queues.clear()

    def _step(self) -> list[RequestOutput]:
        """One engine step, on the engine thread; idles briefly when nothing is scheduled."""
        engine = self.engine
        if not engine.has_unfinished_requests():
            # Every queued request finished or was aborted; the loop sleeps once its queues drain.
            time.sleep(0.001)  # an add is about to land; don't spin the thread
            return []
        outputs = self._taking_stats(engine.step)
        n = len(engine.scheduler.running) + sum(o.finished for o in outputs)
        self.max_step_num_reqs = max(self.max_step_num_reqs, n)
        return outputs

    def _taking_stats(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the engine thread, then the stats :meth:`get_stats` answers
        (also when ``fn`` raises): after every step, add, abort, reset or recovery."""
        try:
            return fn(*args, **kwargs)
        finally:
            self._stats = take_stats(self.engine)

    def _recover(self, error: Exception) -> list[RequestOutput]:
        """After an unexpected engine error: fails every request in flight, resets the prefix
        cache; on the engine thread. Raises if the engine can't be brought back (then it is dead)."""
        self.num_recoveries += 1
        return self._taking_stats(self._fail_and_reset, error)  # stats taken once, after both

    def _fail_and_reset(self, error: Exception) -> list[RequestOutput]:
        outputs = self.engine.fail_all_requests(f"engine error: {error!r}")
        if not self.engine.reset_prefix_cache():
            raise RuntimeError(f"engine recovery failed: blocks still in use after {error!r}") from error
        return outputs

    def _dispatch(self, out: RequestOutput) -> None:
        """Routes an output to its request's queue; forgets the request once it is done: every
        sample finished, or one failed (its siblings, if any still run, are aborted)."""
        queue = self._queues.get(out.request_id)
        if out.finished:
            self._finish_sample(out)
        if queue is not None:
            queue.put_nowait(out)

    def _finish_sample(self, out: RequestOutput) -> None:
        """Tells ``on_finish`` of a finished sample that a step (not an abort) output."""
        request_id = out.request_id
        left = self._unfinished.get(request_id, 1) - 1
        if request_id in self._failed:  # a sibling failed: it is told last, as the request's end
            self._unfinished[request_id] = left
            self._tell(out, False)
        elif left > 0 and out.finish_reason == "error":  # it ends its request: stop the others first
            self._queues.pop(request_id, None)
            self._unfinished[request_id] = left
            self._failed[request_id] = out
            self._submit_abort(request_id)
        elif left > 0:
            self._unfinished[request_id] = left
            self._tell(out, False)
        else:  # the request's last sample
            self._queues.pop(request_id, None)
            self._unfinished.pop(request_id, None)
            self._tell(out, True)

    def _tell(self, out: RequestOutput, request_done: bool) -> None:
        if self.on_finish is not None:
            self.on_finish(out, request_done)

    def _aborted(self, request_id: str, outs: list[RequestOutput]) -> None:
        """After an abort of ``request_id`` ran (and the outputs of the steps before it were
        dispatched): no sample of it runs any more, so the request ends here. Tells ``on_finish``
        of the samples the abort stopped, then of a failed one held back; the last is done. With
        nothing to tell, the request was done already (or never started)."""
        failed = self._failed.pop(request_id, None)
        outs = outs if failed is None else [*outs, failed]
        self._unfinished.pop(request_id, None)  # an unforked sample 0 takes its siblings with it
        for i, out in enumerate(outs):
            self._tell(out, i == len(outs) - 1)

    # ------------------------------------------------------------------ requests
    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``fn`` on the engine thread, between steps (then refreshes :meth:`get_stats`'s answer:
        an add or an abort changes the queues)."""
        self._check_alive()
        run = functools.partial(self._taking_stats, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._executor, run)

    def _check_alive(self) -> None:
        """Raises EngineDeadError once the loop has failed or shutdown has begun (the executors
        then refuse work with a bare RuntimeError)."""
        if self.error is not None:
            raise EngineDeadError(f"engine loop failed: {self.error!r}")
        if self._shutting_down:
            raise EngineDeadError("server is shutting down")

    async def _call_input(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs ``fn`` (tokenization, templates) on the input thread, beside the steps."""
        self._check_alive()
        return await asyncio.get_running_loop().run_in_executor(self._input_executor, fn, *args)

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        request_id: str | None = None,
        stream: bool = True,
        lora: LoRARequest | None = None,
        tenant: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Adds a request and returns its outputs as an async stream.

        The request is added (and validated) before this returns, so bad input raises here, not
        while iterating. Leaving the stream before its final output aborts the request.

        Args:
            prompt: text (tokenized on the input thread) or token ids.
            sampling_params: validated sampling parameters.
            cache_salt: the request's cache namespace (see ``LLMEngine.add_request``).
            request_id: defaults to a fresh ``"req-N"``.
            stream: yield an output after every new token (cumulative text and token ids);
                otherwise only the final output.
            lora: a LoRA adapter for this request.
            tenant: the request's tenant namespace (see ``LLMEngine.add_request``).
            priority: scheduling priority, lower = earlier (vLLM's; see ``LLMEngine.add_request``).

        Returns:
            An async iterator of :class:`RequestOutput`: with ``n > 1`` the samples' outputs
            interleave (``index`` tells them apart); it ends once all ``n`` have ``finished=True``.

        Raises:
            ValueError: naming the field, as ``LLMEngine.add_request``.
            EngineDeadError: the background loop has failed.
        """
        request_ids = None if request_id is None else [request_id]
        return await self.generate_batch([prompt], sampling_params, cache_salt, request_ids, stream, lora, tenant,
                                         priority)

    async def generate_batch(
        self,
        prompts: list[str | list[int]],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        request_ids: list[str] | None = None,
        stream: bool = True,
        lora: LoRARequest | None = None,
        tenant: str | None = None,
        priority: int = 0,
        cache_control: Sequence[CacheBreakpoint] | None = None,
        retain_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Adds one request per prompt, all in one call on the engine thread (so the scheduler
        sees them together, in the same step), and returns their outputs as one async stream.

        All or nothing: if any prompt is refused, none is queued. The stream yields the outputs
        in the order the engine makes them (``request_id`` tells the prompts apart, ``index`` the
        samples); it ends once every sample of every prompt finished, or at the first aborted or
        failed one. Leaving it early aborts every request of the batch.

        Args:
            prompts: texts or token-id lists (at least one).
            request_ids: one per prompt, distinct; default fresh ``"req-N"`` ids.
            cache_control: cache breakpoints, for every prompt (see ``LLMEngine.add_request``).
            retain_s: keep every prompt in the disk tier this long (see ``LLMEngine.add_request``).
            (the others as :meth:`generate`; ``sampling_params`` apply to every prompt.)

        Raises:
            ValueError: naming the field, as ``LLMEngine.add_request``; with several prompts the
                message starts with the refused prompt's position (``"prompt[2]: ..."``).
            EngineDeadError: the background loop has failed.
        """
        if self._task is None:
            self.start()
        if request_ids is None:
            request_ids = [f"req-{next(self._counter)}" for _ in prompts]
        if len(set(request_ids)) != len(request_ids) or len(request_ids) != len(prompts) or not prompts:
            raise InvalidInputError("request_id", "give one distinct request_id per prompt, and at least one prompt")
        for request_id in request_ids:
            if request_id in self._queues:
                raise InvalidInputError("request_id", f"request_id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()  # shared by the batch
        for request_id in request_ids:  # reserved now; before the add: the next step may output
            self._queues[request_id] = queue
            self._unfinished[request_id] = sampling_params.n
        try:
            processed = await self._call_input(self._tokenize_batch, prompts)
            await self._call(self._add_batch, processed, sampling_params, request_ids,
                             {"cache_salt": cache_salt, "stream": stream, "lora": lora, "tenant": tenant,
                              "priority": priority, "cache_control": cache_control, "retain_s": retain_s})
        except BaseException as e:
            for request_id in request_ids:
                if self._queues.get(request_id) is queue:
                    self._queues.pop(request_id)
                    self._unfinished.pop(request_id, None)
            if not isinstance(e, Exception) and self.error is None:
                # Cancelled while the add may be running on the engine thread: abort after it.
                with contextlib.suppress(RuntimeError):  # the executor is gone if shutdown ended
                    for request_id in request_ids:
                        self._executor.submit(self._abort_samples, request_id)
            raise
        self._wakeup.set()
        return self._stream(request_ids, queue, sampling_params.n)

    def _tokenize_batch(self, prompts: list[str | list[int]]) -> list[ProcessedPrompt]:
        """Tokenizes the prompts of a batch, on the input thread."""
        processed = []
        for i, prompt in enumerate(prompts):
            try:
                processed.append(prompt if isinstance(prompt, ProcessedPrompt)
                                 else self.engine.input_processor.tokenize(prompt, self._tokenizer))
                # here, not only in add_request: that waits for the engine thread (a running step)
                self.engine.input_processor.check_prompt_fits(len(processed[-1].token_ids))
            except InvalidInputError as e:
                raise _in_batch(e, i, len(prompts)) from e
        return processed

    def _add_batch(self, prompts: list[ProcessedPrompt], sampling_params: SamplingParams,
                   request_ids: list[str], options: dict[str, Any]) -> None:
        """Adds every prompt of a batch, on the engine thread; none if one is refused (those
        already added are aborted before any step can run them)."""
        added: list[str] = []
        try:
            for i, (prompt, request_id) in enumerate(zip(prompts, request_ids)):
                try:
                    self.engine.add_request(prompt, sampling_params, request_id=request_id, **options)
                except InvalidInputError as e:
                    raise _in_batch(e, i, len(prompts)) from e
                added.append(request_id)
        except BaseException:
            for request_id in added:
                self.engine.abort_request_samples(request_id)
            raise

    async def _stream(
        self, request_ids: list[str], queue: asyncio.Queue[RequestOutput | BaseException], n: int
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        num_finished = 0
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                num_finished += item.finished
                finished = num_finished == n * len(request_ids) or item.finish_reason in ("abort", "error")
                yield item
        finally:
            if num_finished < n * len(request_ids):  # left early, or a sample failed: free the rest
                for request_id in request_ids:
                    self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """Queues an abort of ``request_id`` on the engine thread without waiting for it."""
        if self._queues.pop(request_id, None) is None:
            return  # done already, or its failed sample's abort is on its way
        if self.error is not None or self._loop is None:
            self._unfinished.pop(request_id, None)  # no step or abort will tell of its samples
            return
        self._submit_abort(request_id)

    def _submit_abort(self, request_id: str) -> None:
        """Submits an abort of ``request_id``; :meth:`_aborted` gets its outputs on the event loop."""
        # Wrapped as run_in_executor wraps the loop's steps: each result reaches the loop in two hops
        # (call_soon_threadsafe, then the future's call_soon), both in order, so this abort's outputs
        # come after those of the step it queued behind. A plain done callback hopped once: an
        # in-flight step's last samples came after the abort, each taken for the request's end.
        future = asyncio.wrap_future(self._executor.submit(self._abort_samples, request_id), loop=self._loop)
        future.add_done_callback(functools.partial(self._on_abort_done, request_id))

    def _abort_samples(self, request_id: str) -> list[RequestOutput]:
        """On the engine thread: aborts every sample of ``request_id``, then refreshes the stats."""
        return self._taking_stats(self.engine.abort_request_samples, request_id)

    def _on_abort_done(self, request_id: str, future: asyncio.Future) -> None:
        self._aborted(request_id, [] if future.cancelled() or future.exception() else future.result())

    async def abort(self, request_id: str) -> None:
        """Aborts a request and waits until its blocks are freed; unknown ids are ignored."""
        queue = self._queues.pop(request_id, None)
        # awaited as the loop awaits its steps: the outputs of the step it queued behind come first
        outs = await self._call(self.engine.abort_request_samples, request_id)
        for out in outs:
            if queue is not None:
                queue.put_nowait(out)
        self._aborted(request_id, outs)

    # ------------------------------------------------------------------ engine state
    async def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                                  add_special_tokens: bool = False) -> list[int]:
        """Renders a conversation with the model's chat template, on the input thread (the chat
        endpoint's tokenization, also behind ``/tokenize``).

        Raises:
            InvalidInputError: (field ``messages``) the template rejects the conversation, or it is
                too long for the context.
        """
        render = self.engine.input_processor.apply_chat_template
        return await self._call_input(lambda: render(messages, add_generation_prompt, self._tokenizer,
                                                     add_special_tokens))

    async def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A completion prompt's token ids exactly as a request feeds them to the engine (the input
        processor's tokenization), on the input thread.

        Raises:
            InvalidInputError: (field ``prompt``) as :meth:`InputProcessor.tokenize`.
        """
        tokenize = self.engine.input_processor.tokenize
        return (await self._call_input(lambda: tokenize(prompt, self._tokenizer, add_special_tokens))).token_ids

    async def detokenize(self, token_ids: list[int], field: str = "tokens") -> str:
        """Token ids → text (special tokens kept), on the input thread.

        Raises:
            InvalidInputError: naming ``field``, for an id outside the vocabulary.
        """
        return await self._call_input(self.engine.input_processor.detokenize, token_ids, self._tokenizer, field)

    async def token_strs(self, token_ids: list[int]) -> list[str]:
        """The vocabulary string of each (checked) token id, on the input thread."""
        return await self._call_input(self.engine.input_processor.token_strs, token_ids, self._tokenizer)

    async def get_stats(self) -> EngineStats:
        """The engine's counters and queue lengths, taken together on the engine thread: with no
        request in flight, taken now (which sweeps expired ``ttl`` blocks and publishes their KV
        events, as a step would: an idle server used to report expired blocks forever); otherwise
        as of the last step (or add, abort, reset). It never waits for a running step (vLLM's
        ``/metrics`` also reports per step): a scrape answers at once while a long prefill runs.

        Once :meth:`shutdown` has begun, the last stats taken.

        Raises:
            EngineDeadError: the engine loop has failed.
        """
        if self.error is not None:
            raise EngineDeadError(f"engine loop failed: {self.error!r}")
        if not self._queues and not self._shutting_down:  # idle: the engine thread is free (but don't wait long if it isn't)
            refresh = asyncio.ensure_future(self._call(_nothing))  # _call takes the stats after it
            await asyncio.wait({refresh}, timeout=IDLE_STATS_WAIT_S)
            if refresh.done():
                refresh.result()  # its error, if any, as before
        return self._stats

    async def inspect(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Runs ``fn(engine)`` on the engine thread, between steps, and returns its result (a
        read-only look at engine state: the dashboard's prefix tree)."""
        return await self._call(fn, self.engine)

    async def reset_prefix_cache(self) -> bool:
        """Drops every cached block; False (nothing done) while any request holds blocks."""
        return await self._call(self.engine.reset_prefix_cache)


def _nothing() -> None:
    """A call for :meth:`AsyncLLMEngine._call` made only for the stats it takes afterwards."""


def _in_batch(e: InvalidInputError, index: int, num_prompts: int) -> InvalidInputError:
    """``e`` about the prompt at ``index`` of a batch: its message says which (same field)."""
    return e if num_prompts == 1 else InvalidInputError(e.field, f"prompt[{index}]: {e.message}")
