"""What one ``prefixcache bench`` run is asked to do: :class:`BenchOptions` and the speed workload's
:class:`SpeedSizes`, kept apart from the runner so that ``bench --help`` and the flag checks read
their defaults without importing torch and the engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prefixcache.bench.workloads import DEFAULT_NUM_TURNS, SPEED_PREFIX_TOKENS, WORKLOAD_NAMES
from prefixcache.cache.config import DEFAULT_BLOCK_SIZE
from prefixcache.config import DEFAULT_MODEL

SPEED = "speed"  # --workload speed: prefixcache vs transformers vs llama.cpp (prefixcache.bench.speed)


def check_positive(values: Iterable[tuple[str, object]]) -> None:
    """Raises ValueError naming the first ``(name, value)`` whose value is not an integer >= 1."""
    for name, v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


@dataclass(frozen=True)
class SpeedSizes:
    """Sizes of the speed workload (defaults: the issue's)."""

    prefix_tokens: int = SPEED_PREFIX_TOKENS  # shared system prompt, tokens
    num_requests: int = 10  # prompts over the shared prefix: 1 cold + (num_requests - 1) warm
    max_tokens: int = 32  # tokens per request of the batch run
    decode_tokens: int = 128  # single-sequence decode
    long: bool = False  # also measure long context (--speed-long)
    long_prompt_tokens: int = 8000
    long_decode_tokens: int = 16

    def validate(self, max_model_len: int) -> None:
        """Raises ValueError naming the first bad size (a long request must fit ``max_model_len``)."""
        for name, low in (("prefix_tokens", 1), ("num_requests", 2), ("max_tokens", 1), ("decode_tokens", 2),
                          ("long_prompt_tokens", 1), ("long_decode_tokens", 2)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"speed {name} must be an integer >= {low}, got {v!r}")
        if self.long and self.long_prompt_tokens + self.long_decode_tokens > max_model_len:
            raise ValueError(f"speed long_prompt_tokens + long_decode_tokens must be <= the model's context "
                             f"{max_model_len}, got {self.long_prompt_tokens} + {self.long_decode_tokens}")


@dataclass
class BenchOptions:
    """Options of one benchmark run (the CLI's flags)."""

    model: str = DEFAULT_MODEL
    workloads: tuple[str, ...] = WORKLOAD_NAMES
    num_requests: int | None = None  # per round; None = each workload's default
    max_tokens: int = 16  # tokens generated per request
    num_turns: int = DEFAULT_NUM_TURNS  # multi-turn: turns per chat
    block_size: int = DEFAULT_BLOCK_SIZE
    text_scale: float = 1.0  # fraction of the long shared texts kept (quick runs, tests)
    num_threads: int = 2
    repeats: int = 1  # throughput runs per mode (median wall); no-sharing uses at least 3
    cold_samples: int = 2  # requests timed alone on an empty cache
    skip_hf: bool = False
    micro: bool = True  # run the hash + lookup micro-benchmark
    micro_block_sizes: tuple[int, ...] = (16, 64)
    micro_seconds: float = 0.3  # per measurement
    out: str | None = "bench_results"  # None: write nothing
    plots: bool = True
    engine_options: dict = field(default_factory=dict)  # more EngineConfig fields for our engines
    speed: SpeedSizes = field(default_factory=SpeedSizes)  # sizes of the `speed` workload
    skip_llamacpp: bool = False  # speed: leave llama.cpp out
    skip_vllm: bool = False  # speed: leave vLLM's CPU build out (measured when .venv-field/vllm is installed)
    skip_openvino: bool = False  # speed: leave OpenVINO GenAI out (measured when .venv-field/openvino is installed)
