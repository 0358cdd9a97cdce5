"""LoRA adapters of one engine: loaded on first use, reloaded when their files change, and the
cache chains of replaced adapter weights invalidated at once.

An adapter's content digest is part of every cache key of its requests (adapters are keyed by
content, not by name: two adapters named alike with different weights never share blocks). When an
adapter directory is reloaded with new weights, no new request can hit the old weights' blocks, so
they are evicted now (reason ``"invalidated"``) instead of waiting for their LRU turn.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from prefixcache.cache.hashing import root_key_adapter_digest
from prefixcache.cache.kv_cache_manager import KVCacheManager
from prefixcache.errors import InvalidInputError
from prefixcache.layers.lora import LoRAAdapter, LoRARequest, load_lora_adapter


def check_lora_supported(model: nn.Module) -> None:
    """Refuses any adapter for a model whose forward pass adds no LoRA delta (class attribute
    ``supports_lora = False``), here rather than in a step: the request (or the server's
    ``--lora-modules`` at startup, which loads every adapter through :meth:`LoRAManager.get`) fails.

    Raises:
        InvalidInputError: (field ``lora``) naming the model class.
    """
    if not getattr(model, "supports_lora", True):
        raise InvalidInputError("lora", f"lora: {type(model).__name__} does not support LoRA adapters; "
                                        "send the request without one")


class LoRAManager:
    """Loads and caches the adapters requests name.

    Args:
        model: the base model the adapters apply to.
        kv_cache_manager: whose chains are invalidated when an adapter's weights change.
    """

    def __init__(self, model: nn.Module, kv_cache_manager: KVCacheManager) -> None:
        self.model = model
        self.kv_cache_manager = kv_cache_manager
        # Loaded adapters by resolved directory: (files' mtime/size signature, adapter).
        self._adapters: dict[Path, tuple[tuple, LoRAAdapter]] = {}

    def get(self, lora: LoRARequest) -> LoRAAdapter:
        """The loaded adapter for ``lora``, (re)loaded when its files are new or changed on disk.

        Raises:
            InvalidInputError: (field ``lora``) a model that runs no adapter (``supports_lora``
                False: Gemma 3), not a LoRARequest, an unreadable directory, or an adapter that can't
                be loaded for this model.
        """
        check_lora_supported(self.model)
        if not isinstance(lora, LoRARequest):
            raise InvalidInputError("lora", f"lora must be a LoRARequest, got {type(lora).__name__}")
        path = Path(lora.lora_path).expanduser().resolve()
        try:
            signature = tuple((f.stat().st_mtime_ns, f.stat().st_size) for f in sorted(path.iterdir()))
        except OSError as e:
            raise InvalidInputError("lora", f"lora: cannot read adapter directory {lora.lora_path!r}: {e}") from e
        cached = self._adapters.get(path)
        if cached is not None and cached[0] == signature:
            return cached[1]
        try:
            adapter = load_lora_adapter(path, self.model, lora.lora_name)
        except ValueError as e:
            raise InvalidInputError("lora", str(e)) from e
        self._adapters[path] = (signature, adapter)
        if cached is not None:
            self._invalidate(cached[1].digest)
        return adapter

    def _invalidate(self, old_digest: bytes) -> None:
        """Evicts the free cached chains of replaced adapter weights no loaded adapter still has."""
        if old_digest in {a.digest for _, a in self._adapters.values()}:
            return
        self.kv_cache_manager.invalidate_chains(lambda root_key: root_key_adapter_digest(root_key) == old_digest)
