"""The local-disk tier: one file per block, surviving restarts and crashes.

Layout: ``DIR/<namespace>/<first 2 hex digits>/<block hash hex>.kv``, each file an entry as
:mod:`prefixcache.cache.tiers.entry` writes it. The namespace (format version, hash algorithm,
block size, K/V dtype and shape) keeps engines whose entries can never match apart.

Crash safety: a store writes a temporary file in the same directory, fsyncs it and renames it over
the entry (``os.replace``, atomic on POSIX), so a reader sees a whole old entry, a whole new one or
none; the directory is fsynced after the rename, so a power loss keeps every entry stored before
it. A kill -9 leaves at most a stray ``*.tmp`` file (never read as an entry; removed at the next
start once old). A file damaged by other means (a disk error, a bad copy) fails the entry's checks
and is deleted by the stack.

Size cap: ``max_bytes`` over the entries this process knows (those found at start plus those it
stored); when a store passes it, the deepest of the :data:`EVICTION_WINDOW` least recently used
entries goes first (a chain's blocks are stored head first, so plain LRU deleted its start first and
kept an end no lookup can reach); an entry larger than the cap is not stored. A hit refreshes a
chain tail first, so its start is the newest (and each file's mtime, so the order survives a
restart, where depths are unknown and the order is plain LRU). Several processes may share a directory: each keeps its own
view and a file another one deleted is simply a miss; a namespace directory removed while running
is made again by the next store.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from prefixcache.cache.tiers.base import KVTier

_STALE_TMP_S = 600.0  # a temporary file older than this at start is a dead writer's
EVICTION_WINDOW = 64  # least recently used entries among which the deepest is deleted first


class DiskTier(KVTier):
    """Entries as files under ``root / namespace`` (see the module docstring).

    Args:
        root: the directory (created if missing).
        namespace: sub-directory for this engine's kind of entries.
        max_bytes: cap on the entries' total size in bytes (LRU removal beyond it).

    Raises:
        OSError: the directory can't be created.
    """

    name = "disk"

    def __init__(self, root: str | os.PathLike, namespace: str, max_bytes: int) -> None:
        self.dir = Path(root).expanduser() / namespace
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # name -> bytes, least recently used first
        self._depths: dict[str, int] = {}  # name -> index in its chain (stored by this process)
        self._total_bytes = 0
        self._scan()

    def _path(self, name: str) -> Path:
        return self.dir / name[:2] / f"{name}.kv"

    def _scan(self) -> None:
        """Indexes the entries already on disk, oldest first; removes dead writers' temporary files."""
        found, now = [], time.time()
        for path in self.dir.glob("*/*"):
            try:
                st = path.stat()
            except OSError:
                continue
            if path.suffix == ".kv":
                found.append((st.st_mtime, path.stem, st.st_size))
            elif path.suffix == ".tmp" and now - st.st_mtime > _STALE_TMP_S:
                path.unlink(missing_ok=True)
        for _, name, size in sorted(found):
            self._sizes[name] = size
            self._total_bytes += size

    def lookup(self, names: Sequence[str]) -> int:
        for n, name in enumerate(names):
            if not self._path(name).is_file():
                self._forget(name)  # deleted behind our back: its bytes no longer count
                return n
        return len(names)

    def load(self, names: Sequence[str]) -> list[bytes | bytearray | None]:
        out: list[bytes | bytearray | None] = []
        for name in names:
            path = self._path(name)
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    data = bytearray(size)
                    data = data[: f.readinto(data)]
            except FileNotFoundError:
                out.append(None)
                self._forget(name)
                continue
            out.append(data)
        for name, data in reversed(list(zip(names, out))):  # tail first: the chain's start is the newest
            if data is None:
                continue
            with contextlib.suppress(OSError):  # a read-only directory still serves its entries
                os.utime(self._path(name))
            with self._lock:
                if name in self._sizes:
                    self._sizes.move_to_end(name)
        return out

    def store(self, name: str, blob: bytes, depth: int = 0) -> None:
        if len(blob) > self.max_bytes:
            return  # could never be kept under the cap
        path = self._path(name)
        if not self.dir.is_dir():  # removed while running: start a new index with the new directory
            with self._lock:
                self._sizes.clear()
                self._depths.clear()
                self._total_bytes = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)  # the rename itself survives a power loss
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._total_bytes += len(blob) - self._sizes.pop(name, 0)
            self._sizes[name] = len(blob)
            self._depths[name] = depth
            victims = []
            while self._total_bytes > self.max_bytes and self._sizes:
                oldest = itertools.islice(self._sizes, EVICTION_WINDOW)
                victim = max(oldest, key=lambda n: self._depths.get(n, 0))  # ties: the least recently used
                self._total_bytes -= self._sizes.pop(victim)
                self._depths.pop(victim, None)
                victims.append(victim)
        for victim in victims:
            self._path(victim).unlink(missing_ok=True)

    def remove(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)
        self._forget(name)

    def _forget(self, name: str) -> None:
        with self._lock:
            self._total_bytes -= self._sizes.pop(name, 0)
            self._depths.pop(name, None)

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._sizes), "bytes": self._total_bytes}


def _fsync_dir(directory: Path) -> None:
    """Flushes ``directory``'s entries (a rename into it) to disk; a no-op where directories can't be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
