"""Engine configuration: frozen dataclasses, each option declared once.

:class:`EngineConfig` is what users build (``LLM(**options)``, ``EngineConfig.from_kwargs``, the
``serve`` flags, which are generated from its fields and their ``metadata["help"]``). It inherits
the fields of the sub-configs that lower layers take whole: :class:`CacheConfig` (the prefix
cache) and :class:`SchedulerConfig` (the scheduler), so ``config.block_size`` is the one
declaration and the engine hands ``config`` itself to the cache manager and the scheduler.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefixcache.cache.config import CacheConfig, check_int, check_positive_float
from prefixcache.cache.eviction import EVICTION_POLICIES
from prefixcache.cache.kv_events import KVEventsConfig
from prefixcache.errors import InvalidInputError
from prefixcache.kernels.cpu_features import TIERS, auto_format, cpu_has, format_unavailable_reason

# a model's attention_dtype (prefixcache.layers.attention.attention_dtype): float products, or the paged kernel's
# AVX2 form with int8 products
ATTENTION_DTYPES = ("float", "int8")
# why "int8" can't run, said before the load (EngineConfig.validate) and by the model (set_attention_dtype) alike
INT8_ATTENTION_NEEDS_KERNEL_FORMAT = ("runs on the paged kernel, which a float32 model without int8 weights doesn't "
                                      "take (its GEMMs round by batch size): give --dtype bfloat16 or --quantization "
                                      "int8 too")
INT8_ATTENTION_NEEDS_AVX2 = ("needs the paged kernel's AVX2 form: a CPU with AVX2, FMA and F16C (PREFIXCACHE_KERNELS "
                             "may cap it) and its extension built, head_dim a multiple of 32 up to 256, at most 48 "
                             "query heads per KV head")

if TYPE_CHECKING:
    import torch

# The dtype names users give: torch's names of the dtypes weights and K/V are computed in. (No torch
# import here: the command line reads this module before it decides what it needs.)
DTYPES = ("float32", "bfloat16", "float16")
# How the linear layers' weights are stored and multiplied: "none" = in ``dtype``; "int8" = int8
# weights × per-token int8 activations, exact int32 accumulation (prefixcache.layers.quant); "int4" =
# a bfloat16 model whose generated tokens run the projections on 4-bit weights (groups of 32), its prompt
# tokens on bf16; "int4-int8" = int4's generated tokens with int8's products for prompt tokens.
QUANTIZATIONS = ("none", "int8", "int4", "int4-int8")
# The formats whose generated tokens run int4's C++ decoder (blocks holding one get their own key; no LoRA)...
INT4_DECODER_FORMATS = ("int4", "int4-int8")
# ... and those whose (prompt) rows run int8 W8A8 products (no bf16 GEMM).
W8A8_FORMATS = ("int8", "int4-int8")
DEFAULT_MODEL = "smollm2-135m"
GEMMA3_MODEL = "gemma3-270m"  # Gemma 3 270M: local (sliding-window) and global layers
BUILTIN_MODELS = (DEFAULT_MODEL, GEMMA3_MODEL)  # names prefixcache.models.fetch downloads and converts
# built-in models whose "auto" format is float32: Gemma 3 runs bf16 and the int formats when named, but no
# other format's quality against float32 is measured for "auto" to pick
FLOAT32_ONLY_MODELS = (GEMMA3_MODEL,)
# Waiting-queue admission orders (prefixcache.engine.sched_policy holds their classes): fcfs = vLLM's
# default; lpm = under memory pressure longest cached prefix first, shared uncached prefixes grouped,
# starvation bounded (arrival order otherwise).
SCHEDULING_POLICIES = ("fcfs", "lpm")
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30  # 1 GiB when neither num_blocks nor a budget is given


MAX_NUM_THREADS = 4096  # torch CPU threads; far past any machine's cores (2**31 overflowed torch)


@dataclass(frozen=True)
class SchedulerConfig:
    """Options of the continuous-batching scheduler."""

    max_num_seqs: int = field(default=32, metadata={"help": "requests running at once"})
    max_num_batched_tokens: int = field(default=2048, metadata={
        "help": "tokens per forward pass (prefill chunks + decodes)"})
    long_prefill_token_threshold: int = field(default=256, metadata={
        "help": "while short requests wait (prompts of at most this many tokens, together at most this many), "
                "running prefills leave that much of each step to them: a long prompt being prefilled doesn't "
                "hold up a short one for its whole prefill (0 = no reserve)"})
    scheduling_policy: str = field(default="lpm", metadata={
        "help": "waiting-queue order within a request priority: fcfs (arrival) or lpm (under memory pressure "
                "longest cached prefix first, shared prefixes computed once, starvation bounded; otherwise arrival; "
                "docs/scheduling.md)",
        "choices": SCHEDULING_POLICIES})
    scheduling_max_wait_s: float = field(default=30.0, metadata={
        "help": "lpm: a request waiting longer than this (seconds) goes first"})
    scheduling_max_overtakes: int = field(default=64, metadata={
        "help": "lpm: a request overtaken by this many later arrivals goes first (0 = arrival order)"})
    scheduling_pressure_steps: int = field(default=64, metadata={
        "help": "lpm: reorder only within this many steps (steps with a waiting queue) after the pool evicted "
                "a cached block to make room; otherwise arrival order, as fcfs"})

    def validate(self) -> None:
        """Raises :class:`InvalidInputError` naming the first invalid field."""
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidInputError("scheduling_policy", f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                                                         f"got {self.scheduling_policy!r}")
        check_positive_float("scheduling_max_wait_s", self.scheduling_max_wait_s)
        check_int("scheduling_max_overtakes", self.scheduling_max_overtakes, 0)
        check_int("scheduling_pressure_steps", self.scheduling_pressure_steps, 1)


@dataclass(frozen=True)
class EngineConfig(CacheConfig, SchedulerConfig):
    """Options of :class:`prefixcache.engine.llm_engine.LLMEngine` (and ``LLM``): the model and
    pool options below plus every :class:`CacheConfig` and :class:`SchedulerConfig` field.

    Raises:
        InvalidInputError: from :meth:`validate`, naming the invalid field.
    """

    model: str = field(default=DEFAULT_MODEL, metadata={"help": "built-in name, HF directory or .gguf file"})
    dtype: str = field(default="float32", metadata={
        "help": "weights and KV dtype; auto: this CPU's fastest format within 1 % perplexity of float32, with "
                "--quantization auto (docs/weight-formats-and-kernels.md); float16 on CUDA, or a CPU with AVX512-FP16",
        "choices": ("auto", *DTYPES), "cli_default": "auto"})
    quantization: str = field(default="none", metadata={
        "help": "linear-layer weights: none (in --dtype), int8 (int8 weights x per-token int8 activations, "
                "SmoothQuant-smoothed, exact int32 sums: batch-invariant), int4 (with --dtype bfloat16: generated tokens' projections "
                "on 4-bit weights in our C++ decoder, prompt tokens' on bf16; no LoRA) or int4-int8 (int4's "
                "generated tokens, int8's prompt tokens; docs/weight-formats-and-kernels.md) or auto (this CPU's fastest "
                "format, with --dtype auto; with a --dtype named, the fastest for it: float32 + int8 on AVX2 and "
                "AVX-512, so give --quantization none for plain float32)", "choices": ("auto", *QUANTIZATIONS), "cli_default": "auto"})
    attention_dtype: str = field(default="float", metadata={
        "help": "the prompt attention's products: float (the KV dtype's, float32 sums) or int8 (q, K, p and V "
                "rounded to int8 with per-row scales, exact integer sums, on the paged kernel's AVX2 form: about "
                "1.4x faster attention on AVX2 CPUs for a small quality cost; bfloat16 or an int8 format; "
                "docs/weight-formats-and-kernels.md); auto: int8 for a bfloat16 model where the CPU has AVX2 but no "
                "AVX512-BF16, else float", "choices": ("auto", *ATTENTION_DTYPES), "cli_default": "auto"})
    device: str | None = field(default=None, metadata={"help": "cpu, cuda, ... (default: CUDA if present)"})
    num_blocks: int | None = field(default=None, metadata={
        "help": "KV pool size in blocks; overrides --kv-cache-memory"})
    kv_cache_memory_bytes: int | None = field(default=None, metadata={
        "help": "KV pool budget in bytes, e.g. 2GiB (binary; 2GB is 2*10^9) (default 1GiB)", "flag": "--kv-cache-memory", "memory": True})
    max_model_len: int | None = field(default=None, metadata={"help": "context limit in tokens (default: the model's)"})
    num_threads: int | None = field(default=None, metadata={"help": "torch CPU threads (default: the available cores)"})
    seed: int = field(default=0, metadata={"help": "RNG seed of requests that give no seed of their own"})
    kv_events_config: KVEventsConfig | None = field(default=None, metadata={
        "help": "KV cache events over ZeroMQ in vLLM's format, vLLM's JSON: "
                '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", '
                '"topic": "kv", "buffer_steps": 10000}\' (default: off; docs/kv-events-and-scale-out.md)', "json": True})

    def __post_init__(self) -> None:
        # kv_events_config may be given as JSON text (the flag) or a mapping; kept as a KVEventsConfig.
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        if "auto" in (self.dtype, self.quantization):  # resolved once: every reader (and the cache key) sees the format
            dtype, quantization = (("float32", "none") if not self._on_cpu() or self.model in FLOAT32_ONLY_MODELS
                                   else auto_format(self.dtype, self.quantization))
            object.__setattr__(self, "dtype", self.dtype if self.dtype != "auto" else dtype)
            object.__setattr__(self, "quantization", self.quantization if self.quantization != "auto" else quantization)
        if self.attention_dtype == "auto":  # after the format: it decides whether the paged kernel runs
            object.__setattr__(self, "attention_dtype", self._auto_attention_dtype())

    def _on_cpu(self) -> bool:
        """Whether the model runs on the CPU (``device`` cpu, or None on a machine without CUDA)."""
        if self.device is not None:
            return isinstance(self.device, str) and self.device.startswith("cpu")
        import torch

        return not torch.cuda.is_available()

    def validate(self) -> None:
        """Checks every field.

        Raises:
            InvalidInputError: naming the first invalid field.
        """
        if not isinstance(self.model, str) or not self.model:
            raise InvalidInputError("model", f"model must be a non-empty string, got {self.model!r}")
        if self.dtype not in DTYPES:
            raise InvalidInputError("dtype", f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise InvalidInputError("quantization", f"quantization must be one of {QUANTIZATIONS}, "
                                                    f"got {self.quantization!r}")
        if self.quantization in INT4_DECODER_FORMATS and self.dtype != "bfloat16":
            raise InvalidInputError("quantization", f"quantization={self.quantization!r} runs a bfloat16 model "
                                                    f"(generated tokens on 4-bit copies of its weights): give "
                                                    f"dtype='bfloat16' (--dtype bfloat16), got dtype={self.dtype!r}")
        if self.attention_dtype not in ATTENTION_DTYPES:
            raise InvalidInputError("attention_dtype", f"attention_dtype must be one of {ATTENTION_DTYPES}, "
                                                       f"got {self.attention_dtype!r}")
        if self.device is not None and (not isinstance(self.device, str) or not self.device):
            raise InvalidInputError("device", f"device must be a torch device name such as 'cpu' or 'cuda', "
                                              f"got {self.device!r}")
        self._check_format_runs_here()
        self._check_attention_dtype_runs_here()
        for name in ("num_blocks", "kv_cache_memory_bytes", "max_model_len"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        if self.num_threads is not None:  # torch.set_num_threads overflows at 2**31, after the load
            check_int("num_threads", self.num_threads, 1)
            if self.num_threads > MAX_NUM_THREADS:
                raise InvalidInputError("num_threads", f"num_threads must be at most {MAX_NUM_THREADS} (torch CPU "
                                                       f"threads), got {self.num_threads}")
        check_int("seed", self.seed, -(2**63), 2**64 - 1)
        CacheConfig.validate(self)
        if isinstance(self.eviction_policy, str) and self.eviction_policy not in EVICTION_POLICIES:
            raise InvalidInputError("eviction_policy", f"eviction_policy must be one of "
                                                       f"{sorted(EVICTION_POLICIES)}, got {self.eviction_policy!r}")
        SchedulerConfig.validate(self)

    def _check_format_runs_here(self) -> None:
        """A weight format this CPU can't run (or would run pathologically slowly) is refused now, before
        anything loads, in one line that says what to use instead (not a crash inside oneDNN at load)."""
        reason = format_unavailable_reason(self.dtype, self.quantization)
        if reason is not None and self._on_cpu():  # device None: "CUDA if present", where the CPU doesn't matter
            raise InvalidInputError(reason.split("=", 1)[0], reason)

    def _auto_attention_dtype(self) -> str:
        """``attention_dtype="auto"``: int8 where a prompt's attention runs the paged kernel's AVX2 form anyway (a
        CPU with AVX2, FMA and F16C but no AVX512-BF16, as ``PREFIXCACHE_KERNELS`` caps it) for a bfloat16 pool (not
        a model kept in float32): there its int8 products are the faster (0.85-0.90x the cold and warm TTFT of float
        attention in bfloat16 + int4-int8) and cost little (perplexity within the quality table's 1 %, greedy
        agreement with float32 as float attention's; docs/benchmarks.md); float elsewhere: AMX and AVX512-BF16 CPUs
        run faster bf16 forms, and a float32 pool (float32 + int8) lost most of its greedy agreement with float32."""
        wanted = (self.dtype == "bfloat16" and cpu_has(*TIERS["avx2"]) and not cpu_has("avx512_bf16")
                  and self.model not in FLOAT32_ONLY_MODELS)
        return "int8" if wanted and self._on_cpu() else "float"

    def _check_attention_dtype_runs_here(self) -> None:
        """``attention_dtype="int8"`` where it can't run is refused before the model loads, as the model would
        refuse it (``PagedAttentionModel.set_attention_dtype``; the head shape is checked there)."""
        if self.attention_dtype != "int8":
            return
        if not self._on_cpu():
            raise InvalidInputError("attention_dtype", "attention_dtype='int8' runs on the CPU's paged kernel only; "
                                                       "use attention_dtype='float' on another device")
        if self.dtype == "float32" and self.quantization == "none":
            raise InvalidInputError("attention_dtype", f"attention_dtype='int8' {INT8_ATTENTION_NEEDS_KERNEL_FORMAT}; "
                                                       "use attention_dtype='float'")
        if not cpu_has(*TIERS["avx2"]):
            raise InvalidInputError("attention_dtype", f"attention_dtype='int8' {INT8_ATTENTION_NEEDS_AVX2}; "
                                                       "use attention_dtype='float'")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Builds a validated config.

        Raises:
            InvalidInputError: an unknown keyword (the message lists the valid ones) or a bad value.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidInputError(unknown[0], f"unknown engine option(s) {unknown}; valid options: {sorted(names)}")
        config = cls(**kwargs)
        config.validate()
        return config

    @classmethod
    def choices(cls, name: str) -> tuple[str, ...] | None:
        """The allowed values of field ``name`` when they form a fixed set (for ``--help``), else None."""
        if name == "eviction_policy":
            return tuple(sorted(EVICTION_POLICIES))
        return next(f.metadata.get("choices") for f in dataclasses.fields(cls) if f.name == name)

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a torch dtype."""
        import torch

        return getattr(torch, self.dtype)

    def resolved_num_threads(self) -> int:
        """``num_threads``, or the cores this process may run on."""
        if self.num_threads is not None:
            return self.num_threads
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
