"""AsyncLLMEngine's bookkeeping, mostly without a model (a fake engine): request ids reserved before
the await on tokenization, a cancelled add aborted, a failed n > 1 request forgotten whole, on_finish
told once per sample and once per request (one SmolLM2 test: a stream left mid-way)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import types

import pytest

from prefixcache.engine.async_engine import AsyncLLMEngine, EngineDeadError
from prefixcache.engine.input_processor import ProcessedPrompt
from prefixcache.errors import InvalidInputError
from prefixcache.outputs import RequestOutput
from prefixcache.sampling_params import SamplingParams


class FakeEngine:
    """Adds requests; each step finishes every request with one token."""

    def __init__(self, tokenize_gate: threading.Event | None = None) -> None:
        self.device = types.SimpleNamespace(type="cuda")  # skip the CPU thread setup
        self.tokenizer = None
        self.requests: dict[str, bool] = {}
        self.scheduler = types.SimpleNamespace(running={}, waiting=[])
        gate = tokenize_gate

        def tokenize(prompt, tokenizer=None):
            if gate is not None:
                gate.wait(5)
            return ProcessedPrompt(prompt, [1, 2, 3])

        self.input_processor = types.SimpleNamespace(tokenize=tokenize, check_prompt_fits=lambda num_tokens: None)

    def add_request(self, prompt, params, request_id, **_):
        if request_id in self.requests:
            raise InvalidInputError("request_id", f"request_id {request_id!r} is already in use")
        self.requests[request_id] = True
        return request_id

    def get_metrics(self):
        return {"requests": len(self.requests)}

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        outs = [RequestOutput(rid, 0, None, [1], "x", [5], "length", None, 3, 0, None, None)
                for rid in self.requests]
        self.requests.clear()
        return outs

    def abort_request(self, rid):
        self.requests.pop(rid, None)

    def abort_request_samples(self, rid):
        self.requests.pop(rid, None)
        return []

    def reset_prefix_cache(self):
        return True

    def close(self):
        self.closed = True


async def _collect(stream):
    return [o async for o in stream]


def test_duplicate_request_id_during_tokenization_does_not_orphan_the_first():
    async def main():
        gate = threading.Event()
        engine = AsyncLLMEngine(FakeEngine(gate))
        params = SamplingParams(max_tokens=1)
        first = asyncio.ensure_future(engine.generate("a", params, request_id="same"))
        second = asyncio.ensure_future(engine.generate("b", params, request_id="same"))
        await asyncio.sleep(0.05)  # both passed the duplicate check, both wait on tokenization
        gate.set()
        results = await asyncio.gather(first, second, return_exceptions=True)
        assert sum(isinstance(r, ValueError) for r in results) == 1
        stream = next(r for r in results if not isinstance(r, BaseException))
        try:
            outs = await asyncio.wait_for(_collect(stream), 2)
        finally:
            await engine.shutdown()
        assert outs[-1].finished

    asyncio.run(main())


def test_cancelled_while_adding_leaves_no_orphan_request():
    async def main():
        fake = FakeEngine()
        gate = threading.Event()
        add = fake.add_request

        def slow_add(*args, **kwargs):
            gate.wait(5)
            return add(*args, **kwargs)

        fake.add_request = slow_add
        fake.step = lambda: []  # the orphan never finishes by itself
        engine = AsyncLLMEngine(fake)
        task = asyncio.ensure_future(engine.generate([1, 2], SamplingParams(max_tokens=1), request_id="r"))
        await asyncio.sleep(0.05)
        task.cancel()  # client gone / handler cancelled while the add runs on the engine thread
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)
        orphans = dict(fake.requests)
        await engine.shutdown()
        assert orphans == {}  # aborted after the add it raced with

    asyncio.run(main())


def test_n2_request_failed_before_its_fork_leaves_no_queue_behind():
    """The step computing an n=2 prompt fails: the engine reports sample 0 only (the fork never
    happened); the stream ends on the error, and nothing of the request may stay behind."""
    async def main():
        fake = FakeEngine()

        def failing_step():
            outs = [RequestOutput(rid, 0, None, [1], "", [], "error", None, 3, 0, None, None, error="boom")
                    for rid in fake.requests]
            fake.requests.clear()
            return outs

        fake.step = failing_step
        engine = AsyncLLMEngine(fake)
        stream = await engine.generate([1, 2], SamplingParams(max_tokens=1, n=2), request_id="g")
        outs = await asyncio.wait_for(_collect(stream), 2)
        await asyncio.sleep(0.05)
        left = dict(engine._queues), dict(engine._unfinished)
        await engine.shutdown()
        assert outs[-1].finish_reason == "error"
        assert left == ({}, {})

    asyncio.run(main())


def test_batch_is_all_or_nothing_and_one_stream_aborts_all():
    """generate_batch: a refused prompt leaves none of the batch queued (the message names its
    position); a batch's stream ends after every request finished; closed early, it aborts all."""
    async def main():
        fake = FakeEngine()
        add = fake.add_request

        def add_request(prompt, params, request_id, **kwargs):
            if prompt.text == "bad":
                raise InvalidInputError("prompt", "prompt is bad")
            return add(prompt, params, request_id=request_id, **kwargs)

        fake.add_request = add_request
        aborted = []
        fake.abort_request_samples = lambda rid: (aborted.append(rid), fake.requests.pop(rid, None), [])[2]
        engine = AsyncLLMEngine(fake)
        params = SamplingParams(max_tokens=1)
        try:
            with pytest.raises(InvalidInputError) as e:
                await engine.generate_batch(["a", "b", "bad"], params, request_ids=["x-0", "x-1", "x-2"])
            assert (e.value.field, str(e.value)) == ("prompt", "prompt[2]: prompt is bad")
            assert fake.requests == {} and aborted == ["x-0", "x-1"] and engine._queues == {}

            stream = await engine.generate_batch(["a", "b"], params, request_ids=["y-0", "y-1"])
            outs = await asyncio.wait_for(_collect(stream), 2)
            assert sorted(o.request_id for o in outs) == ["y-0", "y-1"] and engine._queues == {}

            fake.step = lambda: []  # nothing finishes now: close the stream before its end
            aborted.clear()
            it = await engine.generate_batch(["a", "b"], params, request_ids=["w-0", "w-1"])
            task = asyncio.ensure_future(it.__anext__())
            await asyncio.sleep(0.05)
            task.cancel()  # a consumer gone mid-wait aborts every request of its batch
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.05)
            assert {"w-0", "w-1"} <= set(aborted) and not {"w-0", "w-1"} & set(fake.requests)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_calls_after_shutdown_are_refused_as_shutting_down_and_stats_stay_readable():
    """The executors refuse work once shut down (a bare RuntimeError, a 500 on the server); calls
    then raise EngineDeadError (503) and get_stats answers the last stats taken."""
    async def main():
        fake = FakeEngine()
        engine = AsyncLLMEngine(fake)
        stream = await engine.generate([1, 2], SamplingParams(max_tokens=1), request_id="a")
        outs = await asyncio.wait_for(_collect(stream), 2)
        assert outs[-1].finished
        fake.requests["late"] = True  # only the stats taken after this reach get_stats
        assert (await engine.get_stats()).metrics == {"requests": 1}
        await engine.shutdown()
        assert fake.closed
        assert (await engine.get_stats()).metrics == {"requests": 1}
        for call in (engine.reset_prefix_cache(), engine.generate([1], SamplingParams(max_tokens=1)),
                     engine.tokenize("x"), engine.inspect(lambda e: 1)):
            with pytest.raises(EngineDeadError, match="server is shutting down"):
                await call
        await engine.shutdown()  # twice (a second Ctrl-C) is harmless

    asyncio.run(main())


def test_the_heap_is_trimmed_once_when_the_loop_goes_idle_after_serving(monkeypatch):
    """After requests finish the loop hands the heap's free pages back (return_freed_memory) once, on the engine
    thread; idle wake-ups with nothing served don't trim again, nor does a second burst within TRIM_INTERVAL_S."""
    from prefixcache.engine import async_engine

    trims: list[str] = []
    monkeypatch.setattr(async_engine, "return_freed_memory", lambda: trims.append(threading.current_thread().name))

    async def main():
        engine = AsyncLLMEngine(FakeEngine())
        try:
            assert trims == []  # nothing served yet
            outs = await asyncio.wait_for(_collect(await engine.generate("a", SamplingParams(max_tokens=1))), 2)
            assert outs[-1].finished
            await asyncio.sleep(0.1)
            assert len(trims) == 1 and trims[0] != threading.current_thread().name  # the engine thread's
            await asyncio.wait_for(_collect(await engine.generate("b", SamplingParams(max_tokens=1))), 2)
            await asyncio.sleep(0.1)
            assert len(trims) == 1  # within TRIM_INTERVAL_S of the last trim
            engine._last_trim -= async_engine.TRIM_INTERVAL_S
            await asyncio.wait_for(_collect(await engine.generate("c", SamplingParams(max_tokens=1))), 2)
            await asyncio.sleep(0.1)
            assert len(trims) == 2
        finally:
            await engine.shutdown()

    asyncio.run(main())


def _n2_fake(first_out: RequestOutput) -> tuple[FakeEngine, threading.Event, threading.Event]:
    """A fake running one n=2 request: its first step (held until ``gate`` is set; ``entered`` set when it
    starts) ends sample 0 with ``first_out``; sample 1 runs on until aborted (its abort output says
    ``"abort"``)."""
    fake = FakeEngine()
    gate, entered = threading.Event(), threading.Event()

    def step():
        entered.set()
        gate.wait(5)
        outs = [first_out] if fake.requests else []
        fake.step = lambda: []  # sample 1 never finishes by itself
        return outs

    def abort_request_samples(rid):
        alive = fake.requests.pop(rid, None)
        return [RequestOutput(rid, 1, None, [1], "x", [5], "abort", None, 3, 0, None, None)] if alive else []

    fake.step, fake.abort_request_samples = step, abort_request_samples
    return fake, gate, entered


def test_n2_stream_left_while_the_step_ends_a_sample_reports_the_request_done_once():
    """The client leaves an n=2 stream while the step in flight finishes sample 0: the abort that
    follows stops sample 1. on_finish hears each sample once and ``request_done`` once, last (the
    server logged the request twice: the in-flight sample counted as the request's last)."""
    async def main():
        calls = []
        fake, gate, entered = _n2_fake(RequestOutput("r", 0, None, [1], "x", [5], "length", None, 3, 0, None, None))
        engine = AsyncLLMEngine(fake, on_finish=lambda out, done: calls.append((out.index, done)))
        stream = await engine.generate([1, 2], SamplingParams(max_tokens=1, n=2), request_id="r")
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 5)  # the step is in flight
        assert entered.is_set()
        task.cancel()  # the client is gone: the stream submits the abort, behind the step
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await asyncio.sleep(0.1)
        left = dict(engine._unfinished)
        await engine.shutdown()
        assert calls == [(0, False), (1, True)]
        assert left == {}

    asyncio.run(main())


def test_n2_failed_sample_is_reported_last_and_once_as_the_request_end():
    """A sample fails while its sibling runs: the sibling is aborted and reported first, then the
    failed sample, with ``request_done`` (the request's one log line says "error")."""
    async def main():
        calls = []
        fake, gate, _ = _n2_fake(RequestOutput("f", 0, None, [1], "", [], "error", None, 3, 0, None, None,
                                            error="boom"))
        gate.set()
        engine = AsyncLLMEngine(fake, on_finish=lambda out, done: calls.append((out.finish_reason, done)))
        stream = await engine.generate([1, 2], SamplingParams(max_tokens=1, n=2), request_id="f")
        outs = await asyncio.wait_for(_collect(stream), 2)
        await asyncio.sleep(0.1)
        left = dict(engine._unfinished)
        await engine.shutdown()
        assert outs[-1].finish_reason == "error"
        assert calls == [("abort", False), ("error", True)]
        assert left == {}

    asyncio.run(main())


def test_n2_stream_left_mid_way_logs_one_request_line_on_the_real_engine(make_llm, caplog):
    """SmolLM2, n=2 streaming, max_tokens=2: the client leaves after the first token, while the
    step that ends both samples is already in flight (submitted before the stream's consumer
    resumes). RequestLog (``prefixcache serve``'s hook) writes one line for the request."""
    from prefixcache.entrypoints.openai.server_log import RequestLog

    calls = []

    def hook(out, done):
        calls.append((out.index, done))

    async def main():
        engine = AsyncLLMEngine(make_llm(num_blocks=64).engine, on_finish=RequestLog(then=hook))
        try:
            params = SamplingParams(max_tokens=2, n=2, ignore_eos=True, temperature=0.8, seed=1)
            async with contextlib.aclosing(await engine.generate("Hello there", params, request_id="s")) as stream:
                first = await stream.__anext__()
                assert not first.finished
            for _ in range(200):  # the abort and the step's outputs reach the loop
                if engine._unfinished == {} and not engine._queues and len(calls) >= 2:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)
        finally:
            await engine.shutdown()

    with caplog.at_level(logging.INFO, logger="prefixcache.requests"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "prefixcache.requests"]
    assert sorted(i for i, _ in calls) == [0, 1] and [d for _, d in calls] == [False, True]
    assert len(lines) == 1 and lines[0].startswith("request s ")
