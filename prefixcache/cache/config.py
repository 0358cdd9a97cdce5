"""The prefix cache's options: one frozen dataclass, handed down whole to the cache.

:class:`prefixcache.config.EngineConfig` inherits these fields, so each option is declared once
(with its help text in the field's metadata, from which the command-line flags are generated) and
the engine passes its config to :class:`~prefixcache.cache.kv_cache_manager.KVCacheManager` as is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prefixcache.cache.hashing import HASH_ALGOS
from prefixcache.errors import InvalidInputError

DEFAULT_BLOCK_SIZE = 16  # tokens
DEFAULT_CACHE_TTL_S = 300.0
DEFAULT_KV_DISK_BYTES = 10 << 30
DEFAULT_KV_REDIS_TTL_S = 3600.0
DEFAULT_MAX_PINNED_FRACTION = 0.5  # of the pool (cache/pins.py)
DEFAULT_MAX_RETAINED_DISK_FRACTION = 0.5  # of --kv-disk-bytes (cache/tiers/disk.py)


@dataclass(frozen=True)
class CacheConfig:
    """Options of the paged KV pool's prefix cache.

    Raises:
        InvalidInputError: from :meth:`validate`, naming the invalid field.
    """

    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata={"help": "tokens per KV block"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "look up and cache full blocks"})
    hash_algo: str = field(default="xxh64", metadata={"help": "block hash", "choices": HASH_ALGOS})
    hash_seed: int | None = field(default=None, metadata={
        "help": "mixed into every block hash; fix it for keys reproducible across processes "
                "(default: random per process)"})
    hash_seed_file: str | None = field(default=None, metadata={
        "help": "file whose bytes (>= 16) are the hash seed: a deployment secret shared by the processes "
                "that share KV tiers (instead of --hash-seed)"})
    eviction_policy: str = field(default="lru", metadata={
        "help": "which free cached block is evicted first (a name registered in cache/eviction.py)"})
    cache_ttl_s: float = field(default=DEFAULT_CACHE_TTL_S, metadata={
        "help": "ttl policy: free cached blocks idle longer than this many seconds expire"})
    enable_partial_block_reuse: bool = field(default=True, metadata={
        "help": "copy the matching first slots of a cached block instead of recomputing them"})
    cost_half_life_s: float = field(default=60.0, metadata={
        "help": "cost policy: a hit counts half as much after this many seconds"})
    cost_attention_tokens: float = field(default=2048.0, metadata={
        "help": "cost policy: context length (tokens) at which attention costs as much per token as "
                "the rest of a layer"})
    kv_disk_dir: str | None = field(default=None, metadata={
        "help": "KV tier on local disk: full blocks are written here and reused after a restart "
                "(needs --hash-seed or --hash-seed-file)"})
    kv_disk_bytes: int = field(default=DEFAULT_KV_DISK_BYTES, metadata={
        "help": "size cap of --kv-disk-dir, e.g. 20GiB; least recently used entries go first (default: 10GiB)",
        "memory": True})
    kv_redis_url: str | None = field(default=None, metadata={
        "help": "KV tier shared through Redis, redis://host:port/db (needs --hash-seed or --hash-seed-file)"})
    kv_redis_ttl_s: float = field(default=DEFAULT_KV_REDIS_TTL_S, metadata={
        "help": "seconds a Redis tier entry lives after its last store or hit"})
    max_pinned_fraction: float = field(default=DEFAULT_MAX_PINNED_FRACTION, metadata={
        "help": "most of the KV pool that cache breakpoints (cache_control) may pin, a fraction in [0, 1); "
                "a request over it pins the head that fits (0: pins off)"})
    max_retained_disk_fraction: float = field(default=DEFAULT_MAX_RETAINED_DISK_FRACTION, metadata={
        "help": "most of --kv-disk-bytes that prompt_cache_retention '24h' may keep out of the disk tier's "
                "eviction, a fraction in [0, 1); a request over it keeps the head that fits (0: '24h' refused)"})

    def validate(self) -> None:
        """Checks every field.

        Raises:
            InvalidInputError: naming the first invalid field.
        """
        check_int("block_size", self.block_size, 1)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if self.hash_algo not in HASH_ALGOS:
            raise InvalidInputError("hash_algo", f"hash_algo must be one of {HASH_ALGOS}, got {self.hash_algo!r}")
        if self.hash_seed is not None:
            check_int("hash_seed", self.hash_seed, 0, 2**64 - 1)
        if not isinstance(self.eviction_policy, (str, type)):
            raise InvalidInputError("eviction_policy", f"eviction_policy must be a policy name, "
                                                       f"got {self.eviction_policy!r}")
        check_positive_float("cache_ttl_s", self.cache_ttl_s)
        check_bool("enable_partial_block_reuse", self.enable_partial_block_reuse)
        check_positive_float("cost_half_life_s", self.cost_half_life_s)
        check_positive_float("cost_attention_tokens", self.cost_attention_tokens)
        if isinstance(self.max_pinned_fraction, bool) or not isinstance(self.max_pinned_fraction, (int, float)) \
                or not 0 <= self.max_pinned_fraction < 1:
            raise InvalidInputError("max_pinned_fraction", f"max_pinned_fraction must be a number in [0, 1), "
                                                           f"got {self.max_pinned_fraction!r}")
        if isinstance(self.max_retained_disk_fraction, bool) \
                or not isinstance(self.max_retained_disk_fraction, (int, float)) \
                or not 0 <= self.max_retained_disk_fraction < 1:
            raise InvalidInputError("max_retained_disk_fraction", f"max_retained_disk_fraction must be a number in "
                                                                  f"[0, 1), got {self.max_retained_disk_fraction!r}")
        self._validate_tiers()

    def _validate_tiers(self) -> None:
        """The KV tier fields and the hash seed they need (keys must be the same in every process)."""
        for name in ("hash_seed_file", "kv_disk_dir", "kv_redis_url"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidInputError(name, f"{name} must be a non-empty string, got {value!r}")
        if self.hash_seed is not None and self.hash_seed_file is not None:
            raise InvalidInputError("hash_seed_file", "give hash_seed or hash_seed_file, not both")
        check_int("kv_disk_bytes", self.kv_disk_bytes, 1)
        check_positive_float("kv_redis_ttl_s", self.kv_redis_ttl_s)
        if self.kv_redis_url is not None and not self.kv_redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise InvalidInputError("kv_redis_url", f"kv_redis_url must start with redis://, rediss:// or unix://, "
                                                    f"got {self.kv_redis_url!r}")
        if self.kv_redis_url is not None:
            from redis.connection import parse_url  # redis-py's own reading of the URL (a light import)

            try:
                parse_url(self.kv_redis_url)
            except ValueError as e:  # e.g. a port that is not a number: found at the first connect, after the load
                raise InvalidInputError("kv_redis_url", f"kv_redis_url {self.kv_redis_url!r}: {e}") from None
        tiered = self.kv_disk_dir is not None or self.kv_redis_url is not None
        if tiered and self.hash_seed is None and self.hash_seed_file is None:
            raise InvalidInputError("hash_seed", "KV tiers (kv_disk_dir, kv_redis_url) need hash_seed or "
                                                 "hash_seed_file: the default seed is random per process, so no "
                                                 "other process (or restart) could ever hit their entries")


def check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    """Raises :class:`InvalidInputError` unless ``value`` is an int (not a bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidInputError(name, f"{name} must be an integer {bounds}, got {value!r}")


def check_bool(name: str, value: object) -> None:
    """Raises :class:`InvalidInputError` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise InvalidInputError(name, f"{name} must be a bool, got {value!r}")


def check_positive_float(name: str, value: object) -> None:
    """Raises :class:`InvalidInputError` unless ``value`` is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidInputError(name, f"{name} must be a finite number > 0, got {value!r}")
