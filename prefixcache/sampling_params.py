"""Sampling parameters of one request (vLLM's ``SamplingParams`` fields and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixcache.errors import InvalidInputError

MAX_STOP_STRINGS = 16
MAX_N = 64


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        temperature: 0 means greedy (argmax); > 0 scales logits before sampling.
        top_p: nucleus probability mass kept, in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 keeps all.
        max_tokens: new tokens to generate at most, >= 1.
        seed: per-request RNG seed; the same seed and prompt give the same sample.
        stop: strings that end generation; the matched string is not included in the text.
        stop_token_ids: token ids that end generation besides EOS.
        ignore_eos: keep generating past the model's EOS tokens.
        include_stop_str_in_output: keep the matched stop string in the text.
        n: parallel samples of the prompt (1..64). They share the prompt's KV blocks; sample ``i``
            uses seed ``seed + i`` when a seed is given (vLLM v1's rule), so each sample equals the
            same prompt run alone with that seed.

    Raises:
        ValueError: from :meth:`__post_init__`, naming the invalid field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check_number("temperature", self.temperature)
        if not 0 <= self.temperature < float("inf"):
            raise InvalidInputError("temperature", f"temperature must be finite and >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidInputError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidInputError("top_k", f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise InvalidInputError("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise InvalidInputError("n", f"n must be in [1, {MAX_N}], got {self.n}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not -(2**63) <= self.seed <= 2**64 - self.n:  # what torch.Generator.manual_seed accepts
                raise InvalidInputError("seed", f"seed must be in [-2**63, 2**64 - n], got {self.seed}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(name, f"{name} must be a bool, got {getattr(self, name)!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidInputError("stop", f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidInputError("stop", f"stop entries must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
            if t < 0:
                raise InvalidInputError("stop_token_ids", f"stop_token_ids must be >= 0, got {t}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise InvalidInputError(name, f"{name} must be a number, got {value!r}")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(name, f"{name} must be an integer, got {value!r}")
