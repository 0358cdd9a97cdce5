"""prefixcache: LLM inference with a paged KV cache and automatic prefix caching."""

from prefixcache.config import EngineConfig
from prefixcache.layers.lora import LoRARequest
from prefixcache.llm import LLM
from prefixcache.outputs import RequestOutput
from prefixcache.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "EngineConfig", "LoRARequest", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"
