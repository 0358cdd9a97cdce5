"""Instructions per prefix-cache lookup, for a repeatable before/after comparison.

Timing the lookup on a shared 2-core machine varies by 2x run to run; instruction counts don't.
Run the fixed-work loop under callgrind twice (10 and 60 calls) and take the difference::

    for k in 10 60; do valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        .venv/bin/python scripts/bench_lookup_instructions.py lookup $k 2>&1 | grep "I   refs"; done

``(refs(60) - refs(10)) / 50`` is the instructions of one ``get_computed_blocks`` of a fully cached
4096-token prompt at block size 16 (``lookup``), or of hashing a new request's blocks plus that
lookup (``total``). The package's ``__init__`` (and so torch) is bypassed: only the cache modules load.
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

from prefixcache.cache.config import CacheConfig  # noqa: E402
from prefixcache.cache.hashing import BlockHasher, make_root_key  # noqa: E402
from prefixcache.cache.kv_cache_manager import KVCacheManager  # noqa: E402
from prefixcache.request import Request  # noqa: E402
from prefixcache.sampling_params import SamplingParams  # noqa: E402


def main(mode: str, num_calls: int, block_size: int = 16, num_tokens: int = 4096) -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(100, 49000) for _ in range(num_tokens)]
    hasher, root = BlockHasher(block_size), make_root_key(b"\0" * 32)
    params = SamplingParams(temperature=0, max_tokens=1)
    manager = KVCacheManager(num_tokens // block_size + 2, CacheConfig(block_size=block_size))
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
