"""The thread count of the commands that load a model (``demo``, ``serve``, ``bench``) when
``--num-threads`` is not given: the free cores, not torch's default of every core.

On a 2-core machine at load 3-5, ``prefixcache demo`` took 58 s with 2 threads and 9 s with 1
(issue 17): threads that wait for a busy core stall every parallel kernel. The Python API
(``LLM(num_threads=None)``) keeps torch's default; its caller chooses.
"""

from __future__ import annotations

import argparse
import math
import os


NUM_THREADS_HELP = ("torch CPU threads (default: the free cores, i.e. the cores minus the 1-minute load average, "
                    "at least 1; oversubscribed cores make every run many times slower)")


def default_num_threads(cpu_count: int | None = None, load_average: float | None = None) -> int:
    """The thread count the commands that load a model (``demo``, ``serve``, ``bench``) use when
    ``--num-threads`` is not given: the free cores, ``cpu_count - ceil(load_average)``, at least 1
    and at most ``cpu_count``. torch's own default, every core, made the demo 6x slower on a
    2-core machine at load 3-5 (issue 17). The Python API (``LLM()``) keeps torch's default.

    Args:
        cpu_count: cores this process may run on (default: its CPU affinity, else ``os.cpu_count()``).
        load_average: runnable processes, 1-minute average (default: ``os.getloadavg()[0]``; 0 where
            the platform has none).
    """
    if cpu_count is None:
        cpu_count = _num_cores()
    if load_average is None:
        load_average = _load_average()
    return min(cpu_count, max(1, cpu_count - math.ceil(load_average)))


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
        The line that says the choice (``num_threads=1 (2 cores, load average 3.4; --num-threads N
        to set)``), for stderr or the log; None when the flag was given.
    """
    if args.num_threads is not None:
        return None
    cores = _num_cores()
    load = _load_average()
    args.num_threads = default_num_threads(cores, load)
    return (f"num_threads={args.num_threads} ({cores} core{'s' if cores != 1 else ''}, load average {load:.1f}; "
            "--num-threads N to set)")
