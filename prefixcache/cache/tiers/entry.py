"""The bytes of one tier entry (one full KV block) and the check that makes a loaded entry a hit.

An entry is self-describing and verified whole before its K/V is used::

    | b"PCKV" | format u32 | header_len u32 | header (JSON, header_len bytes) | payload (K/V) |

The header names everything the pool verifies on a hit (``cache/block.py`` ``verified_chain_length``),
in a form that outlives the process: the block's hash and its parent's hash (chain order); the
block's own token ids; a digest of the root key (model key, hash seed, cache_salt, adapter) and of
the block's extra key (tenant namespace); and the *prefix digest*, a sha256 chain over the root key
and every block's token ids and extra key up to this one (:func:`prefix_digests`). Equal prefix
digests mean equal whole prefixes in the same namespace whatever the configured block hash does
(xxh64 collisions, or a constant hash in the tests), so an entry never serves another prefix's K/V.
Secrets stay out of the entry: the root key holds the hash seed and the salt, only digests of it
are stored. Then the payload's dtype, shape, byte length and xxh3-64 checksum.

Payload layout: a pool block's K/V, ``shape = [num_layers, 2, block_size, num_kv_heads, head_dim]``
(index 0 of the second axis K, 1 V), C order, in the pool's dtype. ``num_layers`` is every layer for a
one-group model and ``layers_per_group`` for a model with several KV-cache groups, whose pool block
holds one group's layers: each group's block is then an entry of its own, its ``block_hash`` the
group-keyed hash (``cache/kv_cache_groups.py`` ``group_block_hash``), verified like every field.

Invariant: :func:`decode_entry` returns a payload only if every header field equals the expected
one and the payload has the declared length and checksum; anything else (truncation, zeroed
bytes, another block's entry under this key, an old format) raises :class:`EntryError`.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

MAGIC = b"PCKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sII")  # magic, format version, header length


class EntryError(ValueError):
    """A tier entry that is not the expected block's (the reason says which check failed)."""


@dataclass(frozen=True, slots=True)
class KVBlockLayout:
    """What one block's K/V payload looks like in this engine.

    Attributes:
        dtype: the pool's element dtype as torch names it without ``torch.`` (``"float32"``).
        shape: ``[num_layers, 2, block_size, num_kv_heads, head_dim]``.
        itemsize: bytes per element.
    """

    dtype: str
    shape: tuple[int, ...]
    itemsize: int

    @property
    def payload_bytes(self) -> int:
        """Bytes of one block's K/V over all layers."""
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def block_size(self) -> int:
        return self.shape[2]


@dataclass(frozen=True, slots=True)
class EntryKey:
    """What a request expects of the entry of its block ``depth`` (everything but the K/V).

    Attributes:
        block_hash: the request's hash of the block (the entry's key).
        parent_hash: the request's hash of the previous block (its root hash for a first block).
        prefix_digest: :func:`prefix_digests` of the request up to this block.
        root_digest: sha256 of the request's root key.
        extra_digest: sha256 of the block's extra key (tenant namespace; of ``b""`` for none).
        depth: the block's index in the request.
        token_ids: the block's ``block_size`` tokens.
    """

    block_hash: bytes
    parent_hash: bytes
    prefix_digest: bytes
    root_digest: bytes
    extra_digest: bytes
    depth: int
    token_ids: tuple[int, ...]

    @property
    def name(self) -> str:
        """The entry's name in a tier (the block hash in hex)."""
        return self.block_hash.hex()


def prefix_digests(
    root_key: bytes, token_ids: Sequence[int], block_size: int, extra_key: Callable[[int], bytes], num_blocks: int
) -> list[bytes]:
    """The prefix digests of a request's first ``num_blocks`` blocks.

    ``d_{-1} = sha256("prefix" ‖ root_key)``, ``d_i = sha256(d_{i-1} ‖ tokens_i as uint32 LE ‖
    len(extra_i) ‖ extra_i)``: equal digests mean equal root keys, tokens and extra keys for the
    whole prefix (sha256, whatever the configured block hash).

    Args:
        root_key: the request's root key.
        token_ids: its tokens (at least ``num_blocks * block_size``).
        block_size: tokens per block.
        extra_key: block index -> that block's extra key (``Request.block_extra_key``).
        num_blocks: how many digests.
    """
    pack = struct.Struct(f"<{block_size}I").pack
    digest = hashlib.sha256(b"prefix" + root_key).digest()
    out = []
    for i in range(num_blocks):
        extra = extra_key(i)
        data = digest + pack(*token_ids[i * block_size : (i + 1) * block_size]) + len(extra).to_bytes(4, "little")
        digest = hashlib.sha256(data + extra).digest()
        out.append(digest)
    return out


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def encode_entry(key: EntryKey, layout: KVBlockLayout, payload: bytes) -> bytes:
    """The entry's bytes: prefix, header, payload (see the module docstring).

    Raises:
        ValueError: ``payload`` is not ``layout.payload_bytes`` long.
    """
    if len(payload) != layout.payload_bytes:
        raise ValueError(f"payload is {len(payload)} bytes, the layout needs {layout.payload_bytes}")
    header = _header(key, layout, xxhash.xxh3_64_hexdigest(payload))
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header + payload


def entry_bytes(key: EntryKey, layout: KVBlockLayout) -> int:
    """The size in bytes of the entry :func:`encode_entry` makes for ``key`` (whatever the payload:
    its checksum is always 16 hex digits)."""
    return _PREFIX.size + len(_header(key, layout, "0" * 16)) + layout.payload_bytes


def _header(key: EntryKey, layout: KVBlockLayout, checksum: str) -> bytes:
    return json.dumps({
        "block_hash": key.block_hash.hex(), "parent_hash": key.parent_hash.hex(),
        "prefix_digest": key.prefix_digest.hex(), "root_digest": key.root_digest.hex(),
        "extra_digest": key.extra_digest.hex(), "depth": key.depth, "token_ids": list(key.token_ids),
        "dtype": layout.dtype, "shape": list(layout.shape), "payload_bytes": layout.payload_bytes,
        "checksum": checksum,
    }, separators=(",", ":")).encode()


def decode_entry(blob: bytes | bytearray | memoryview, key: EntryKey, layout: KVBlockLayout) -> memoryview:
    """Checks an entry against what the request expects and returns its payload.

    Args:
        blob: the entry's bytes as a tier returned them.
        key: the request's expectations for the block.
        layout: this engine's payload dtype and shape.

    Returns:
        The payload, ``layout.payload_bytes`` long (a view into ``blob``).

    Raises:
        EntryError: naming the first check that failed.
    """
    view = memoryview(blob)
    if len(view) < _PREFIX.size:
        raise EntryError("truncated before the header")
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise EntryError(f"not a format-{FORMAT_VERSION} entry")
    start = _PREFIX.size + header_len
    if len(view) < start:
        raise EntryError("truncated inside the header")
    try:
        header = json.loads(bytes(view[_PREFIX.size : start]))
    except (UnicodeDecodeError, ValueError) as e:
        raise EntryError(f"unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise EntryError("unreadable header")
    expected = {
        "block_hash": key.block_hash.hex(), "parent_hash": key.parent_hash.hex(),
        "prefix_digest": key.prefix_digest.hex(), "root_digest": key.root_digest.hex(),
        "extra_digest": key.extra_digest.hex(), "depth": key.depth, "token_ids": list(key.token_ids),
        "dtype": layout.dtype, "shape": list(layout.shape), "payload_bytes": layout.payload_bytes,
    }
    for name, value in expected.items():
        if header.get(name) != value:
            raise EntryError(f"{name} differs from the request's")
    payload = view[start:]
    if len(payload) != layout.payload_bytes:
        raise EntryError(f"payload is {len(payload)} bytes, expected {layout.payload_bytes}")
    if xxhash.xxh3_64_hexdigest(payload) != header.get("checksum"):
        raise EntryError("payload checksum mismatch")
    return payload
