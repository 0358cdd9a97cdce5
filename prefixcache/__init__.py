"""prefixcache: LLM inference with a paged KV cache and automatic prefix caching.

The public names are imported on first use (PEP 562), so ``import prefixcache.<module>`` (the
command line's ``--version``, ``--help`` and its flag checks) doesn't pay for torch and
transformers until a model is needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixcache.cache.pins import CacheBreakpoint
    from prefixcache.config import EngineConfig
    from prefixcache.layers.lora import LoRARequest
    from prefixcache.llm import LLM
    from prefixcache.outputs import RequestOutput
    from prefixcache.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "CacheBreakpoint", "EngineConfig", "LoRARequest", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
__version__ = "0.1.0"

_MODULES = {
    "CacheBreakpoint": "prefixcache.cache.pins",
    "EngineConfig": "prefixcache.config",
    "LoRARequest": "prefixcache.layers.lora",
    "LLM": "prefixcache.llm",
    "RequestOutput": "prefixcache.outputs",
    "SamplingParams": "prefixcache.sampling_params",
    "StructuredOutputsParams": "prefixcache.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value = getattr(importlib.import_module(_MODULES[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'prefixcache' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
