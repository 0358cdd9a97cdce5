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

Retention (OpenAI's ``prompt_cache_retention: "24h"``): :meth:`DiskTier.retain` marks entries to
keep until a deadline (seconds on ``clock``, wall time); a marked entry is out of the size cap's
eviction order until its mark expires, within ``max_retained_bytes`` (the marks' entries in bytes;
a chain over it gets the longest head that fits). A mark may come before its entry is stored (the
writer thread stores the blocks a step computed after the step): the store then keeps it at once.
Expiry is lazy, at the next :meth:`~DiskTier.retain` or store after the deadline: the entry goes
back to the eviction order as its least recently used. Marks live in this process only: after a
restart the entries are ordinary ones again.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
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
        max_retained_bytes: cap on the bytes of retained entries (0: :meth:`retain` keeps nothing).
        clock: wall-clock seconds, for retention deadlines (``time.time``).

    Raises:
        OSError: the directory can't be created.
    """

    name = "disk"

    def __init__(self, root: str | os.PathLike, namespace: str, max_bytes: int, max_retained_bytes: int = 0,
                 clock: Callable[[], float] = time.time) -> None:
        self.dir = Path(root).expanduser() / namespace
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_retained_bytes = max_retained_bytes
        self.clock = clock
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # name -> bytes, least recently used first
        self._depths: dict[str, int] = {}  # name -> index in its chain (stored by this process)
        self._total_bytes = 0
        # Retention: name -> deadline for every mark; name -> bytes charged to the budget (the
        # entry's size once stored, the caller's estimate before); stored retained entries (name ->
        # bytes), kept out of _sizes so eviction never sees them; (deadline, name) to expire lazily.
        self._retain_until: dict[str, float] = {}
        self._retain_bytes: dict[str, int] = {}
        self._retained_bytes = 0
        self._kept: dict[str, int] = {}
        self._deadlines: list[tuple[float, str]] = []
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
                for kept in self._kept:  # their entries are gone: so are their marks (as _forget)
                    self._drop_mark(kept)
                self._kept.clear()
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
            self._expire_marks()
            self._total_bytes += len(blob) - self._sizes.pop(name, 0) - self._kept.pop(name, 0)
            self._depths[name] = depth
            if name in self._retain_until:  # retained: out of the eviction order, charged its real size
                self._kept[name] = len(blob)
                self._retained_bytes += len(blob) - self._retain_bytes[name]
                self._retain_bytes[name] = len(blob)
            else:
                self._sizes[name] = len(blob)
            victims = []
            while self._total_bytes > self.max_bytes and self._sizes:  # retained entries are not candidates
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
        """Drops a stored entry from the index (and its retention mark: the entry is gone); a mark
        whose entry is not stored yet stays (the writer may store it next)."""
        with self._lock:
            self._total_bytes -= self._sizes.pop(name, 0)
            self._depths.pop(name, None)
            if name in self._kept:
                self._total_bytes -= self._kept.pop(name)
                self._drop_mark(name)

    # -- retention ------------------------------------------------------------------------------

    @property
    def retains(self) -> bool:
        return self.max_retained_bytes > 0

    def retain(self, names: Sequence[str], ttl_s: float, entry_bytes: Sequence[int]) -> int:
        """Keeps the entries ``names`` (a chain, head first) out of the size cap's eviction for
        ``ttl_s`` seconds from now (a mark already later is kept), within ``max_retained_bytes``.

        Args:
            names: the entries' names, head of the chain first; stored or still to be stored.
            ttl_s: seconds, ``> 0``.
            entry_bytes: each entry's size in bytes, charged to the budget until it is stored
                (then its size on disk is).

        Returns:
            How many of ``names``, from the head, are retained now: fewer than ``len(names)`` when
            the budget ran out there.
        """
        with self._lock:
            self._expire_marks()
            until = self.clock() + ttl_s
            for i, (name, size) in enumerate(zip(names, entry_bytes)):
                if name not in self._retain_until:
                    stored = self._sizes.get(name)
                    charge = size if stored is None else stored
                    if self._retained_bytes + charge > self.max_retained_bytes:
                        return i
                    self._retain_bytes[name] = charge
                    self._retained_bytes += charge
                    self._retain_until[name] = float("-inf")
                    if stored is not None:
                        self._kept[name] = self._sizes.pop(name)
                if until > self._retain_until[name]:
                    self._retain_until[name] = until
                    heapq.heappush(self._deadlines, (until, name))
            return len(names)

    def holds(self, names: Sequence[str]) -> list[bool]:
        """Whether this process stored (or found at start) each entry, and has not dropped it."""
        with self._lock:
            return [name in self._sizes or name in self._kept for name in names]

    def retained_until(self, name: str) -> float | None:
        """The deadline of an entry's retention mark (``clock`` seconds), or None for none."""
        with self._lock:
            return self._retain_until.get(name)

    def _expire_marks(self) -> None:
        """Drops the marks past their deadline (``now > until``); their stored entries go back to
        the eviction order as its least recently used. O(1) when none expired. Under the lock."""
        now = self.clock()
        while self._deadlines and self._deadlines[0][0] < now:
            until, name = heapq.heappop(self._deadlines)
            if self._retain_until.get(name) != until:
                continue  # extended since: a later heap entry stands for it
            size = self._kept.pop(name, None)
            self._drop_mark(name)
            if size is not None:
                self._sizes[name] = size
                self._sizes.move_to_end(name, last=False)

    def _drop_mark(self, name: str) -> None:
        self._retain_until.pop(name, None)
        self._retained_bytes -= self._retain_bytes.pop(name, 0)

    def usage(self) -> dict[str, int]:
        """``entries`` and ``bytes`` held; where the tier retains, also ``retained_entries`` (stored
        retained entries) and ``retained_bytes`` (the bytes charged to the retention budget)."""
        with self._lock:
            self._expire_marks()
            out = {"entries": len(self._sizes) + len(self._kept), "bytes": self._total_bytes}
            if self.retains:
                out.update(retained_entries=len(self._kept), retained_bytes=self._retained_bytes)
            return out


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
