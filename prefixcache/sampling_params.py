"""Sampling parameters of one request (vLLM's ``SamplingParams`` fields and meanings)."""

from __future__ import annotations

import json as jsonlib
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from prefixcache.errors import InvalidInputError

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string: the stop search and the stream's hold-back scan this much
MAX_STOP_TOKEN_IDS = 1024
MAX_N = 64
MAX_LOGPROBS = 20  # vLLM's default max_logprobs (and OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_ABS_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's and vLLM's range)
MAX_PROMPT_LOGPROBS = 20  # = prefixcache.prompt_logprobs.PROMPT_LOGPROBS_TOPK, the alternatives a block keeps


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's ``StructuredOutputsParams``): exactly one of
    ``json``, ``regex``, ``choice`` or ``json_object`` is set.

    The runner masks, at every step, the tokens that can't continue a text the constraint accepts
    (``prefixcache.runner.structured_output``), and EOS is allowed only once the text is complete.
    JSON is generated in one fixed layout, ``json.dumps``'s default (``", "`` and ``": "``, no other
    whitespace), so a small model can't wander off into endless whitespace.

    Attributes:
        json: a JSON schema, as a dict or as JSON text; kept as compact JSON text (its key order
            kept: properties are generated in the schema's order), so equal schemas compile once.
            The output is JSON text valid against it.
        regex: the output fully matches this regular expression (Rust ``regex`` syntax: no
            look-around or backreferences).
        choice: the output is exactly one of these non-empty strings.
        json_object: the output is any JSON object (OpenAI's ``{"type": "json_object"}``).

    Raises:
        InvalidInputError: (field ``structured_outputs``) none or several constraints set, wrong
            types, a schema that is not a JSON object. Whether a schema or regex compiles is checked
            when the engine admits the request (same field).
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        name = "structured_outputs"
        if not isinstance(self.json_object, bool):
            raise InvalidInputError(name, f"json_object must be a bool, got {_show(self.json_object)}")
        given = [k for k in ("json", "regex", "choice") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidInputError(name, "give exactly one of json, regex, choice or json_object, "
                                          f"got {given or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise InvalidInputError(name, f"regex must be a non-empty string, got {_show(self.regex)}")
        if self.choice is not None:
            choice = _as_tuple(name, [self.choice] if isinstance(self.choice, str) else self.choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise InvalidInputError(name, f"choice must be a non-empty list of non-empty strings, "
                                              f"got {_show(self.choice)}")
            object.__setattr__(self, "choice", choice)
        for text in [self.json, self.regex, *(self.choice or ())]:
            if text is not None and not encodes_utf8(text):
                raise InvalidInputError(name, "the constraint contains a lone surrogate, which is not valid Unicode")


def _schema_text(schema: Any) -> str:
    """A JSON schema (dict or JSON text) as compact JSON text; refuses anything but an object."""
    if isinstance(schema, str):
        try:
            schema = jsonlib.loads(schema)
        except ValueError as e:
            raise InvalidInputError("structured_outputs", f"json schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidInputError("structured_outputs", f"json schema must be a JSON object, got {_show(schema)}")
    try:
        return jsonlib.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidInputError("structured_outputs", f"json schema is not JSON data: {e}") from None


def encodes_utf8(text: str) -> bool:
    """Whether ``text`` is valid Unicode (no lone UTF-16 surrogate): it encodes as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Every value accepted here is served (see ``prefixcache.layers.sampler`` for how degenerate
    distributions resolve); anything else raises :class:`InvalidInputError` naming the field.

    Attributes:
        temperature: 0 means greedy (argmax of the raw logits); any finite float > 0 (subnormals
            included) scales logits before sampling. A tiny one samples the argmax (tied argmaxes
            share the mass), a huge one is uniform over the tokens with finite logits.
        top_p: nucleus probability mass kept, in (0, 1]; the most likely token is always kept.
        top_k: keep the k most likely tokens; 0 or -1 keeps all, as does any k >= vocab size.
        max_tokens: new tokens to generate at most, >= 1, no upper bound (the context length,
            ``max_model_len``, also ends generation).
        seed: per-request RNG seed, in [-2**63, 2**64 - n] (what ``torch.Generator`` takes, for
            every sample's ``seed + i``); the same seed and prompt give the same sample, and all 64
            bits count (the runner mixes them into the 32 bits torch's CPU generator keeps).
        stop: strings that end generation; the matched string is not included in the text.
        stop_token_ids: token ids that end generation besides EOS: any ints >= 0 (they are only
            compared with sampled ids, so one outside the vocabulary never matches).
        ignore_eos: keep generating past the model's EOS tokens.
        include_stop_str_in_output: keep the matched stop string in the text.
        prompt_logprobs: per prompt token from the second on, its logprob and rank and the top
            ``prompt_logprobs`` alternatives (0..20) of the raw distribution predicting it
            (vLLM's field; see ``prefixcache.prompt_logprobs``); None: not computed. Served from
            the prefix cache for the cached part of the prompt.
        n: parallel samples of the prompt (1..64). They share the prompt's KV blocks; sample ``i``
            uses seed ``seed + i`` when a seed is given (vLLM v1's rule), so each sample equals the
            same prompt run alone with that seed.
        structured_outputs: constrain the output to a JSON schema, a regex, a list of choices or
            any JSON object (:class:`StructuredOutputsParams`); ``None``: free text.
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token that appears in
            the generated tokens so far (OpenAI's definition, as vLLM applies it). > 0 discourages
            repeats.
        frequency_penalty: in [-2, 2]; subtracted from each token's logit once per time it appears
            in the generated tokens so far (OpenAI's definition, as vLLM applies it).
        repetition_penalty: finite and > 0 (1 = off); every token that appears in the prompt or the
            generated tokens has a positive logit divided by it and a negative one multiplied by
            it (the CTRL paper's rule as HF's ``RepetitionPenaltyLogitsProcessor`` and vLLM apply
            it). > 1 discourages repeats.
        min_p: in [0, 1]; after temperature, drops tokens whose probability is below ``min_p``
            times the most likely token's (vLLM's ``MinPLogitsProcessor``); 0 = off.
        min_tokens: >= 0 and <= max_tokens; until this many tokens are generated, EOS and
            ``stop_token_ids`` get logit -inf (vLLM's ``MinTokensLogitsProcessor``: EOS is masked
            even with ``ignore_eos``). Stop strings still stop.
        logit_bias: token id -> bias in [-100, 100] added to that token's logit (OpenAI's field;
            vLLM's ``LogitBiasLogitsProcessor``). Ids are checked against the model's vocabulary
            when the request is added. Stored as a dict with int keys.
        logprobs: None (off) or k in [0, 20]: for each generated token, its log-probability, its
            rank, and the k most likely tokens' log-probabilities. As vLLM v1 does by default
            (``logprobs_mode="raw_logprobs"``), these are ``log_softmax`` of the model's raw logits,
            before logit_bias, penalties, temperature, min_p, top-k and top-p.

    Greedy rows (temperature 0) take the argmax after logit_bias, min_tokens and the penalties (as
    vLLM does); temperature, min_p, top-k and top-p apply to sampled rows only.

    Raises:
        InvalidInputError: a ``ValueError``, from :meth:`__post_init__`, naming the invalid field.
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
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: Mapping[int, float] | None = None  # stored read-only (FrozenLogitBias)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self._plain_numbers()
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple("stop", self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids))
        _check_number("temperature", self.temperature)
        if not 0 <= self.temperature < float("inf"):
            raise InvalidInputError(
                "temperature", f"temperature must be finite and >= 0, got {_show(self.temperature)}"
            )
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidInputError("top_p", f"top_p must be in (0, 1], got {_show(self.top_p)}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidInputError("top_k", f"top_k must be -1, 0 (disabled) or >= 1, got {_show(self.top_k)}")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise InvalidInputError("max_tokens", f"max_tokens must be >= 1, got {_show(self.max_tokens)}")
        _check_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise InvalidInputError("n", f"n must be in [1, {MAX_N}], got {_show(self.n)}")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs)
            if not 0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS:
                raise InvalidInputError("prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_PROMPT_LOGPROBS}], "
                                                           f"got {_show(self.prompt_logprobs)}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not -(2**63) <= self.seed <= 2**64 - self.n:  # what torch.Generator.manual_seed accepts
                raise InvalidInputError("seed", f"seed must be in [-2**63, 2**64 - n], got {_show(self.seed)}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(name, f"{name} must be a bool, got {_show(getattr(self, name))}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidInputError("stop", f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidInputError("stop", f"stop entries must be non-empty strings, got {_show(s)}")
            if len(s) > MAX_STOP_CHARS:
                raise InvalidInputError("stop", f"stop entries must be at most {MAX_STOP_CHARS} characters, "
                                                f"got one of {len(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidInputError("stop_token_ids", f"stop_token_ids accepts at most {MAX_STOP_TOKEN_IDS} ids, "
                                                      f"got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
            if t < 0:
                raise InvalidInputError("stop_token_ids", f"stop_token_ids must be >= 0, got {_show(t)}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidInputError("structured_outputs", f"structured_outputs must be a StructuredOutputsParams, "
                                                          f"got {_show(self.structured_outputs)}")
        self._check_penalties_and_filters()

    def _check_penalties_and_filters(self) -> None:
        """The fields borrowed from vLLM and OpenAI beyond temperature/top-p/top-k (ranges as theirs)."""
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
            if not -MAX_ABS_PENALTY <= getattr(self, name) <= MAX_ABS_PENALTY:
                raise InvalidInputError(name, f"{name} must be in [-2, 2], got {_show(getattr(self, name))}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty < float("inf"):
            raise InvalidInputError("repetition_penalty", f"repetition_penalty must be finite and > 0, "
                                                          f"got {_show(self.repetition_penalty)}")
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise InvalidInputError("min_p", f"min_p must be in [0, 1], got {_show(self.min_p)}")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidInputError("min_tokens", f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                                                  f"got {_show(self.min_tokens)}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise InvalidInputError("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {_show(self.logprobs)}")
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _check_logit_bias(self.logit_bias))

    def _plain_numbers(self) -> None:
        """numpy's (or any) integer and real scalars in the number fields become int and float, as
        vLLM takes them; a bool stays a bool (and is refused where a number is wanted)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (bool, int, float)) or not isinstance(value, numbers.Real):
                continue
            if isinstance(value, numbers.Integral):
                object.__setattr__(self, f.name, int(value))
            elif f.name not in _INT_FIELDS:  # a float where an int is wanted stays refused
                object.__setattr__(self, f.name, float(value))

    @property
    def has_penalties(self) -> bool:
        """Whether a penalty reads the request's token history (prompt and output)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_number(name: str, value: object) -> None:
    """An int or float (not bool, not NaN) that converts to a float (ints past 1.8e308 do not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise InvalidInputError(name, f"{name} must be a number, got {_show(value)}")
    try:
        float(value)
    except OverflowError:
        raise InvalidInputError(name, f"{name} must be finite, got {_show(value)}") from None


class FrozenLogitBias(dict):
    """A checked ``logit_bias``: a dict (it pickles, deep-copies and serializes as one) that refuses
    changes: a key set to -1 after the check used to bias the vocabulary's last token."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("logit_bias is read-only once SamplingParams has checked it; build a new SamplingParams")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self):
        return FrozenLogitBias, (dict(self),)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


_INT_FIELDS = frozenset({"top_k", "max_tokens", "seed", "n", "prompt_logprobs", "min_tokens", "logprobs"})


def _check_logit_bias(value: object) -> Mapping[int, float]:
    """A read-only copy (:class:`FrozenLogitBias`) of ``logit_bias`` with int keys >= 0 and float
    values in [-100, 100]."""
    if not isinstance(value, Mapping):
        raise InvalidInputError("logit_bias", f"logit_bias must be a dict of token id -> bias, got {_show(value)}")
    checked = {}
    for token_id, bias in value.items():
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral) or token_id < 0:
            raise InvalidInputError("logit_bias", f"logit_bias keys must be token ids (ints >= 0), got {_show(token_id)}")
        # (NaN fails the range test; ints of any size compare exactly)
        if isinstance(bias, bool) or not isinstance(bias, numbers.Real) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidInputError("logit_bias", f"logit_bias values must be numbers in [-100, 100], "
                                                  f"got {_show(bias)} for token {token_id}")
        checked[int(token_id)] = float(bias)
    return FrozenLogitBias(checked)


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(name, f"{name} must be an integer, got {_show(value)}")


def _as_tuple(name: str, value: object) -> tuple:
    """``None`` -> ``()``; an iterable -> its tuple (entries are checked by the caller)."""
    if value is None:
        return ()
    if isinstance(value, (bytes, bytearray, Mapping)):
        raise InvalidInputError(name, f"{name} must be a list, got {_show(value)}")
    try:
        return tuple(value)
    except TypeError:
        raise InvalidInputError(name, f"{name} must be a list, got {_show(value)}") from None


def _show(value: object) -> str:
    """``repr(value)`` for messages, short for huge ints (whose repr may even be refused)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
