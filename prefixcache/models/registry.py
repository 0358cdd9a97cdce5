"""Maps a checkpoint's `architectures[0]` to our model class."""

from torch import nn

from prefixcache.models.gemma3 import Gemma3ForCausalLM
from prefixcache.models.llama import LlamaForCausalLM

# Immutable mapping: architecture name in config.json -> our class.
_MODEL_CLASSES: tuple[tuple[str, type[nn.Module]], ...] = (
    ("LlamaForCausalLM", LlamaForCausalLM),
    ("Qwen2ForCausalLM", LlamaForCausalLM),
    ("Qwen3ForCausalLM", LlamaForCausalLM),
    ("Gemma3ForCausalLM", Gemma3ForCausalLM),
)


def supported_architectures() -> list[str]:
    """Architecture names we can load, in registry order."""
    return [name for name, _ in _MODEL_CLASSES]


def resolve_model_class(architecture: str) -> type[nn.Module]:
    """Our class for an architecture name.

    Raises:
        ValueError: The architecture is not supported; the message lists the supported ones.
    """
    for name, cls in _MODEL_CLASSES:
        if name == architecture:
            return cls
    raise ValueError(
        f"unsupported model architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
    )
