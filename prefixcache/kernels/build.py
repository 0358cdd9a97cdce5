"""The name of a build of one of our C++ extensions: a digest of exactly the files it compiles.

Our extensions share ``csrc/``, so each build's name covers its own sources and the local headers they
``#include "..."`` (transitively), not the whole folder: editing one extension's source rebuilds that
extension only, an edited header rebuilds every extension that includes it (torch's own change check
reads no headers), checkouts with different sources keep separate builds instead of rebuilding over
each other, and checkouts with the same sources share one build (compiled from a copy in the build folder).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType

from prefixcache.kernels.cpu_features import TIERS, cpu_has, describe_cpu, kernel_tier

_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def compiled_files(sources: list[Path]) -> dict[Path, bytes]:
    """``sources`` and the local headers they include, sorted by path, each with its contents as read once (a
    header missing from disk is left out: the compiler names it)."""
    found: dict[Path, bytes] = {}
    todo = list(sources)
    while todo:
        path = todo.pop()
        if path in found or not path.is_file():
            continue
        found[path] = path.read_bytes()
        todo += [path.parent / name.decode() for name in _LOCAL_INCLUDE.findall(found[path])]
    return dict(sorted(found.items()))


def extension_name(prefix: str, sources: list[Path], files: dict[Path, bytes] | None = None) -> str:
    """``f"{prefix}_{digest}"``, the digest (12 hex digits of sha256) over :func:`compiled_files` (``files``, where
    the caller read them already)."""
    files = compiled_files(sources) if files is None else files
    return f"{prefix}_{hashlib.sha256(b''.join(files.values())).hexdigest()[:12]}"


def build_directory(name: str) -> Path:
    """Where extension ``name`` is built: ``TORCH_EXTENSIONS_DIR`` if set, else torch's public
    ``get_default_build_root()`` (``~/.cache/torch_extensions``); then a folder per Python ABI (``py311_cpu``),
    then ``name`` and :func:`_torch_paths_digest`.

    This is our rule, not a copy of torch's: :func:`load_extension` hands this directory to torch's ``load`` as
    its ``build_directory``, and torch builds exactly there (torch's own default placement is private, and with
    ``TORCH_EXTENSIONS_DIR`` set it drops the per-ABI folder). The per-ABI folder is kept always, because a
    built module imports only into the Python it was built for and :func:`extension_name` digests the sources
    alone, so two Pythons sharing one root must not share a build.
    """
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    abi = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return root / f"{abi}_cpu" / f"{name}_{_torch_paths_digest()}"


def _torch_paths_digest() -> str:
    """8 hex digits of a digest of the paths torch's builder writes into ``build.ninja`` besides the sources:
    torch's headers and libraries (as this process reached them: a venv's path, or a symlink to one) and Python's
    headers. ninja rebuilds everything when that file's text changes, so two venvs (a developer's and a CI
    clone's) that shared a build folder would each recompile the whole extension, minutes, whenever the other had
    loaded it last; a folder per set of paths builds once for each."""
    import sysconfig

    import torch

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))  # what torch's include_paths() and -L start from
    python_include = sysconfig.get_path("include", scheme="posix_prefix") or ""
    return hashlib.sha256(f"{torch_dir}\0{python_include}".encode()).hexdigest()[:8]


def load_extension(prefix: str, sources: list[Path], cflags: list[str]) -> ModuleType:
    """Builds (once) and imports the extension of ``sources`` named :func:`extension_name`, with OpenMP.

    torch's builder guards a build with a ``lock`` file made with O_EXCL and removed when the build ends; a
    build killed half-way (Ctrl-C during a first start, an out-of-memory kill, a CI timeout) leaves that file,
    and every later load waits on it for ever. So the build also holds an flock on a file beside it, which the
    kernel releases when its holder dies: whoever holds the flock knows no build of this extension runs, and
    removes a leftover ``lock`` first (one line on stderr). ninja comes from the venv when it isn't on PATH.

    Raises:
        RuntimeError, OSError, ImportError: the build or the import failed (the compiler's message).
    """
    from torch.utils.cpp_extension import load

    venv_bin = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    files = compiled_files(sources)  # read once: the name and the compiled copy come from the same bytes
    name = extension_name(prefix, sources, files)
    build_dir = build_directory(name)
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "prefixcache.flock", "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released at close, or by the kernel when this process dies
        stale = build_dir / "lock"
        if stale.exists():
            print(f"prefixcache: removed {stale}, left by a build that was killed; building {name} again",
                  file=sys.stderr)
            stale.unlink()
        compiled = _copy_sources(sources, files, build_dir / "src")
        if not (build_dir / f"{name}.so").is_file():
            print(f"prefixcache: building {name}, once for these sources and this venv (minutes on 2 cores), in "
                  f"{build_dir}", file=sys.stderr, flush=True)
        return load(name=name, sources=[str(s) for s in compiled], extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir), verbose=False)


def _copy_sources(sources: list[Path], files: dict[Path, bytes], into: Path) -> list[Path]:
    """Writes ``files`` (:func:`compiled_files` of ``sources``) into ``into`` (flat: our local includes name files
    beside the includer) and returns the copies of ``sources``, in order.

    The compiler is run on these copies, not on the checkout's files, because torch's ``load`` writes the source
    paths into ``build.ninja`` and rebuilds everything when that file's text changes: compiled from the checkout, two
    checkouts with the same sources (a developer's tree and a CI clone of it, which get one build folder since the
    name is a digest of the contents) would recompile the whole extension, minutes each, every time the other one
    loaded it. From a copy named by the digest, every checkout writes the same ``build.ninja`` and the second one
    finds the build done. A copy is rewritten only when its bytes differ (ninja's change check reads mtimes).
    Called under the build folder's flock.
    """
    into.mkdir(exist_ok=True)
    for path, data in files.items():
        copy = into / path.name
        if not copy.is_file() or copy.read_bytes() != data:
            copy.write_bytes(data)
    return [into / path.name for path in sources]


_TOLD: dict[str, int] = {}  # extension name -> the tier last passed to its set_kernel_tier


def tell_tier(module: ModuleType) -> ModuleType:
    """Passes :func:`~prefixcache.kernels.cpu_features.kernel_tier` to ``module.set_kernel_tier`` (csrc/isa_tier.h:
    every C++ dispatch honours the cap) when it differs from what this function last passed it, and returns
    ``module``. Called on every load, so a cap changed after the first load reaches C++ too; only on a change, so a
    tier a test set by hand stays set until the cap itself changes."""
    tier = list(TIERS).index(kernel_tier())
    if _TOLD.get(module.__name__) != tier:
        module.set_kernel_tier(tier)
        _TOLD[module.__name__] = tier
    return module


def build_main(name: str, load: Callable[[], object], unavailable: type[Exception], needs: Iterable[str],
               built_for: Callable[[], str] | None = None) -> int:
    """What ``python -m prefixcache.kernels.<name>`` runs (scripts/setup.sh builds each extension that way): build
    now instead of on first use, and print one line either way, never a traceback, so one build that fails costs
    setup one line and not the others.

    Args:
        name: the module's name, the line's first word (``"cpu_kernels"``).
        load: builds (once) and returns the extension; raises ``unavailable`` where it can't.
        unavailable: the module's exception for "can't run here or doesn't build".
        needs: the features (``/proc/cpuinfo`` names) without which this build isn't meant to run here; the exit
            code tells their absence (nothing to build) from a build that failed.
        built_for: what the build was made for, said after ``built`` (``"for -march=armv8-a"``), if anything.

    Returns:
        The exit code: 0 where it built, and where this CPU (as capped by ``PREFIXCACHE_KERNELS``) lacks ``needs``
        (another build or torch's own kernels serve it); 1 where it has them but the build failed.
    """
    try:
        load()
    except unavailable as e:
        print(f"{name}: not built: {str(e).splitlines()[0]}")
        return 1 if cpu_has(*needs) else 0
    print(f"{name}: built{' ' + built_for() if built_for else ''} ({describe_cpu()})")
    return 0
