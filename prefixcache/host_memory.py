"""This machine's memory as a KV pool may use it: physical memory, or a container's smaller limit.

Read by the engine before it allocates its pool and by the command line's checks before a model
loads (``entrypoints/cli/preflight.py``); torch only for a pool that may go to CUDA.
"""

from __future__ import annotations

import os
from pathlib import Path

# cgroup v2's and v1's memory limit of this process's container (a v1 value near 2**63 means none)
CGROUP_MEMORY_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def physical_memory_bytes() -> int | None:
    """This machine's physical memory (None where the platform can't tell)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def cgroup_memory_limit_bytes() -> int | None:
    """This container's memory limit from the first readable :data:`CGROUP_MEMORY_LIMIT_FILES`
    (None: no limit, ``max``, or no cgroup file)."""
    for path in CGROUP_MEMORY_LIMIT_FILES:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        return int(text) if text.isdigit() and int(text) < 1 << 62 else None
    return None


def host_memory_limit() -> tuple[int, str] | None:
    """``(bytes, what)``: the smaller of physical memory and the container's limit (cgroup)."""
    physical, limit = physical_memory_bytes(), cgroup_memory_limit_bytes()
    if limit is not None and (physical is None or limit < physical):
        return limit, "this container's memory limit (cgroup)"
    return (physical, "physical memory") if physical is not None else None


def pool_memory_limit(device: str | None, need: int) -> tuple[int, str] | None:
    """``(bytes, what)`` of the memory a KV pool of ``need`` bytes would be allocated in, when
    ``need`` exceeds it; else None. ``device``: ``"cuda[:N]"`` compares with that CUDA device's
    memory; ``None`` (CUDA when present) asks torch only when ``need`` exceeds the host's memory, so
    a pool that fits the host is checked without importing torch; otherwise the host's
    (:func:`host_memory_limit`)."""
    host = host_memory_limit()
    over_host = host is not None and need > host[0]
    if (device is not None and device.startswith("cuda")) or (device is None and over_host):
        import torch

        if torch.cuda.is_available():
            index = int(device.partition(":")[2] or 0) if device else 0
            total = torch.cuda.get_device_properties(index).total_memory
            return (total, f"CUDA device {index}'s memory") if need > total else None
    return host if over_host else None
