"""Offline API: ``LLM(model, **engine_options).generate(...)`` / ``.chat(...)`` (vLLM's shape)."""

from __future__ import annotations

import numbers
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from prefixcache.cache.pins import CacheBreakpoint
from prefixcache.config import DEFAULT_MODEL, EngineConfig
from prefixcache.engine.llm_engine import EngineMetrics, LLMEngine
from prefixcache.errors import InvalidInputError
from prefixcache.layers.lora import LoRARequest
from prefixcache.models.loader import LoadedModel
from prefixcache.outputs import RequestOutput
from prefixcache.sampling_params import SamplingParams

Message = dict[str, str]


class LLM:
    """Offline batch inference with automatic prefix caching.

    Args:
        model: ``"smollm2-135m"`` (fetched and converted once), an HF model directory or a .gguf file.
        loaded: an already loaded model to reuse (skips loading ``model``).
        **engine_options: fields of :class:`prefixcache.config.EngineConfig`
            (block_size, num_blocks, kv_cache_memory_bytes, max_num_seqs, max_num_batched_tokens,
            enable_prefix_caching, hash_algo, dtype, device, num_threads, seed, max_model_len).

    Raises:
        ValueError: unknown or invalid option, or a model that can't be loaded.

    ``generate`` and ``chat`` may run from several threads at once: their requests are stepped
    together and each call returns its own outputs. A request added through ``llm.engine``
    directly is stepped by its caller: ``generate`` refuses to start while one is queued (its
    outputs would otherwise be taken by this call's steps).

    Example::

        llm = LLM("smollm2-135m")
        outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
        print(outs[0].text, outs[0].num_cached_tokens)
    """

    def __init__(self, model: str = DEFAULT_MODEL, loaded: LoadedModel | None = None, **engine_options: Any):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_options), loaded=loaded)
        self._step_lock = threading.Lock()  # a step and the filing of its outputs, as one
        self._lock = threading.Lock()  # guards the two below
        self._own_ids: set[str] = set()  # requests of the generate calls in flight
        self._finished: dict[tuple[str, int], RequestOutput] = {}  # (request id, index) -> final output

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
        use_tqdm: bool = True,
        lora: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tenant: str | None = None,
        priority: int | Sequence[int] = 0,
        cache_control: CacheBreakpoint | Sequence[CacheBreakpoint] | None = None,
    ) -> list[RequestOutput]:
        """Generates for a batch of prompts, all scheduled together.

        Args:
            prompts: one prompt or a list; each is text or a list of token ids.
            sampling_params: one for all prompts or one per prompt (``None`` entries: the default);
                default ``SamplingParams()``.
            cache_salt: namespace for this batch's cache entries (see ``LLMEngine.add_request``).
            use_tqdm: show a progress bar (on stderr, where it is a terminal) for batches of more than one prompt.
            lora: a LoRA adapter for all prompts, or one (or None) per prompt.
            tenant: the batch's tenant namespace; only approved prefixes are shared across
                tenants (see :meth:`add_approved_prefix`), and not with a ``cache_salt``.
            priority: scheduling priority for all prompts, or one per prompt: lower = earlier
                (vLLM's ``priority``; the outer key of ``scheduling_policy``'s order).
            cache_control: cache breakpoints for every prompt: ``CacheBreakpoint(num_tokens,
                ttl_s)`` pins the prompt's first ``num_tokens`` tokens (whole blocks) in the pool for
                ``ttl_s`` after their last use, within ``max_pinned_fraction`` of the pool; each
                output's ``pinned`` says what each breakpoint got (:mod:`prefixcache.cache.pins`).

        Returns:
            One :class:`RequestOutput` per prompt and sample, in input order: a prompt whose
            params have ``n > 1`` gives ``n`` consecutive outputs (``index`` 0..n-1). The samples
            share the prompt's KV blocks (copy-on-write).

        Raises:
            InvalidInputError: (a ValueError) naming the field, for any invalid prompt or parameter;
                nothing is queued then.
        """
        if not isinstance(prompts, (str, list, tuple)):
            raise InvalidInputError("prompts", f"prompts must be a string, a list of token ids or a list of those, "
                                               f"got {type(prompts).__name__}")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise InvalidInputError("prompts", "prompts must contain at least one prompt")
        if isinstance(sampling_params, Mapping):
            raise InvalidInputError("sampling_params", "sampling_params must be a SamplingParams (or a list of them), "
                                                       "got a dict: build one with SamplingParams(**params)")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = [SamplingParams() if p is None else p for p in sampling_params]
            if len(params) != len(prompts):
                raise InvalidInputError("sampling_params", f"sampling_params has {len(params)} entries but there "
                                                           f"are {len(prompts)} prompts")
        loras = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise InvalidInputError("lora", f"lora has {len(loras)} entries but there are {len(prompts)} prompts")
        priorities = list(priority) if isinstance(priority, (list, tuple)) else [priority] * len(prompts)
        if len(priorities) != len(prompts):
            raise InvalidInputError("priority", f"priority has {len(priorities)} entries but there are "
                                                f"{len(prompts)} prompts")
        return self._run(
            [(p, sp, cache_salt, lr, tenant, pr) for p, sp, lr, pr in zip(prompts, params, loras, priorities)],
            use_tqdm, cache_control,
        )

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tenant: str | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of them, via the model's chat template.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]`` or a list of such conversations.

        Raises:
            ValueError: malformed messages or anything ``generate`` rejects.
        """
        if not isinstance(messages, (list, tuple)):
            raise InvalidInputError("messages", f"messages must be a list of {{'role', 'content'}} dicts (or a list "
                                                f"of such lists), got {type(messages).__name__}")
        if not messages:
            raise InvalidInputError("messages", "messages must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(
            prompts, sampling_params, cache_salt=cache_salt, use_tqdm=use_tqdm, lora=lora, tenant=tenant
        )

    def apply_chat_template(self, conversation: list[Message], add_generation_prompt: bool = True) -> list[int]:
        """Renders one conversation with the model's chat template → prompt token ids."""
        return self.engine.apply_chat_template(conversation, add_generation_prompt)

    def add_approved_prefix(self, prompt: str | list[int]) -> int:
        """Declares public text (or token ids) that every tenant may share; returns its tokens."""
        return self.engine.add_approved_prefix(prompt)

    def add_approved_system_prompt(self, content: str) -> int:
        """Declares a public chat system message that every tenant may share; returns its tokens."""
        return self.engine.add_approved_system_prompt(content)

    def _run(self, items: list[tuple[Any, SamplingParams, str | None, Any, str | None, int]],
             use_tqdm: bool, cache_control: Any = None) -> list[RequestOutput]:
        """Adds the batch (all or nothing), steps the engine until every sample of it finished, and
        returns their outputs in order. Steps run by other threads' calls may finish this call's
        samples: finished outputs go to a shared table that every call reads its own from."""
        engine = self.engine
        ids: list[str] = []
        with self._lock:
            if not self._own_ids and engine.has_unfinished_requests():
                raise RuntimeError("generate: the engine holds requests added through llm.engine; step them with "
                                   "llm.engine.step() (or abort them) first: this call's steps would take their outputs")
            try:
                for prompt, params, salt, lora, tenant, priority in items:
                    ids.append(engine.add_request(prompt, params, cache_salt=salt, lora=lora, tenant=tenant,
                                                  priority=priority, cache_control=cache_control))
            except BaseException:
                for req_id in ids:  # all or nothing: don't leave half a batch queued
                    engine.abort_request(req_id)
                raise
            self._own_ids.update(ids)
        keys = [(req_id, i) for req_id, (_, params, *_) in zip(ids, items) for i in range(params.n)]
        results: dict[tuple[str, int], RequestOutput] = {}
        try:
            # disable=None: tqdm's own rule, no bar where stderr is not a terminal (a log, a pipe)
            hidden = True if not use_tqdm or len(keys) < 2 else None
            with tqdm(total=len(keys), desc="Generating", disable=hidden) as bar:
                while len(results) < len(keys):
                    with self._step_lock:
                        self._keep_finished(engine.step())
                        lost = not engine.has_unfinished_requests()
                    with self._lock:
                        mine = {key: self._finished.pop(key) for key in keys if key in self._finished}
                    if lost and len(results) + len(mine) < len(keys):
                        raise RuntimeError("generate: requests of this call left the engine without an output "
                                           "(another thread's generate was interrupted inside its step)")
                    for out in mine.values():
                        if out.finish_reason == "error":
                            raise RuntimeError(out.error)
                    results.update(mine)
                    bar.update(len(mine))
        except BaseException:
            for req_id in ids:  # the engine failed only the failed step's requests; drop the batch
                engine.abort_request(req_id)
            raise
        finally:
            with self._lock:
                self._own_ids.difference_update(ids)
                for key in keys:
                    self._finished.pop(key, None)
        return [results[key] for key in keys]

    def _keep_finished(self, outputs: list[RequestOutput]) -> None:
        """Files a step's final (and failed) outputs of the calls in flight under their keys."""
        with self._lock:
            for out in outputs:
                if out.request_id in self._own_ids and (out.finished or out.finish_reason == "error"):
                    self._finished[out.request_id, out.index] = out

    def load_weights(self, weights) -> None:
        """Swaps in new weights (a model directory or ``{name: tensor}``); see ``LLMEngine.load_weights``."""
        self.engine.load_weights(weights)

    def reset_prefix_cache(self) -> bool:
        """Drops all cached blocks; returns False (and does nothing) while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    def get_metrics(self) -> EngineMetrics:
        return self.engine.get_metrics()
