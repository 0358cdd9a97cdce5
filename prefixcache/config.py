"""Engine configuration: one frozen dataclass, built from keyword arguments (nano-vllm's way)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from prefixcache.cache.eviction import EVICTION_POLICIES
from prefixcache.cache.hashing import HASH_ALGOS

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30  # 1 GiB when neither num_blocks nor a budget is given


@dataclass(frozen=True)
class EngineConfig:
    """Options of :class:`prefixcache.engine.llm_engine.LLMEngine` (and ``LLM``).

    Raises:
        ValueError: from :meth:`validate`, naming the invalid field.
    """

    model: str = DEFAULT_MODEL  # built-in name, HF directory or .gguf file
    dtype: str = "float32"  # weights and KV dtype
    device: str | None = None  # "cpu", "cuda", ...; None picks CUDA when present
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV pool size in blocks; overrides the memory budget
    kv_cache_memory_bytes: int | None = None  # KV pool budget in bytes (default 1 GiB)
    max_num_seqs: int = 32  # requests running at once
    max_num_batched_tokens: int = 2048  # tokens per forward pass (prefill chunks + decodes)
    max_model_len: int | None = None  # context limit in tokens; default the model's
    enable_prefix_caching: bool = True  # look up and cache full blocks
    hash_algo: str = "xxh64"  # block hash: "xxh64" or "sha256"
    hash_seed: int | None = None  # mixed into every block hash; None = random per process
    num_threads: int | None = None  # torch CPU threads; default the available cores
    seed: int = 0  # RNG seed for requests that give no seed of their own
    eviction_policy: str = "lru"  # which free cached block goes first: lru, lfu, ttl, cost
    cache_ttl_s: float = 300.0  # ttl policy: free cached blocks idle longer than this expire
    enable_partial_block_reuse: bool = True  # copy the matching first slots of a cached block

    def validate(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _positive_int("block_size", self.block_size)
        if self.num_blocks is not None:
            _positive_int("num_blocks", self.num_blocks)
        if self.kv_cache_memory_bytes is not None:
            _positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {self.hash_algo!r}")
        if self.hash_seed is not None and (
            isinstance(self.hash_seed, bool) or not isinstance(self.hash_seed, int) or not 0 <= self.hash_seed < 2**64
        ):
            raise ValueError(f"hash_seed must be an integer in [0, 2**64), got {self.hash_seed!r}")
        if self.num_threads is not None:
            _positive_int("num_threads", self.num_threads)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if self.device is not None and (not isinstance(self.device, str) or not self.device):
            raise ValueError(f"device must be a torch device name such as 'cpu' or 'cuda', got {self.device!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {sorted(EVICTION_POLICIES)}, got {self.eviction_policy!r}"
            )
        if (
            isinstance(self.cache_ttl_s, bool)
            or not isinstance(self.cache_ttl_s, (int, float))
            or not 0 < self.cache_ttl_s < float("inf")
        ):
            raise ValueError(f"cache_ttl_s must be a positive number of seconds, got {self.cache_ttl_s!r}")
        if not isinstance(self.enable_partial_block_reuse, bool):
            raise ValueError(
                f"enable_partial_block_reuse must be a bool, got {self.enable_partial_block_reuse!r}"
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Builds a validated config; unknown keyword → ValueError listing the valid ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; valid options: {sorted(names)}")
        config = cls(**kwargs)
        config.validate()
        return config

    def resolved_num_threads(self) -> int:
        if self.num_threads is not None:
            return self.num_threads
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
