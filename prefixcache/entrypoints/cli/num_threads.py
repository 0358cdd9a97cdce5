"""The thread count of the commands that load a model (``demo``, ``serve``, ``bench``) when
``--num-threads`` is not given: the free cores, not torch's default of every core.

Threads that wait for a busy core stall every parallel kernel: on a 2-core machine at load 3-5,
``prefixcache demo`` runs several times slower with 2 threads than with 1. The Python API
(``LLM(num_threads=None)``) keeps torch's default; its caller chooses.
"""

from __future__ import annotations

import argparse
import math
import os
import time


NUM_THREADS_HELP = ("torch CPU threads (default: the free cores, i.e. the cores minus those busy now, measured "
                    "over a quarter second, at least 1; oversubscribed cores make every run many times slower)")
BUSY_WINDOW_S = 0.25  # how long the busy cores are measured (/proc/stat)
# A core counts as busy from this much of a core's time on: a daemon's flicker (a few %) leaves it free, a
# half-busy core (another program's thread) does not.
BUSY_TOLERANCE = 0.2


def default_num_threads(cpu_count: int | None = None, busy: float | None = None) -> int:
    """The thread count the commands that load a model (``demo``, ``serve``, ``bench``) use when
    ``--num-threads`` is not given: the free cores, ``cpu_count - ceil(busy - 0.2)``, at least 1 and at
    most ``cpu_count``. torch's own default, every core, made the demo 6x slower on a 2-core machine that
    was busy with other work; threads that wait for a busy core stall every parallel kernel. The Python
    API (``LLM()``) keeps torch's default.

    Args:
        cpu_count: cores this process may run on (default: its CPU affinity, else ``os.cpu_count()``).
        busy: cores in use by other work, in cores (default: :func:`busy_cores` now; where it can't be
            measured, the 1-minute load average, which still counts a build that ended a minute ago).
    """
    if cpu_count is None:
        cpu_count = _num_cores()
    if busy is None:
        busy = _busy()[0]
    return min(cpu_count, max(1, cpu_count - max(0, math.ceil(busy - BUSY_TOLERANCE))))


def busy_cores(interval_s: float = BUSY_WINDOW_S) -> float | None:
    """Cores busy now: the share of the machine's CPU time not idle over ``interval_s`` (``/proc/stat``'s
    aggregate line read twice), times its CPU count; None where there is no ``/proc/stat``."""
    first = _proc_stat()
    if first is None:
        return None
    time.sleep(interval_s)
    second = _proc_stat()
    if second is None:
        return None
    (idle0, total0, cpus), (idle1, total1, _) = first, second
    elapsed = total1 - total0
    return 0.0 if elapsed <= 0 else cpus * (1.0 - (idle1 - idle0) / elapsed)


def _proc_stat() -> tuple[int, int, int] | None:
    """(idle + iowait ticks, all ticks, number of CPUs) from /proc/stat, or None."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ticks = [int(v) for v in lines[0].split()[1:]]  # "cpu  user nice system idle iowait irq softirq steal ..."
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return ticks[3] + ticks[4], sum(ticks[:8]), max(cpus, 1)


def _busy() -> tuple[float, str]:
    """(busy cores, how they were measured) for the note."""
    busy = busy_cores()
    if busy is not None:
        return busy, f"{busy:.1f} busy now"
    load = _load_average()
    return load, f"load average {load:.1f}"


def _num_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows; a system that can't tell
        return 0.0


def choose_num_threads(args: argparse.Namespace) -> str | None:
    """Sets ``args.num_threads`` to :func:`default_num_threads` when ``--num-threads`` was not given.

    Returns:
        The line that says the choice (``num_threads=1 (2 cores, 1.6 busy now; --num-threads N to set)``),
        for stderr or the log; None when the flag was given.
    """
    if args.num_threads is not None:
        return None
    cores = _num_cores()
    busy, measured = _busy()
    args.num_threads = default_num_threads(cores, busy)
    return f"num_threads={args.num_threads} ({cores} core{'s' if cores != 1 else ''}, {measured}; --num-threads N to set)"
