"""The engine: add requests, step (schedule → run model → postprocess), collect outputs."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import time
from dataclasses import dataclass

from collections.abc import Mapping
from pathlib import Path

import torch
import xxhash

from prefixcache.cache.hashing import (
    BlockHasher,
    hash_seed_bytes,
    make_root_key,
    root_key_adapter_digest,
    tenant_extra_key,
)
from prefixcache.cache.kv_cache_manager import KVCacheManager
from prefixcache.config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig
from prefixcache.engine.request import Request, RequestStatus, sample_request_id
from prefixcache.engine.scheduler import Scheduler
from prefixcache.engine.tenancy import ApprovedPrefixes, validate_tenant
from prefixcache.layers.lora import LoRAAdapter, LoRARequest, load_lora_adapter
from prefixcache.models.loader import LoadedModel, compute_fingerprint, load_model, load_weights, resolve_model_dir
from prefixcache.outputs import RequestOutput
from prefixcache.runner.kv_pool import kv_cache_bytes_per_block, num_blocks_for_memory
from prefixcache.runner.model_runner import ModelRunner
from prefixcache.sampling_params import SamplingParams

MAX_CACHE_SALT_CHARS = 1024
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineMetrics:
    """A snapshot of the engine's counters. Token counts are in tokens, blocks in blocks."""

    num_requests: int  # requests admitted (each counted once)
    num_hit_requests: int  # of those, requests with >= 1 cached token
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens served from the cache
    prompt_tokens_computed: int  # prompt tokens run through the model (recomputes included)
    num_preemptions: int
    num_evictions: int  # cached blocks evicted to make room
    num_blocks_total: int
    num_blocks_in_use: int  # ref_cnt > 0
    num_blocks_cached: int  # holding a hash (in use or free)
    num_blocks_free: int  # ref_cnt == 0 (cached or not)
    prefix_cache_partial_hits: int = 0  # prompt tokens copied from partial-block hits
    evictions_by_reason: dict[str, int] = dataclasses.field(default_factory=dict)  # policy reason -> count
    cached_bytes: int = 0  # KV bytes held by cached blocks
    mean_evicted_age_s: float = 0.0  # mean seconds from caching to eviction
    num_forks: int = 0  # samples forked from an n > 1 request (sharing its blocks)
    num_cow_copies: int = 0  # shared blocks copied on a sample's first write (copy-on-write)

    @property
    def hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class LLMEngine:
    """Continuous-batching engine over a paged KV pool with automatic prefix caching.

    Args:
        config: validated engine options.
        loaded: an already loaded model (tests reuse one); loaded from ``config.model`` if None.

    Raises:
        ValueError: bad options; ``ModelLoadError`` (a ValueError) when the model can't be loaded.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        config.validate()
        self.config = config
        if config.device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            try:
                device = torch.device(config.device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"device must be a torch device name such as 'cpu' or 'cuda', "
                                 f"got {config.device!r}") from e
            if device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {config.device!r}: CUDA is not available on this machine")
            if device.type not in ("cpu", "cuda"):
                raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {config.device!r}")
        if device.type == "cpu":
            torch.set_num_threads(config.resolved_num_threads())
        self.device = device
        self.loaded = loaded or load_model(config.model, dtype=_DTYPES[config.dtype], device=device)
        self.tokenizer = self.loaded.tokenizer
        mcfg = self.loaded.config
        self.max_model_len = min(config.max_model_len or self.loaded.max_model_len, self.loaded.max_model_len)
        self.num_blocks = self._num_blocks()
        self.block_hasher = BlockHasher(config.block_size, config.hash_algo)
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            eviction_policy=config.eviction_policy,
            cache_ttl_s=config.cache_ttl_s,
            bytes_per_block=self.kv_cache_bytes_per_block,
            enable_partial_block_reuse=config.enable_partial_block_reuse,
        )
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.loaded, self.num_blocks, config.block_size, device, config.seed)
        self.eos_token_ids = frozenset(self.loaded.eos_token_ids)
        # The cache key's model part: the files' fingerprint and the dtype the KV is computed in.
        model_dtype = str(next(self.loaded.model.parameters()).dtype)
        self.cache_fingerprint = hashlib.sha256(self.loaded.fingerprint + model_dtype.encode()).digest()
        self._hash_seed = hash_seed_bytes(config.hash_seed)
        self.vocab_size = mcfg.vocab_size
        # Parallel sampling groups (n > 1): group id -> {sample id: finished?} in sample order, and
        # sample id -> group id. Every sample id stays reserved until the whole group is done.
        self._groups: dict[str, dict[str, bool]] = {}
        self._sample_group: dict[str, str] = {}
        # Loaded LoRA adapters by directory: (files' mtime/size signature, adapter).
        self._lora_adapters: dict[Path, tuple[tuple, LoRAAdapter]] = {}
        self._counter = itertools.count()
        self.approved_prefixes = ApprovedPrefixes()

    def _num_blocks(self) -> int:
        cfg, mcfg = self.config, self.loaded.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        dtype = next(self.loaded.model.parameters()).dtype
        budget = cfg.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
        return num_blocks_for_memory(
            budget, mcfg.num_hidden_layers, cfg.block_size, mcfg.num_key_value_heads, mcfg.head_dim, dtype
        )

    @property
    def kv_cache_bytes_per_block(self) -> int:
        mcfg = self.loaded.config
        dtype = next(self.loaded.model.parameters()).dtype
        return kv_cache_bytes_per_block(
            mcfg.num_hidden_layers, self.config.block_size, mcfg.num_key_value_heads, mcfg.head_dim, dtype
        )

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        cache_salt: str | None = None,
        request_id: str | None = None,
        stream: bool = False,
        lora: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> str:
        """Validates and queues a request.

        Args:
            prompt: text (tokenized with the model's tokenizer) or token ids.
            sampling_params: defaults to ``SamplingParams()``.
            cache_salt: isolates this request's cache entries; equal salts share.
            request_id: defaults to a fresh counter value.
            stream: have :meth:`step` report this request's progress after every token.
            lora: a LoRA adapter to apply (loaded on first use, reloaded when its files change).
            tenant: the request's tenant namespace: its blocks are shared only within the tenant,
                except full blocks inside an approved shared prefix (:meth:`add_approved_prefix`),
                which every tenant shares. ``None``: no namespace.

        Returns:
            The request id.

        Raises:
            ValueError: naming the field: empty/oversized prompt, token id outside the vocabulary,
                bad cache_salt or tenant, a request the KV pool can never hold, duplicate
                request_id.
        """
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if cache_salt is not None and (
            not isinstance(cache_salt, str) or not cache_salt or len(cache_salt) > MAX_CACHE_SALT_CHARS
        ):
            raise ValueError(
                f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters"
            )
        validate_tenant(tenant)
        adapter = self.get_lora_adapter(lora) if lora is not None else None
        prompt_text, token_ids = self._tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                "(the prompt plus at least one generated token must fit)"
            )
        max_len = min(len(token_ids) + params.max_tokens, self.max_model_len)
        # The n samples share the prompt's full blocks; each needs its own blocks after them.
        num_prompt_blocks = len(token_ids) // self.config.block_size
        needed = num_prompt_blocks + params.n * (math.ceil(max_len / self.config.block_size) - num_prompt_blocks)
        if needed > self.num_blocks:
            raise ValueError(
                f"prompt + max_tokens ({max_len} tokens{f' x n={params.n} samples' if params.n > 1 else ''}) "
                f"needs {needed} KV blocks but the pool has "
                f"{self.num_blocks}; lower max_tokens or raise num_blocks / kv_cache_memory_bytes"
            )
        if request_id is None:
            request_id = str(next(self._counter))
        sample_ids = [sample_request_id(request_id, i) for i in range(params.n)]
        for rid in sample_ids:
            if rid in self.scheduler.requests or rid in self._sample_group:
                raise ValueError(f"request_id {rid!r} is already in use")
        request = Request(
            request_id,
            token_ids,
            params,
            self.block_hasher,
            self.root_key(cache_salt, adapter),
            stream=stream,
            lora=adapter,
            tenant_key=tenant_extra_key(tenant),
            num_shared_blocks=(
                0 if tenant is None else self.approved_prefixes.shared_length(token_ids) // self.config.block_size
            ),
            prompt=prompt_text,
        )
        if params.n > 1:
            self._groups[request_id] = dict.fromkeys(sample_ids, False)
            self._sample_group.update((rid, request_id) for rid in sample_ids)
        self.scheduler.add_request(request)
        return request_id

    def root_key(self, cache_salt: str | None = None, adapter: LoRAAdapter | None = None) -> bytes:
        """The cache-key root of a request: model fingerprint, dtype, hash seed, cache_salt, adapter."""
        digest = adapter.digest if adapter is not None else b""
        return make_root_key(self.cache_fingerprint, cache_salt, self._hash_seed, digest)

    def add_approved_prefix(self, prompt: str | list[int]) -> int:
        """Declares a public prefix that every tenant may share (see :mod:`prefixcache.engine.tenancy`).

        Args:
            prompt: text (tokenized as a completion prompt is) or token ids.

        Returns:
            Its length in tokens.

        Raises:
            ValueError: an empty prompt or token ids outside the vocabulary.
        """
        _, token_ids = self._tokenize(prompt)
        self.approved_prefixes.add(token_ids)
        return len(token_ids)

    def add_approved_system_prompt(self, content: str) -> int:
        """Approves a chat system message: the template's rendering of it, as a chat request's head.

        Returns:
            Its length in tokens.

        Raises:
            ValueError: empty content, or the template can't render a lone system message.
        """
        if not isinstance(content, str) or not content:
            raise ValueError("an approved system prompt must be a non-empty string")
        token_ids = self.apply_chat_template([{"role": "system", "content": content}], add_generation_prompt=False)
        self.approved_prefixes.add(token_ids)
        return len(token_ids)

    def apply_chat_template(self, conversation: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Renders one conversation with the model's chat template → prompt token ids.

        Raises:
            ValueError: malformed messages, or a conversation the template can't render.
        """
        if not isinstance(conversation, list) or not conversation:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        for m in conversation:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"each message needs string 'role' and 'content', got {m!r}")
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # jinja raises its own errors for conversations it can't render
            raise ValueError(f"messages could not be rendered with the chat template: {e}") from e
        return self.tokenizer.encode(text, add_special_tokens=False)

    def get_lora_adapter(self, lora: LoRARequest) -> LoRAAdapter:
        """The loaded adapter for ``lora``, (re)loaded when its files are new or changed on disk.

        Raises:
            ValueError: not a LoRARequest, or an adapter that can't be loaded for this model.
        """
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora must be a LoRARequest, got {type(lora).__name__}")
        path = Path(lora.lora_path).expanduser().resolve()
        try:
            signature = tuple((f.stat().st_mtime_ns, f.stat().st_size) for f in sorted(path.iterdir()))
        except OSError as e:
            raise ValueError(f"lora: cannot read adapter directory {lora.lora_path!r}: {e}") from e
        cached = self._lora_adapters.get(path)
        if cached is None or cached[0] != signature:
            adapter = load_lora_adapter(path, self.loaded.model, lora.lora_name)
            old_digest = None if cached is None else cached[1].digest
            cached = self._lora_adapters[path] = (signature, adapter)
            if old_digest is not None and old_digest != adapter.digest and old_digest not in {
                a.digest for _, a in self._lora_adapters.values()
            }:
                # The old weights' blocks can't be hit any more: evict them first, not by age.
                self.kv_cache_manager.block_pool.invalidate_chains(
                    lambda root_key: root_key_adapter_digest(root_key) == old_digest
                )
        return cached[1]

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt must not be empty")
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {t!r}")
        return None, list(prompt)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a request (all samples of an ``n > 1`` request) and frees its blocks.

        Returns:
            The aborted request's output (its first unfinished sample's), or None for unknown or
            finished ids.
        """
        outputs = self.abort_request_samples(request_id)
        return outputs[0] if outputs else None

    def abort_request_samples(self, request_id: str) -> list[RequestOutput]:
        """Like :meth:`abort_request`, returning the output of every sample it stopped.

        ``request_id`` is the id given to :meth:`add_request`; an engine-internal sample id
        (``"id#i"``) stops that sample only, and only once it exists.
        """
        samples = list(self._groups.get(request_id, [request_id]))
        outputs = []
        for sample_id in samples:
            request = self.scheduler.finish_request(sample_id, RequestStatus.FINISHED_ABORTED)
            if request is not None:
                request.finish_s = time.monotonic()
                outputs.append(self._make_output(request))
                self._sample_finished(request)
        return outputs

    def _sample_finished(self, request: Request) -> None:
        """Marks a sample of an ``n > 1`` request finished; forgets the group once all are."""
        group_id = self._sample_group.get(request.request_id)
        if group_id is None:
            return
        group = self._groups[group_id]
        group[request.request_id] = True
        if request.fork_params:  # it ended before forking (aborted): its other samples never exist
            request.fork_params = []
            group.update(dict.fromkeys(group, True))
        if all(group.values()):
            del self._groups[group_id]
            for sample_id in group:
                del self._sample_group[sample_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Runs one engine step.

        Returns:
            Outputs of the requests that finished in this step, and (with ``finished=False``) of
            streaming requests that got a token and go on.
        """
        self.kv_cache_manager.block_pool.sweep_expired()
        scheduler_output = self.scheduler.schedule()
        try:
            sampled = self.runner.execute_model(scheduler_output)
        except BaseException:
            self.kv_cache_manager.end_step()  # release partial-hit sources pinned for this step
            raise
        updated = self.scheduler.update_from_output(scheduler_output, sampled)
        now = time.monotonic()
        outputs = []
        for request in updated:
            if request.first_token_s is None:
                request.first_token_s = now
            status = self._check_stop(request)
            if status is not None:
                self.scheduler.finish_request(request.request_id, status)
                self._sample_finished(request)
                request.finish_s = now
                outputs.append(self._make_output(request))
            elif request.stream:
                outputs.append(self._make_output(request))
        return outputs

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        token = request.output_token_ids[-1]
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            request.stop_reason = token if token in params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if params.stop:
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
            # Only the tail can hold a new match: the text before it was checked last step.
            window = max(len(s) for s in params.stop) + 16
            for stop in params.stop:
                idx = text.find(stop, max(0, len(text) - window - len(stop)))
                if idx >= 0:
                    request.stop_reason = stop
                    request.stop_text_end = idx + (len(stop) if params.include_stop_str_in_output else 0)
                    return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _make_output(self, request: Request) -> RequestOutput:
        text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        if request.stop_text_end is not None:
            text = text[: request.stop_text_end]
        return RequestOutput(
            request_id=request.group_id,
            index=request.sample_index,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            ttft_s=None if request.first_token_s is None else request.first_token_s - request.arrival_s,
            e2e_s=None if request.finish_s is None else request.finish_s - request.arrival_s,
            finished=request.is_finished,
        )

    # ------------------------------------------------------------------ cache control
    def load_weights(self, weights: str | Path | Mapping[str, torch.Tensor]) -> None:
        """Replaces model weights in place and makes every cached block unreachable.

        The cache key's model part is re-derived from the new weights' content, and all cached
        blocks are dropped at once (not left to age out of the LRU), so no request ever reads K/V
        computed with the old weights (../shared/cases C2).

        Args:
            weights: an HF model directory with *.safetensors of the same architecture, or a
                mapping ``parameter name -> tensor`` (a partial update is fine).

        Raises:
            ValueError: requests are still running or waiting (finish or abort them first), an
                unknown parameter name, or a shape mismatch.
        """
        if self.has_unfinished_requests():
            raise ValueError("load_weights: requests are still in flight; wait for them or abort them first")
        model = self.loaded.model
        if isinstance(weights, Mapping):
            params = dict(model.named_parameters())
            digest = xxhash.xxh3_128()
            for name in sorted(weights):
                tensor, param = weights[name], params.get(name)
                if param is None:
                    raise ValueError(f"load_weights: unknown parameter {name!r}")
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(
                        f"load_weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                    )
                with torch.no_grad():
                    param.copy_(tensor)
                digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
                digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            weights_digest = digest.digest()
        else:
            model_dir = resolve_model_dir(str(weights))
            load_weights(model, model_dir, self.loaded.config.tie_word_embeddings)
            weights_digest = compute_fingerprint(model_dir)
        self.cache_fingerprint = hashlib.sha256(self.cache_fingerprint + b"weights" + weights_digest).digest()
        self.kv_cache_manager.reset_prefix_cache()

    def reset_prefix_cache(self) -> bool:
        """Drops every cached block; refused (False) while any request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def get_metrics(self) -> EngineMetrics:
        kv = self.kv_cache_manager
        kv.block_pool.sweep_expired()
        stats = kv.stats
        free = kv.num_free_blocks
        return EngineMetrics(
            num_requests=stats.num_requests,
            num_hit_requests=stats.num_hit_requests,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            prompt_tokens_computed=self.scheduler.num_prompt_tokens_computed,
            num_preemptions=self.scheduler.num_preemptions,
            num_evictions=kv.block_pool.num_evictions,
            num_blocks_total=self.num_blocks,
            num_blocks_in_use=self.num_blocks - free,
            num_blocks_cached=kv.num_cached_blocks,
            num_blocks_free=free,
            prefix_cache_partial_hits=stats.partial_hits,
            evictions_by_reason=dict(kv.block_pool.evictions_by_reason),
            cached_bytes=kv.block_pool.cached_bytes,
            mean_evicted_age_s=kv.block_pool.mean_evicted_age_s,
            num_forks=kv.num_cow_forks,
            num_cow_copies=kv.num_cow_copies,
        )

