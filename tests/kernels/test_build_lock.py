"""A build killed half-way must not hang every later load (prefixcache.kernels.build.load_extension).

torch's builder leaves its ``lock`` file behind when the build process dies; its next load would wait on
it for ever. The real builder runs here, in a child process with a timeout, on a two-line extension; a second
checkout of the same source then loads that build without recompiling it.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prefixcache.kernels.build import build_directory, extension_name

pytestmark = pytest.mark.slow  # one real compile (~20 s)

_SOURCE = textwrap.dedent("""\
    #include <pybind11/pybind11.h>
    int answer() { return 42; }
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
    """)

_CHILD = textwrap.dedent("""\
    import sys
    from pathlib import Path
    from prefixcache.kernels.build import load_extension
    module = load_extension("prefixcache_lock_probe", [Path(sys.argv[1])], ["-O1"])
    print(module.answer(), module.__file__)
    """)


def test_a_lock_left_by_a_killed_build_is_removed_and_the_build_runs(tmp_path, monkeypatch):
    source = tmp_path / "probe.cpp"
    source.write_text(_SOURCE)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    env = dict(os.environ)
    name = extension_name("prefixcache_lock_probe", [source])
    build_dir = build_directory(name)
    abi = f"py{sys.version_info.major}{sys.version_info.minor}{sys.abiflags}_cpu"
    assert build_dir.parent == tmp_path / "ext" / abi and build_dir.name.startswith(name + "_")
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()  # what torch's builder leaves when its process is killed mid-build

    run = subprocess.run([sys.executable, "-c", _CHILD, str(source)], env=env, capture_output=True, text=True,
                         timeout=300)  # without the fix this waits on the lock until the timeout

    assert run.returncode == 0, run.stderr
    answer, module_file = run.stdout.split()
    assert answer == "42"
    # torch built and imported the module in build_directory(name): the flock and the lock it clears are there
    assert Path(module_file).parent == build_dir and Path(module_file).name.startswith(name)
    assert "left by a build that was killed" in run.stderr and f"prefixcache: building {name}, once" in run.stderr
    assert not (build_dir / "lock").exists()
    again = subprocess.run([sys.executable, "-c", _CHILD, str(source)], env=env, capture_output=True, text=True,
                           timeout=300)  # built: a second load imports it and says nothing about locks
    assert again.stdout.split() == ["42", module_file] and "killed" not in again.stderr and "building" not in again.stderr

    # another checkout with the same source (a CI clone of a developer's tree) finds the build done: torch's builder
    # compiles the copy in build_dir/src, so its build.ninja is the same text and nothing is recompiled
    objects = {path: path.stat().st_mtime_ns for path in build_dir.glob("*.o")}
    assert objects and (build_dir / "src" / "probe.cpp").read_text() == _SOURCE
    other = tmp_path / "other_checkout" / "probe.cpp"
    other.parent.mkdir()
    other.write_text(_SOURCE)
    elsewhere = subprocess.run([sys.executable, "-c", _CHILD, str(other)], env=env, capture_output=True, text=True,
                               timeout=300)
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert elsewhere.stdout.split() == ["42", module_file]
    assert {path: path.stat().st_mtime_ns for path in build_dir.glob("*.o")} == objects

    # the same venv reached through another path (a clone whose .venv links to it; a CI clone's own venv) writes
    # other paths into build.ninja, which would make ninja recompile everything: it builds in a folder of its own,
    # once, and leaves the first build alone
    linked = tmp_path / "linked_venv"
    linked.symlink_to(Path(sys.prefix), target_is_directory=True)
    python = linked / Path(sys.executable).relative_to(sys.prefix)
    for attempt in range(2):
        through_link = subprocess.run([str(python), "-c", _CHILD, str(other)], env=env, capture_output=True,
                                      text=True, timeout=300)
        assert through_link.returncode == 0, through_link.stderr
        answer, linked_file = through_link.stdout.split()
        assert answer == "42" and Path(linked_file).parent != build_dir
        assert ("prefixcache: building" in through_link.stderr) == (attempt == 0)
    assert {path: path.stat().st_mtime_ns for path in build_dir.glob("*.o")} == objects
