"""The benchmark report's goal rows, and the speed table's targets per model.

A goal row is what the issue asks for, the measured value, and whether it is met. The speed targets belong to
a model: the default model's (SmolLM2-135M) are absolute numbers (cold TTFT <= 1.5 s, ...) beside ratios to
transformers and llama.cpp; Gemma 3 270M's are ratios to the llama.cpp column of the same run alone (same
machine, threads and prompts), so a slower or faster machine moves both sides. A model with no targets of its
own gets none: another model's absolute numbers would judge it by that model's size.
"""

from __future__ import annotations

from prefixcache.config import DEFAULT_MODEL, GEMMA3_MODEL

# the speed table's engine columns (prefixcache.bench.speed measures them)
OURS, HF, LLAMA_CPP = "prefixcache", "transformers", "llama.cpp"

# per model: (metric, None = our value alone, else ours / that engine's, "<=" or ">=", target)
SPEED_TARGETS: dict[str, tuple[tuple[str, str | None, str, float], ...]] = {
    DEFAULT_MODEL: (
        ("warm_ttft_s", None, "<=", 0.08), ("warm_ttft_s", HF, "<=", 0.3), ("warm_ttft_s", LLAMA_CPP, "<=", 0.3),
        ("batch_output_tokens_per_s", None, ">=", 120), ("batch_output_tokens_per_s", LLAMA_CPP, ">=", 5),
        ("batch_output_tokens_per_s", HF, ">=", 8),
        ("decode_tokens_per_s", None, ">=", 100),
        ("cold_ttft_s", None, "<=", 1.5), ("cold_ttft_s", HF, "<=", 0.5),
        ("long_prefill_s", None, "<=", 12), ("long_decode_ms_per_token", None, "<=", 30),
        ("on_over_off", None, ">=", 0.99),
    ),
    GEMMA3_MODEL: (
        ("warm_ttft_s", LLAMA_CPP, "<=", 0.5),  # warm TTFT at most half llama.cpp's
        ("decode_tokens_per_s", LLAMA_CPP, ">=", 1.0),  # single-sequence decode at least llama.cpp's
    ),
}


def speed_targets(model: str) -> tuple[tuple[str, str | None, str, float], ...]:
    """The speed table's targets for ``model`` (a built-in model's name; any other model has none)."""
    return SPEED_TARGETS.get(model, ())


def goal(name: str, value: float | None, target: str, met: bool | None) -> dict:
    """One row of the report's goals table (``met`` None: not measured in this run)."""
    return {"goal": name, "value": value, "target": target, "met": met}
