"""The name of a build of one of our C++ extensions: a digest of exactly the files it compiles.

Our extensions share ``csrc/``, so each build's name covers its own sources and the local headers they
``#include "..."`` (transitively), not the whole folder: editing one extension's source rebuilds that
extension only, an edited header rebuilds every extension that includes it (torch's own change check
reads no headers), and checkouts with different sources keep separate builds instead of rebuilding over
each other.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def compiled_files(sources: list[Path]) -> list[Path]:
    """``sources`` and the local headers they include, sorted (a header missing from disk is left out:
    the compiler names it)."""
    seen: set[Path] = set()
    todo = list(sources)
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        todo += [path.parent / name.decode() for name in _LOCAL_INCLUDE.findall(path.read_bytes())]
    return sorted(seen)


def extension_name(prefix: str, sources: list[Path]) -> str:
    """``f"{prefix}_{digest}"``, the digest (12 hex digits of sha256) over :func:`compiled_files`."""
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in compiled_files(sources)))
    return f"{prefix}_{digest.hexdigest()[:12]}"
