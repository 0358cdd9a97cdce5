"""Instructions per prefix-cache lookup, for a repeatable before/after comparison.

Timing the lookup on a shared 2-core machine varies by 2x run to run; instruction counts don't.
Run the fixed-work loop under callgrind twice (10 and 110 calls) and take the difference::

    for k in 10 110; do PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        .venv/bin/python benchmarks/hash_lookup_instructions.py lookup $k 2>&1 | grep "I   refs"; done

``(refs(110) - refs(10)) / 100`` is the instructions of one ``get_computed_blocks`` of a fully cached
4096-token prompt at block size 16 (``lookup``), or of hashing a new request's blocks plus that
lookup (``total``). The package's ``__init__`` (and so torch) is bypassed: only the cache modules load.
Copied into a checkout of a3ac16b (before the architecture step) it measures that code the same way.
"""

from __future__ import annotations

import os
import random
import sys
import types

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_PKG = types.ModuleType("prefixcache")
_PKG.__path__ = [os.path.join(_ROOT, "prefixcache")]
sys.modules["prefixcache"] = _PKG

from prefixcache.cache.hashing import BlockHasher, make_root_key  # noqa: E402
from prefixcache.cache.kv_cache_manager import KVCacheManager  # noqa: E402
from prefixcache.sampling_params import SamplingParams  # noqa: E402

try:
    from prefixcache.cache.config import CacheConfig
    from prefixcache.request import Request
except ImportError:  # the code before the architecture step (a3ac16b): copy this file there to compare
    from prefixcache.engine.request import Request

    CacheConfig = None


def main(mode: str, num_calls: int, block_size: int = 16, num_tokens: int = 4096) -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(100, 49000) for _ in range(num_tokens)]
    hasher, root = BlockHasher(block_size), make_root_key(b"\0" * 32)
    params = SamplingParams(temperature=0, max_tokens=1)
    num_blocks = num_tokens // block_size + 2
    manager = (KVCacheManager(num_blocks, block_size) if CacheConfig is None
               else KVCacheManager(num_blocks, CacheConfig(block_size=block_size)))
    first = Request("prime", tokens, params, hasher, root)
    manager.allocate_slots(first, num_tokens)
    manager.free(first)  # cached, hit-able
    probe = Request("probe", tokens, params, hasher, root)
    if manager.get_computed_blocks(probe)[1] != (num_tokens - 1) // block_size * block_size:
        raise RuntimeError("the prompt is not fully cached")
    for _ in range(num_calls):
        if mode == "lookup":
            manager.get_computed_blocks(probe)
        else:
            manager.get_computed_blocks(Request("r", tokens, params, hasher, root))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
