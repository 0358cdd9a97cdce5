"""What the engine flags name, checked before the model loads (``serve``, ``cluster``, ``demo``,
``bench``): the engine would find each only after a load of seconds, some as a traceback.

``--device`` (a CUDA index this machine has), the ``--hash-seed-file``'s secret, a creatable and
writable ``--kv-disk-dir`` (and ``bench --out``), and a KV pool (``--num-blocks``,
``--kv-cache-memory``, ``--block-size``, ``--max-model-len``) that fits the model's context and the
memory it is allocated in, sized from the model's config.json read without its weights (a block
holds every layer's K/V, or one KV-cache group's for a model with sliding-window layers).
Every error is a ValueError naming the flag.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from prefixcache.config import BUILTIN_MODELS, DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig
from prefixcache.errors import InvalidInputError
from prefixcache.host_memory import pool_memory_limit

if TYPE_CHECKING:
    from prefixcache.cache.kv_cache_groups import KVCacheGroups


_DEVICE = re.compile(r"(cpu|cuda)(?::([0-9]+))?")  # what LLMEngine's _resolve_device accepts
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # config.DTYPES' element sizes (torch's element_size)


def check_device(name: str | None) -> None:
    """``--device`` is ``cpu`` or ``cuda[:N]`` (what the engine accepts), and a CUDA device exists
    (torch is imported only for a ``cuda`` device).

    Raises:
        ValueError: naming ``--device``.
    """
    if name is None:
        return
    m = _DEVICE.fullmatch(name)
    if m is None:
        raise ValueError(f"--device: must be 'cpu' or 'cuda[:N]', got {name!r}")
    if m.group(1) == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {name!r}: CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if int(m.group(2) or 0) >= count:
            raise ValueError(f"--device {name!r}: this machine has {count} CUDA device{'s' if count != 1 else ''} "
                             f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})")


def check_hash_seed_file(path: str | None) -> None:
    """``--hash-seed-file`` can be read and holds a secret of >= 16 bytes (what the engine reads).

    Raises:
        ValueError: naming ``--hash-seed-file``.
    """
    if path is None:
        return
    from prefixcache.cache.hashing import hash_seed_bytes

    try:
        hash_seed_bytes(None, path)
    except InvalidInputError as e:  # "hash_seed_file: cannot read ..." / "hash_seed_file '...' must hold ..."
        raise ValueError(e.message.replace("hash_seed_file", "--hash-seed-file", 1)) from None


def check_writable_dir(path: str, flag: str) -> Path:
    """Checks that directory ``path`` can be created (with its parents, as its writer does) and a
    file written in it; what the check created is removed again, so a flag refused later leaves
    nothing behind.

    Returns:
        The directory (``~`` expanded).

    Raises:
        ValueError: ``path`` is an existing file, or can't be created or written; naming ``flag``.
    """
    d = Path(path).expanduser()
    if d.exists() and not d.is_dir():
        raise ValueError(f"{flag}: {path!r} is an existing file, not a directory")
    missing = [p for p in (d, *d.parents) if not p.exists()]  # deepest first
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=d, prefix=".prefixcache-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{flag}: cannot create or write the directory {path!r} ({e.strerror or e})") from None
    finally:
        for p in missing:
            try:
                p.rmdir()
            except OSError:  # not created, or something else wrote into it meanwhile
                pass
    return d


# What a replica's process holds besides its pool and weights (Python, torch, tokenizer, server): a
# `serve` of SmolLM2 with a 442 MB pool has ~1.5 GB resident, of which the weights are 0.54 GB.
REPLICA_PROCESS_BYTES = 512 << 20


@dataclass(frozen=True)
class ModelShape:
    """What sizes a KV block, read from a model's config without loading its weights."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    context: int | None  # max_position_embeddings, tokens
    weights_bytes: int = 0  # the checkpoint's *.safetensors files, bytes (what each replica loads)
    # Layers whose K/V one block holds: one KV-cache group's (prefixcache/cache/kv_cache_groups.py's
    # layers_per_group) for a model with sliding-window layers; None: every layer (one group).
    layers_per_block: int | None = None
    kv_cache_groups: KVCacheGroups | None = None  # the groups of a model with sliding-window layers

    @property
    def block_layers(self) -> int:
        """Layers one pool block holds K/V for (``layers_per_block``, else ``num_layers``)."""
        return self.layers_per_block if self.layers_per_block is not None else self.num_layers


def model_shape(model: str) -> ModelShape | None:
    """The KV shape of ``model`` from its config.json (a built-in model once fetched, a local HF
    directory), without torch, transformers or the weights.

    A config with sliding-window layers (``layer_types``, ``sliding_window``) is cut into KV-cache
    groups as the engine cuts it (:func:`~prefixcache.cache.kv_cache_groups.make_kv_cache_groups`),
    and a block then holds one group's layers: Gemma 3 270M's 18 layers give blocks of 3 layers.

    Returns:
        None when it can't be read cheaply (a built-in model not fetched yet, a .gguf file, an
        unusual config, a Gemma 3 config without ``layer_types``, whose layers transformers derives
        from a pattern): the caller's checks then use a lower bound.
    """
    from prefixcache.cache.kv_cache_groups import layer_specs_from_config, make_kv_cache_groups
    from prefixcache.models import fetch

    builtin = model in BUILTIN_MODELS
    path = fetch.builtin_model_dir(model) if builtin else Path(model).expanduser()
    try:
        if builtin and not fetch.is_complete(path):
            return None
        c = json.loads((path / "config.json").read_text())
        heads = c["num_attention_heads"]
        layers_per_block, hybrid = None, None
        if c.get("layer_types"):
            groups = make_kv_cache_groups(layer_specs_from_config(SimpleNamespace(
                num_hidden_layers=c["num_hidden_layers"], layer_types=c["layer_types"],
                sliding_window=c.get("sliding_window"))))
            layers_per_block, hybrid = (groups.layers_per_group, groups) if groups.is_hybrid else (None, None)
        elif "Gemma3ForCausalLM" in (c.get("architectures") or []):
            return None
        shape = ModelShape(c["num_hidden_layers"], c.get("num_key_value_heads") or heads,
                           c.get("head_dim") or c["hidden_size"] // heads, c.get("max_position_embeddings"),
                           sum(f.stat().st_size for f in path.glob("*.safetensors")), layers_per_block, hybrid)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    return shape if _valid_shape(shape) else None


def _valid_shape(shape: ModelShape) -> bool:
    sizes = (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.context or 1, shape.block_layers)
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes)


def _size(n: int) -> str:
    return f"{n / (1 << 30):,.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):,.1f} MiB"


def kv_block_bytes(shape: ModelShape | None, block_size: int, dtype: str) -> int:
    """Bytes of one KV block: ``kv_cache_bytes_per_block``'s (prefixcache/runner/kv_pool.py, which
    needs torch) 2 x layers x block_size x KV heads x head_dim x element size, where layers are
    those one block holds (:attr:`ModelShape.block_layers`: every layer, or one KV-cache group's,
    as the engine sizes and allocates its pool); with the shape unknown (None), a lower bound: 1
    layer, 1 KV head of dimension 1."""
    per_token = shape.block_layers * shape.num_kv_heads * shape.head_dim if shape is not None else 1
    return 2 * per_token * block_size * _ELEMENT_BYTES[dtype]


def check_kv_pool(config: EngineConfig, shape: ModelShape | None, pool: bool = True, replicas: int = 1,
                  flag: str | None = None) -> None:
    """The KV options against the model (``shape``, None if unknown) and the machine, as the engine
    would find them after the load: ``--block-size`` and ``--max-model-len`` within the model's
    context; with ``pool``, a budget that holds one block and ``replicas`` pools (``--num-blocks``
    blocks each, else the ``--kv-cache-memory`` budget; with ``replicas`` > 1 each also loads the
    weights, counted by their files' size) no larger than the memory they are allocated in
    (:func:`kv_block_bytes`; with the shape unknown, its lower bound): physical memory, a container's
    cgroup limit, or a CUDA device's.

    ``flag`` names the flag a pool that doesn't fit is laid to (default: ``--num-blocks`` or
    ``--kv-cache-memory``, whichever sized it; the bench's cluster sizes its replicas itself and says
    ``--cluster-replicas``).

    Raises:
        ValueError: naming the flag.
    """
    context = shape.context if shape is not None else None
    if context is not None and config.block_size > context:
        raise ValueError(f"--block-size: block_size {config.block_size} is more than the model's context of "
                         f"{context} tokens (its max_position_embeddings): such a block never fills")
    if context is not None and config.max_model_len is not None and config.max_model_len > context:
        raise ValueError(f"--max-model-len: max_model_len {config.max_model_len} is more than the model's context "
                         f"of {context} tokens (its max_position_embeddings); positions beyond it were never trained")
    if not pool:
        return
    per_block = kv_block_bytes(shape, config.block_size, config.dtype)
    at_least = "" if shape is not None else "at least "
    if config.num_blocks is None:
        budget = config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
        if budget < per_block:
            raise ValueError(f"--block-size: one KV block of {config.block_size} tokens takes {at_least}{per_block} "
                             f"bytes, more than the KV pool budget of {budget} bytes (--kv-cache-memory); lower "
                             "--block-size or raise --kv-cache-memory")
        pool_flag, need, what = "--kv-cache-memory", budget - budget % per_block, f"a KV pool budget of {budget} bytes is"
        num_blocks = budget // per_block
    else:
        pool_flag, need, num_blocks = "--num-blocks", config.num_blocks * per_block, config.num_blocks
        what = f"a KV pool of {config.num_blocks} blocks needs {at_least}{need} bytes ({_size(need)}; " \
               f"{at_least}{per_block} bytes per block),"
    if replicas > 1:  # `cluster`: every replica allocates its own pool and loads the weights on this machine
        weights = shape.weights_bytes if shape is not None else 0
        need = (need + weights + REPLICA_PROCESS_BYTES) * replicas
        plus = (f" plus the {weights} bytes of weights ({_size(weights)})" if weights else "") + \
            f" plus {_size(REPLICA_PROCESS_BYTES)} for the process"
        what = what.removesuffix(" is").removesuffix(",") + f"{plus} x {replicas} replicas = {need} bytes ({_size(need)}) is"
    limit = pool_memory_limit(config.device, need)
    if limit is not None:
        raise ValueError(f"{flag or pool_flag}: {what} more than the {limit[0]} bytes ({_size(limit[0])}) of {limit[1]}")
    if shape is not None and shape.kv_cache_groups is not None:  # sliding groups that would hold the whole pool
        too_small = shape.kv_cache_groups.pool_too_small(num_blocks, config.block_size)
        if too_small is not None:
            raise ValueError(f"{flag or pool_flag}: {too_small}")


def check_engine_resources(config: EngineConfig, pool: bool = True, replicas: int = 1) -> None:
    """What the engine options name, checked before the model loads (the engine would find each
    after the load, some as a traceback): ``--device``, ``--hash-seed-file``, ``--kv-disk-dir``
    (creatable and writable, :func:`check_writable_dir`), and :func:`check_kv_pool` against the
    model's config (read without its weights).

    Raises:
        ValueError: naming the flag.
    """
    check_device(config.device)
    check_hash_seed_file(config.hash_seed_file)
    if config.kv_disk_dir is not None:
        check_writable_dir(config.kv_disk_dir, "--kv-disk-dir")
    check_kv_pool(config, model_shape(config.model), pool=pool, replicas=replicas)
