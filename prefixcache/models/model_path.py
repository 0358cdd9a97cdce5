"""Checks of a model argument that load nothing (no torch, no transformers): the command line runs
them before it binds a port or loads a model, so a wrong path or a Hub id fails in a second.

A model argument is a built-in name (``fetch.BUILTIN_MODELS``), a local .gguf file, or a local HF directory holding
config.json and *.safetensors. Nothing is ever downloaded from the Hugging Face Hub.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from prefixcache.models import fetch


class ModelLoadError(ValueError):
    """The model could not be found or read; the message says what was tried and what to do."""


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: those named by model.safetensors.index.json when present, else all *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({model_dir / name for name in weight_map.values()})
    return sorted(model_dir.glob("*.safetensors"))


# A Hugging Face Hub id: "org/name", one slash, no path-like start.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def _builtin_names() -> str:
    """The built-in model names, quoted, for messages: ``'smollm2-135m', 'gemma3-270m'``."""
    return ", ".join(repr(name) for name in fetch.BUILTIN_MODELS)


def check_model_arg(model: str) -> None:
    """Checks, without loading, fetching or converting anything, that ``model`` names something
    :func:`~prefixcache.models.loader.resolve_model_dir` can use: the built-in name, an existing .gguf file, or a directory
    holding config.json and *.safetensors. A Hub id (``org/name``) that is not a local path gets
    an explanation: nothing is ever downloaded from the Hub (vLLM would; we don't).

    Raises:
        ModelLoadError: naming what is missing and what to pass instead.
    """
    if model in fetch.BUILTIN_MODELS:
        return
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return
    if not path.exists() and _HUB_ID.fullmatch(model):
        raise ModelLoadError(
            f"model {model!r} looks like a Hugging Face Hub id, and no local path has that name; prefixcache "
            "never downloads from the Hub. Download it yourself where the network is reachable (e.g. "
            f"`huggingface-cli download {model} --local-dir DIR`) and pass DIR (config.json + *.safetensors), "
            f"or pass a local .gguf file, or use a built-in model ({_builtin_names()})"
        )
    if not path.is_dir():
        raise ModelLoadError(
            f"model {model!r} is neither a built-in name ({_builtin_names()}), an existing directory, "
            "nor a .gguf file. Pass a directory containing config.json and *.safetensors, or use "
            f"{fetch.DEFAULT_MODEL_NAME!r} (run `prefixcache fetch` to download it ahead of time)"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json; pass a directory containing config.json and *.safetensors")
    if not safetensors_files(path):
        raise ModelLoadError(
            f"{path} has no *.safetensors weights; pass a directory containing config.json and *.safetensors "
            "(convert .bin checkpoints with transformers' save_pretrained)"
        )
