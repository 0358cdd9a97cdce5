"""The thread count of ``demo``, ``serve`` and ``bench`` when ``--num-threads`` is not given: the
free cores (torch's every-core default made the demo 6x slower on a busy 2-core box).
No test here loads a model: each command stops where it would load one."""

from __future__ import annotations

import argparse
import os

import pytest

from prefixcache.bench import cli as bench_cli
from prefixcache.bench import runner
from prefixcache.engine import llm_engine
import prefixcache.entrypoints.cli.demo as demo_module
import prefixcache.entrypoints.cli.main as cli
from prefixcache.entrypoints.cli import num_threads
from prefixcache.entrypoints.cli.num_threads import choose_num_threads, default_num_threads


@pytest.mark.parametrize("cpu_count,busy,expected", [
    (2, 3.4, 1),  # a 2-core box at load 3.4 (the load average, where busy cores can't be measured)
    (2, 0.0, 2),
    (2, 0.1, 2),  # a daemon's flicker is not a busy core
    (2, 0.5, 1),  # a partly busy core counts as busy
    (2, 1.0, 1),
    (16, 3.4, 12),
    (4, 0.0, 4),
    (1, 0.0, 1),
    (8, 100.0, 1),  # never below 1
])
def test_default_num_threads_is_the_free_cores(cpu_count, busy, expected):
    assert default_num_threads(cpu_count, busy) == expected


@pytest.fixture
def busy_two_cores(monkeypatch):
    """This process sees 2 cores, 1.6 of them busy now (/proc/stat's idle share 20 % over the window)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    readings = iter([(1000, 5000, 2), (1010, 5050, 2)] * 4)  # idle +10 of +50 ticks: 80 % busy of 2 cpus
    monkeypatch.setattr(num_threads, "_proc_stat", lambda: next(readings))


NOTE = "num_threads=1 (2 cores, 1.6 busy now; --num-threads N to set)"


def test_busy_cores_are_measured_now_and_the_load_average_is_the_fallback(monkeypatch):
    """A build that ended before the server started still weighs on the 1-minute load average (3.4 here),
    not on the cores busy now."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.4, 2.0, 1.0))
    readings = iter([(1000, 5000, 2), (1048, 5050, 2)])  # idle +48 of +50 ticks: 0.08 cores busy
    monkeypatch.setattr(num_threads, "_proc_stat", lambda: next(readings))
    args = argparse.Namespace(num_threads=None)
    assert choose_num_threads(args) == "num_threads=2 (2 cores, 0.1 busy now; --num-threads N to set)"
    monkeypatch.setattr(num_threads, "_proc_stat", lambda: None)  # no /proc/stat: the load average
    args = argparse.Namespace(num_threads=None)
    assert choose_num_threads(args) == "num_threads=1 (2 cores, load average 3.4; --num-threads N to set)"
    assert args.num_threads == 1


def test_choose_num_threads_sets_the_default_and_says_so(busy_two_cores):
    args = argparse.Namespace(num_threads=None)
    assert choose_num_threads(args) == NOTE and args.num_threads == 1
    assert default_num_threads() == 1  # the same sources when nothing is injected
    given = argparse.Namespace(num_threads=2)
    assert choose_num_threads(given) is None and given.num_threads == 2


class Reached(Exception):
    """Raised where a command would load the model: carries what it would load it with."""


def run(argv: list[str], capsys) -> tuple[object, str, str]:
    with pytest.raises(Reached) as e:
        cli.main(argv)
    out, err = capsys.readouterr()
    return e.value.args[0], out, err


def test_demo_picks_the_free_cores_unless_given(busy_two_cores, monkeypatch, capsys):
    def fake_run_demo(model, **kwargs):
        raise Reached(kwargs["num_threads"])

    monkeypatch.setattr(demo_module, "run_demo", fake_run_demo)
    assert run(["demo", "--json"], capsys) == (1, "", f"prefixcache demo: {NOTE}\n")  # stdout stays JSON-only
    assert run(["demo", "--num-threads", "2"], capsys) == (2, "", "")


def test_serve_picks_the_free_cores_unless_given(busy_two_cores, monkeypatch, capsys):
    def fake_engine(config, *args, **kwargs):
        raise Reached(config.num_threads)

    monkeypatch.setattr(llm_engine, "LLMEngine", fake_engine)
    assert run(["serve", "--port", "0", "--log-level", "error"], capsys)[0] == 1
    assert run(["serve", "--port", "0", "--log-level", "error", "--num-threads", "2"], capsys)[0] == 2


def test_bench_picks_the_free_cores_for_model_workloads_only(busy_two_cores, monkeypatch, capsys):
    def fake_run_bench(opts, *args, **kwargs):
        raise Reached(opts.num_threads)

    def fake_cluster(args, num_threads):
        raise Reached(num_threads)

    monkeypatch.setattr(runner, "run_bench", fake_run_bench)
    monkeypatch.setattr(bench_cli, "run_cluster_cli", fake_cluster)
    assert run(["bench", "--workload", "seed"], capsys) == (1, "", f"prefixcache bench: {NOTE}\n")
    assert run(["bench", "--workload", "seed", "--num-threads", "2"], capsys) == (2, "", "")
    assert run(["bench", "--workload", "cluster"], capsys) == (None, "", "")  # per replica: its own default, 1
