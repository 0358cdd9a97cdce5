"""LoRA adapters (PEFT format) applied per request inside a mixed batch.

A LoRA adapter adds ``scaling * B @ A @ x`` to a target projection ``W @ x`` (Hu et al., 2021,
"LoRA: Low-Rank Adaptation of Large Language Models"; ``scaling = lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with rsLoRA, as in PEFT). A step's batch lays each request's tokens out
contiguously, so the adapter of each request covers one token range: the delta is computed per
range, and tokens of requests without an adapter cost nothing extra.

An adapter's identity is the digest of its config and weight files, never its name: two adapters
called "a" with different weights never share cache entries
(``tests/engine/test_lora_engine.py::test_c9_same_name_other_weights_never_hits``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn

from prefixcache.errors import InvalidInputError, clip

TARGETABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_UNSUPPORTED_OPTIONS = ("use_dora", "rank_pattern", "alpha_pattern", "layer_replication", "modules_to_save",
                        "lora_bias", "alora_invocation_tokens")


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request uses (vLLM's ``LoRARequest``, keyed by path; the name is a label).

    Attributes:
        lora_name: the name clients use (e.g. the server's ``model`` field).
        lora_path: local directory with adapter_config.json and adapter_model.safetensors (a str
            or an ``os.PathLike``).

    Raises:
        InvalidInputError: (field ``lora``) a name that is not a str, or a path that is not a
            non-empty str / path-like without NUL characters.
    """

    lora_name: str
    lora_path: str | os.PathLike[str]

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str):
            raise InvalidInputError("lora", f"lora: lora_name must be a str, got {type(self.lora_name).__name__}")
        path = self.lora_path
        fs_path = os.fspath(path) if isinstance(path, os.PathLike) else path
        if not isinstance(fs_path, str) or not fs_path or "\0" in fs_path:
            raise InvalidInputError("lora", f"lora: adapter {self.lora_name!r}: lora_path must be a non-empty "
                                            f"directory path (str or path-like), got {_short(path)}")


@dataclass
class LoRAAdapter:
    """A loaded adapter.

    Attributes:
        name: label given when loading.
        digest: sha256 of adapter_config.json and adapter_model.safetensors (the cache-key part).
        rank: r.
        scaling: lora_alpha / r (or / sqrt(r) with rsLoRA).
        weights: module name (``model.layers.3.self_attn.q_proj``) → (A [r, in_features],
            B [out_features, r]), on the model's device and dtype.
    """

    name: str
    digest: bytes
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


@dataclass(slots=True)
class LoRABatch:
    """A step's adapter layout: ``(token_start, token_end, adapter)`` per request that has one."""

    segments: list[tuple[int, int, LoRAAdapter]]


def _short(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters + ``"..."``, for messages (a config value may be
    huge)."""
    return clip(value, limit)


def _is_number(value: object) -> bool:
    """A JSON number: an int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# PEFT's tensor names, after "base_model.model.": <module>.lora_A.weight (older files:
# <module>.lora_A.<adapter>.weight).
_TENSOR_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight")


def _read_config(config_bytes: bytes, where: str) -> tuple[int, float]:
    """The rank and scaling of adapter_config.json's bytes, every field the loader reads checked.

    Raises:
        InvalidInputError: (field ``lora``) not JSON, not an object, not a LORA adapter, an
            unsupported option, ``r`` not a positive int, ``lora_alpha`` not a finite number,
            ``use_rslora`` not a bool.
    """
    try:
        config = json.loads(config_bytes)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, too deep / too long numbers
        raise InvalidInputError("lora", f"{where}: adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise InvalidInputError("lora", f"{where}: adapter_config.json must hold a JSON object, "
                                        f"got {type(config).__name__} {_short(config)}")
    peft_type = config.get("peft_type", "LORA")
    if not isinstance(peft_type, str):
        raise InvalidInputError("lora", f"{where}: adapter_config.json 'peft_type' must be a string, "
                                        f"got {_short(peft_type)}")
    if peft_type != "LORA":
        raise InvalidInputError("lora", f"{where} is a {peft_type[:60]} adapter, only LORA is supported")
    for option in _UNSUPPORTED_OPTIONS:
        if config.get(option):
            raise InvalidInputError("lora", f"{where}: adapter option {option!r} is not supported")
    if "r" not in config:
        raise InvalidInputError("lora", f"{where}: adapter_config.json has no 'r' (the LoRA rank)")
    rank = config["r"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidInputError("lora", f"{where}: adapter_config.json 'r' (the LoRA rank) must be a positive "
                                        f"integer, got {_short(rank)}")
    alpha = config.get("lora_alpha", rank)
    try:
        alpha_ok = _is_number(alpha) and math.isfinite(alpha)  # an int too large for a float overflows
    except OverflowError:
        alpha_ok = False
    if not alpha_ok:
        raise InvalidInputError("lora", f"{where}: adapter_config.json 'lora_alpha' must be a finite number, "
                                        f"got {_short(alpha)}")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise InvalidInputError("lora", f"{where}: adapter_config.json 'use_rslora' must be true or false, "
                                        f"got {_short(use_rslora)}")
    try:
        scaling = float(alpha) / math.sqrt(rank) if use_rslora else float(alpha) / rank
    except OverflowError:
        scaling = math.nan
    if not math.isfinite(scaling):
        raise InvalidInputError("lora", f"{where}: adapter_config.json 'r' {_short(rank)} and 'lora_alpha' "
                                        f"{_short(alpha)} give no finite scaling")
    return rank, scaling


def _read_tensors(weights_bytes: bytes, weights_file: Path, where: str) -> dict[str, torch.Tensor]:
    """The tensors of adapter_model.safetensors' bytes.

    Raises:
        InvalidInputError: (field ``lora``) a file safetensors can't read.
    """
    try:
        return safetensors.torch.load(weights_bytes)
    except (SafetensorError, ValueError, TypeError, RuntimeError) as e:
        raise InvalidInputError("lora", f"{where}: {weights_file.name} is not a readable safetensors file "
                                        f"({_short(str(e), 200)})") from None


def _to_model(tensor: torch.Tensor, key: str, param: torch.Tensor, where: str) -> torch.Tensor:
    """``tensor`` on the model's device and dtype, checked to be floating point and finite there.

    Raises:
        InvalidInputError: (field ``lora``) a non-float tensor, NaN or inf, or values the model's
            dtype can't hold.
    """
    if not tensor.is_floating_point():
        raise InvalidInputError("lora", f"{where}: tensor {key!r} must be floating point, got {tensor.dtype}")
    converted = tensor.to(param.device, param.dtype)
    if not bool(torch.isfinite(converted).all()):
        if not bool(torch.isfinite(tensor.float()).all()):
            raise InvalidInputError("lora", f"{where}: tensor {key!r} holds non-finite values (NaN or inf)")
        raise InvalidInputError("lora", f"{where}: tensor {key!r} holds values beyond the range of the "
                                        f"model's dtype {param.dtype} (non-finite once converted)")
    return converted


def load_lora_adapter(path: str | Path, model: nn.Module, name: str = "") -> LoRAAdapter:
    """Loads a PEFT LoRA adapter for ``model`` (our LlamaForCausalLM).

    Raises:
        InvalidInputError: (field ``lora``, a ValueError) missing or unreadable files, a config
            that is not a JSON object or has a field of the wrong type (``r`` a positive int,
            ``lora_alpha`` a finite number, ``use_rslora`` a bool, ``peft_type`` "LORA"), an
            unsupported option (DoRA, per-module ranks, modules_to_save, LoRA biases, aLoRA), a
            weights file safetensors can't read, no or unexpected tensors, a target module the model
            doesn't have, a shape mismatch, or a tensor that is not floating point or not finite
            (NaN, inf, or beyond the model's dtype).
    """
    path = Path(path)
    where = f"lora: adapter {name!r} at {path}" if name else f"lora: adapter at {path}"
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    try:
        if not config_file.is_file() or not weights_file.is_file():
            raise InvalidInputError("lora", f"{where} needs adapter_config.json and adapter_model.safetensors")
        config_bytes, weights_bytes = config_file.read_bytes(), weights_file.read_bytes()
    except OSError as e:
        raise InvalidInputError("lora", f"{where}: cannot read the adapter files ({e.strerror or e})") from e
    rank, scaling = _read_config(config_bytes, where)

    modules = dict(model.named_modules())
    param = next(model.parameters())
    pairs: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in _read_tensors(weights_bytes, weights_file, where).items():
        match = _TENSOR_KEY.fullmatch(key.removeprefix("base_model.model."))
        if match is None:
            raise InvalidInputError("lora", f"{where}: unexpected tensor {_short(key)} in {weights_file.name} "
                                            "(expected <module>.lora_A.weight / .lora_B.weight)")
        ab = pairs.setdefault(match["module"], {})
        if match["ab"] in ab:
            raise InvalidInputError("lora", f"{where}: tensors {_short(ab[match['ab']][0])} and {_short(key)} "
                                            "are the same LoRA matrix")
        ab[match["ab"]] = (key, tensor)
    if not pairs:
        raise InvalidInputError("lora", f"{where}: {weights_file.name} holds no LoRA tensors")
    weights = {}
    for module_name, ab in pairs.items():
        base = modules.get(module_name)
        if not isinstance(base, nn.Linear) or module_name.rsplit(".", 1)[-1] not in TARGETABLE:
            raise InvalidInputError("lora", f"{where}: target module {_short(module_name)} is not a supported "
                                            "projection of this model")
        (key_a, a), (key_b, b) = ab.get("A", (None, None)), ab.get("B", (None, None))
        if a is None or b is None or a.shape != (rank, base.in_features) or b.shape != (base.out_features, rank):
            raise InvalidInputError("lora", f"{where}: {module_name} needs lora_A [{rank}, {base.in_features}] and "
                                            f"lora_B [{base.out_features}, {rank}]")
        weights[module_name] = (_to_model(a, key_a, param, where), _to_model(b, key_b, param, where))
    digest = hashlib.sha256(config_bytes + b"\0" + weights_bytes).digest()
    return LoRAAdapter(name=name, digest=digest, rank=rank, scaling=scaling, weights=weights)


class LoRALinear(nn.Linear):
    """``nn.Linear`` that adds each request's LoRA delta to its own token range.

    ``module_name`` (set by the model after construction) is this layer's checkpoint path, the key
    into ``LoRAAdapter.weights``. The base product is the model's linear method's
    (:mod:`prefixcache.layers.linear`), which passes its float product in as ``linear`` and calls
    :meth:`add_lora` on the column slices of a stacked product. The deltas read the adapter's A and B
    only, never ``weight``: a format that multiplies by its own copy may release it
    (:func:`~prefixcache.layers.linear.release_weight`) and still run adapters.
    """

    module_name: str = ""

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None, linear=F.linear) -> torch.Tensor:
        """Args: x shape = [num_tokens, in_features]; ``linear(x, weight, bias)`` the float product
        (``F.linear``, or a batch-invariant one). Returns: shape = [num_tokens, out_features]."""
        return self.add_lora(linear(x, self.weight, self.bias), x, lora, linear)

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora: LoRABatch | None, linear=F.linear) -> torch.Tensor:
        """Adds, in place, each segment's adapter delta for this module to ``y``.

        Args:
            y: this layer's base output, shape = [num_tokens, out_features] (may be a column slice
                of a fused projection's output).
            x: its input, shape = [num_tokens, in_features].
            linear: the float product ``linear(x, weight)`` the adapter's A and B run with (the
                model's, so a batch-invariant model's deltas are too).
        """
        if lora is None:
            return y
        for start, end, adapter in lora.segments:
            ab = adapter.weights.get(self.module_name)
            if ab is not None:
                a, b = ab
                y[start:end] += adapter.scaling * linear(linear(x[start:end], a), b)  # [n, out]
        return y
