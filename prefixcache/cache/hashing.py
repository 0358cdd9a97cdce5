"""Chained block hashes for automatic prefix caching.

A request's tokens are cut into full blocks of ``block_size`` tokens. Block ``i`` gets

    h_i = H(h_{i-1} ‖ token_ids_of_block_i ‖ extra_keys)        h_{-1} = H(root_key)

so equal hashes mean equal *whole* prefixes (the idea of vLLM v1's ``hash_block_tokens``).
The root key serialises everything outside the tokens that changes K/V: the model fingerprint
and the request's ``cache_salt``, plus a hash seed. ``extra_keys`` carries a tenant namespace
(:func:`tenant_extra_key`) on every block except those lying entirely inside an operator-approved
shared prefix, so a tenant's blocks beyond the public prefix never match another tenant's. The seed is random per process unless the
user fixes it (``hash_seed``), so nobody outside the process can precompute block hashes to aim
collisions at (vLLM's ``PYTHONHASHSEED``-style fix for its predictable ``NONE_HASH``); a fixed
seed makes keys reproducible across processes. Only full blocks are hashed; a partial tail
block has no hash.

:meth:`BlockHasher.extend` runs its xxh64 loop in C (``chain_hash.c``, the same bytes, ~3x faster per
request) when the extension is built and the digest is the real ``xxhash.xxh64_digest``.

Invariants:
- ``len(block_hashes) == num_tokens // block_size`` after every :meth:`BlockHasher.extend`.
- Every block hash is computed exactly once per request, as its block fills (prompt and decode).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import NewType

import xxhash

from prefixcache.errors import InvalidInputError

try:  # the C form of extend's loop (setup.py; optional: without a compiler, the Python loop below)
    from prefixcache.cache._chain_hash import chain as NATIVE_CHAIN
except ImportError:
    NATIVE_CHAIN = None

BlockHash = NewType("BlockHash", bytes)

def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# The digest behind each hash_algo (tests swap in a constant one to force collisions).
_DIGESTS = {"xxh64": xxhash.xxh64_digest, "sha256": _sha256}
HASH_ALGOS = tuple(_DIGESTS)
_UINT32 = next(code for code in "IL" if array(code).itemsize == 4)

# Drawn once at import: the default hash seed of this process (immutable).
_PROCESS_HASH_SEED = os.urandom(16)


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (4 bytes per token): the form block hashes are
    computed from and hits are verified with (one ``bytes`` compare per chain instead of an int
    compare per token)."""
    packed = array(_UINT32, token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def hash_seed_bytes(hash_seed: int | None, hash_seed_file: str | None = None) -> bytes:
    """The seed mixed into every root key: ``hash_seed`` as 8 bytes, the sha256 of the secret in
    ``hash_seed_file`` (a deployment's key file, shared by the processes that share KV tiers), or
    this process's random seed. None of it depends on ``PYTHONHASHSEED``.

    Raises:
        InvalidInputError: (field ``hash_seed_file``) the file can't be read or holds fewer than 16
            bytes.
    """
    if hash_seed_file is not None:
        try:
            with open(os.path.expanduser(hash_seed_file), "rb") as f:
                secret = f.read()
        except OSError as e:
            raise InvalidInputError("hash_seed_file", f"hash_seed_file: cannot read {hash_seed_file!r}: "
                                                      f"{e.strerror or e}") from None
        if len(secret.strip()) < 16:
            raise InvalidInputError("hash_seed_file", f"hash_seed_file {hash_seed_file!r} must hold a secret of "
                                                      f"at least 16 bytes")
        return hashlib.sha256(b"hash_seed_file\0" + secret.strip()).digest()
    if hash_seed is None:
        return _PROCESS_HASH_SEED
    return hash_seed.to_bytes(8, "little", signed=False)


def make_root_key(
    model_fingerprint: bytes, cache_salt: str | None = None, seed: bytes = b"", adapter_digest: bytes = b""
) -> bytes:
    """Serialises the non-token inputs of the cache key, unambiguously.

    Args:
        model_fingerprint: digest identifying the weights, config, tokenizer, template and dtype.
        cache_salt: optional per-request namespace; ``None`` means no salt.
        seed: :func:`hash_seed_bytes`.
        adapter_digest: content digest of the request's LoRA adapter; empty for the base model.

    Returns:
        Bytes that differ whenever any component differs (JSON keeps the fields apart).
    """
    return json.dumps([model_fingerprint.hex(), cache_salt, seed.hex(), adapter_digest.hex()]).encode()


def root_key_adapter_digest(root_key: bytes) -> bytes:
    """The adapter digest inside a :func:`make_root_key` result (``b""`` for the base model)."""
    return bytes.fromhex(json.loads(root_key)[3])


TENANT_KEY_PREFIX = b"tenant\x00"


def tenant_extra_key(tenant: str | None) -> bytes:
    """The per-block extra key of a tenant namespace; ``b""`` (no namespace) for ``None``.

    ``b"tenant\\0"``, the name's UTF-8 length (uint16, little-endian), then the name: the length
    keeps the key apart from what may follow it (int4's output key), so no tenant name can spell
    another tenant's key plus an output key (one could before)."""
    if tenant is None:
        return b""
    name = tenant.encode("utf-8")
    return TENANT_KEY_PREFIX + struct.pack("<H", len(name)) + name


def tenant_of_extra_key(extra_key: bytes) -> str | None:
    """The tenant name in a block's extra key (:func:`tenant_extra_key`, maybe followed by an output
    key); ``None`` when it has no tenant part."""
    if not extra_key.startswith(TENANT_KEY_PREFIX) or len(extra_key) < len(TENANT_KEY_PREFIX) + 2:
        return None
    start = len(TENANT_KEY_PREFIX) + 2
    (length,) = struct.unpack_from("<H", extra_key, len(TENANT_KEY_PREFIX))
    return extra_key[start : start + length].decode("utf-8", "replace")


OUTPUT_KEY_PREFIX = b"output\x00"


def output_slot_of_extra_key(extra_key: bytes) -> int | None:
    """For a block holding a generated token (an extra key ending in :meth:`BlockHasher.output_key`,
    after the tenant part if any): the slot where its request's generation starts,
    ``num_prompt_tokens % block_size``; ``None`` for a block of prompt tokens only (what follows the
    tenant part must start with ``OUTPUT_KEY_PREFIX``: no other key part is read as a slot)."""
    rest = extra_key
    if tenant_of_extra_key(extra_key) is not None:
        (length,) = struct.unpack_from("<H", extra_key, len(TENANT_KEY_PREFIX))
        rest = extra_key[len(TENANT_KEY_PREFIX) + 2 + length :]
    if not rest.startswith(OUTPUT_KEY_PREFIX) or len(rest) < len(OUTPUT_KEY_PREFIX) + 4:
        return None
    return struct.unpack_from("<I", rest, len(rest) - 4)[0]


class BlockHasher:
    """Computes chained block hashes with xxh64 (default) or sha256.

    Args:
        block_size: tokens per block.
        hash_algo: ``"xxh64"`` or ``"sha256"``.

    Raises:
        ValueError: unknown ``hash_algo`` or ``block_size`` < 1.
    """

    def __init__(self, block_size: int, hash_algo: str = "xxh64", output_block_key: bytes = b"") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {hash_algo!r}")
        self.block_size = block_size
        self.hash_algo = hash_algo
        # Mixed into every block holding a generated token when the model computes generated tokens
        # with other kernels than prompt tokens (quantization "int4"): such K/V is never served for
        # a prompt that is computed with the prompt kernel when the cache is off.
        self.output_block_key = output_block_key
        self._digest = _DIGESTS[hash_algo]
        self._pack = struct.Struct(f"<{block_size}I").pack

    def first_output_block(self, num_prompt_tokens: int | None) -> int | None:
        """Index of the first block that gets ``output_block_key`` (the first holding a generated
        token); None when there is no such key or no prompt length."""
        if not self.output_block_key or num_prompt_tokens is None:
            return None
        return num_prompt_tokens // self.block_size

    def output_key(self, num_prompt_tokens: int) -> bytes:
        """The key of a request's blocks that hold a generated token: ``OUTPUT_KEY_PREFIX``,
        ``output_block_key``, then the slot where generation starts in the first of them
        (``num_prompt_tokens % block_size``, uint32). From that slot on, K/V comes from the
        generated-token kernels, so blocks with the same tokens split differently between prompt
        and output (``[p, g, ...]`` vs ``[p, p, ...]``) are never one cached block, and a partial-block copy (which verifies this key) never takes
        generated slots for prompt slots (both happened before: int4 cache on != cache off)."""
        return OUTPUT_KEY_PREFIX + self.output_block_key + struct.pack("<I", num_prompt_tokens % self.block_size)

    def root_hash(self, root_key: bytes) -> BlockHash:
        """h_{-1}: the parent hash of a request's first block."""
        return BlockHash(self._digest(b"root" + root_key))

    def hash_block(
        self, parent: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b""
    ) -> BlockHash:
        """h_i = H(parent ‖ token ids as little-endian uint32 ‖ extra_keys) for one full block."""
        return BlockHash(self._digest(parent + self._pack(*token_ids) + extra_keys))

    def extend(
        self,
        block_hashes: list[BlockHash],
        token_ids: Sequence[int],
        root_key: bytes,
        extra_key: bytes = b"",
        num_unkeyed_blocks: int = 0,
        num_prompt_tokens: int | None = None,
    ) -> bytes:
        """Appends the hashes of blocks that became full since the last call.

        Args:
            block_hashes: the request's hashes so far; extended in place.
            token_ids: all of the request's tokens (prompt + output).
            root_key: the request's :func:`make_root_key`.
            extra_key: mixed into every block from ``num_unkeyed_blocks`` on (a tenant namespace).
            num_unkeyed_blocks: leading blocks hashed without ``extra_key`` (an approved shared
                prefix).
            num_prompt_tokens: the request's prompt length: with an ``output_block_key``, blocks
                ending after it (holding a generated token) get :meth:`output_key` too.

        Returns:
            The new full blocks' tokens, :func:`pack_token_ids` of them (``b""`` when none filled):
            the bytes the hashes were computed from, kept by the request to verify hits.
        """
        bs = self.block_size
        start, num_full = len(block_hashes), len(token_ids) // bs
        if num_full <= start:
            return b""
        parent = block_hashes[-1] if block_hashes else self.root_hash(root_key)
        tagged = self.first_output_block(num_prompt_tokens)
        tagged = num_full if tagged is None else tagged
        if NATIVE_CHAIN is not None and self._digest is xxhash.xxh64_digest and type(token_ids) is list:
            # The same bytes in one C call (chain_hash.c): ~10x faster than the loop below.
            output_key = self.output_key(num_prompt_tokens) if tagged < num_full else b""
            hashes, data = NATIVE_CHAIN(parent, token_ids, start, num_full, bs, extra_key, num_unkeyed_blocks,
                                        output_key, tagged)
            block_hashes += hashes
            return data
        # Same bytes as hash_block, packed once for all new blocks (the hot path of admission).
        data = pack_token_ids(token_ids[start * bs : num_full * bs])
        digest, append, width = self._digest, block_hashes.append, 4 * bs
        if not extra_key and tagged >= num_full:  # the usual case: no key on any new block
            for off in range(0, len(data), width):
                parent = digest(parent + data[off : off + width])
                append(parent)
            return data
        output_key = self.output_key(num_prompt_tokens) if tagged < num_full else b""
        for i, off in zip(range(start, num_full), range(0, len(data), width)):
            key = (extra_key if i >= num_unkeyed_blocks else b"") + (output_key if i >= tagged else b"")
            parent = digest(parent + data[off : off + width] + key)
            append(parent)
        return data
