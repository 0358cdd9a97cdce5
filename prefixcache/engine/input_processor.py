"""Input processing: validation, tokenization and cache keys, up to a :class:`Request` ready to
schedule (vLLM v1's ``InputProcessor`` role).

Everything a request brings is checked here, before it is queued, with an
:class:`~prefixcache.errors.InvalidInputError` naming the field; nothing invalid reaches the
scheduler. The cheap checks come first: a text prompt longer than any text that fits the context
(more than ``max_model_len`` times the longest token's text) is refused before it is tokenized; a
long one is tokenized in pieces first and refused as soon as its count clearly passes the context
(so a 10 MB prompt costs milliseconds, not seconds of tokenizing); a conversation of more messages
than the context has tokens is refused before the template renders it.

Tokenization uses the model's tokenizer, or one passed in: the async engine tokenizes on a thread
of its own with its own copy (the engine thread detokenizes with the model's tokenizer meanwhile).

Prompt plus ``max_tokens`` must fit the context (``max_model_len``): a request that can't is refused
(field ``max_tokens``), as OpenAI and vLLM's server do, rather than silently cut short.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from typing import NamedTuple

import torch

from prefixcache.cache.hashing import BlockHasher, hash_seed_bytes, make_root_key, tenant_extra_key
from prefixcache.config import INT4_DECODER_FORMATS, W8A8_FORMATS, EngineConfig
from prefixcache.engine.tenancy import ApprovedPrefixes, validate_tenant
from prefixcache.errors import InvalidInputError, counted, lone_surrogate
from prefixcache.layers.lora import LoRAAdapter
from prefixcache.layers.attention.numerics import kv_numerics
from prefixcache.layers.quant import INT4_OUTPUT_KEY
from prefixcache.models.loader import LoadedModel
from prefixcache.request import Request
from prefixcache.sampling_params import SamplingParams

MAX_CACHE_SALT_CHARS = 1024
# A text of C characters has at least C / (longest token text) tokens; normalization may shrink a
# text (composing characters), so the bound allows this factor on top.
_NORMALIZATION_SLACK = 4
# Texts longer than max_model_len * this many characters are first counted in pieces of
# _SCREEN_CHUNK_CHARS (no real text averages more characters per token), and refused once the count
# passes twice the context (cutting a text can change its token count, never double it).
_SCREEN_CHARS_PER_TOKEN = 8
_SCREEN_CHUNK_CHARS = 1 << 14


class ProcessedPrompt(NamedTuple):
    """A tokenized prompt: its text (``None`` when given as token ids) and token ids."""

    text: str | None
    token_ids: list[int]


def kv_blocks_needed(block_size: int, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> int:
    """KV blocks a request holds at its longest: the ``n`` samples share the prompt's full blocks;
    each needs its own blocks after them, up to ``max_tokens`` generated tokens."""
    num_prompt_blocks = num_prompt_tokens // block_size
    per_sample = math.ceil((num_prompt_tokens + max_tokens) / block_size) - num_prompt_blocks
    return num_prompt_blocks + n * per_sample


def max_tokens_that_fit(block_size: int, num_blocks: int, max_model_len: int, num_prompt_tokens: int,
                        n: int = 1) -> int:
    """The largest ``max_tokens`` with ``num_prompt_tokens + max_tokens <= max_model_len`` and
    ``kv_blocks_needed(...) <= num_blocks`` for ``n`` samples: :func:`kv_blocks_needed` inverted
    (each sample may fill ``(num_blocks - full prompt blocks) // n`` blocks after the shared ones).
    0 or less when not even one token fits."""
    full = num_prompt_tokens // block_size
    per_sample = max(0, num_blocks - full) // n
    return min(max_model_len, (full + per_sample) * block_size) - num_prompt_tokens


# How a refusal says to make the pool bigger: the flags, and the options' names offline
POOL_HINT = "raise --num-blocks or --kv-cache-memory (num_blocks / kv_cache_memory_bytes offline)"


class InputProcessor:
    """Turns what a caller sends into a validated, keyed :class:`Request`.

    Args:
        config: the engine's options (``block_size``, ``hash_seed``, ``hash_seed_file``).
        loaded: the model (tokenizer, vocabulary, the weights' fingerprint).
        max_model_len: the context limit in tokens.
        num_blocks: the KV pool's blocks one request's full-attention context may count on (a request that can
            never fit is refused).
        held_blocks: blocks of the pool held back from that for sliding-window layers (named in the refusal).
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel, max_model_len: int, num_blocks: int,
                 held_blocks: int = 0) -> None:
        self.block_size = config.block_size
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.config.vocab_size
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.held_blocks = held_blocks
        # int4: generated tokens run other kernels than prompt tokens, their blocks get their own key
        self.block_hasher = BlockHasher(config.block_size, config.hash_algo,
                                        INT4_OUTPUT_KEY if config.quantization in INT4_DECODER_FORMATS else b"")
        self.approved_prefixes = ApprovedPrefixes()
        self._hash_seed = hash_seed_bytes(config.hash_seed, config.hash_seed_file)
        self._model_key: tuple[bytes, bytes] | None = None  # (loaded.fingerprint, key) memo
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = max_model_len * max(1, longest) * _NORMALIZATION_SLACK

    # ------------------------------------------------------------------ keys
    @property
    def model_key(self) -> bytes:
        """The cache key's model part: the weights' fingerprint, the dtype K/V is computed in, the
        weight quantization (with what its weights were derived from: ``quantization_key``), the
        attention's rules (``attention.numerics.kv_numerics``) and the model's own numerics rules
        (``numerics_key``: Gemma 3's window, "" for the Llama family, whose key then is the one it
        always was): K/V computed at another precision or with other bits is never reused. Follows
        the loaded model's fingerprint, which changes whenever its weights are replaced."""
        model = self.loaded.model
        paged = model.paged_attention
        # the paged kernel's forms (a model with sliding-window layers runs them on another) and its fused ops
        forms = (model.paged_attention_form, model.sliding_attention_form, model.fuses_prompt_ops)
        quantization_key = model.quantization_key  # int8's smoothing and its calibration
        numerics_key = model.numerics_key  # a model's attention rules (e.g. a sliding window)
        memo = (self.loaded.fingerprint + self.loaded.quantization.encode() + bytes([paged]) + repr(forms).encode()
                + quantization_key.encode() + b"\0" + numerics_key.encode())
        if self._model_key is None or self._model_key[0] != memo:
            quantization = self.loaded.quantization  # int8, int4-int8: W8A8 products, no bf16 GEMM at all
            numerics = kv_numerics(paged, bf16_gemms=self.loaded.dtype == torch.bfloat16
                                   and quantization not in W8A8_FORMATS, int4=quantization in INT4_DECODER_FORMATS,
                                   form=forms[0], sliding_form=forms[1], prompt_ops=forms[2])
            weights_format = f"{self.loaded.dtype}|quantization={quantization}|{quantization_key}|{numerics}"
            if numerics_key:  # appended only when set: an empty one leaves the key byte-identical
                weights_format += f"|model-numerics={numerics_key}"
            key = hashlib.sha256(self.loaded.fingerprint + weights_format.encode()).digest()
            self._model_key = (memo, key)
        return self._model_key[1]

    def root_key(self, cache_salt: str | None = None, adapter: LoRAAdapter | None = None) -> bytes:
        """The cache-key root of a request: model key, hash seed, cache_salt, adapter digest."""
        digest = adapter.digest if adapter is not None else b""
        return make_root_key(self.model_key, cache_salt, self._hash_seed, digest)

    # ------------------------------------------------------------------ tokenization
    def tokenize(self, prompt: str | list[int] | ProcessedPrompt, tokenizer=None,
                 add_special_tokens: bool = True) -> ProcessedPrompt:
        """Text → token ids (special tokens added as the tokenizer does); token ids are checked.

        Args:
            prompt: text, token ids, or an already tokenized prompt (its ids range-checked again).
            tokenizer: the one to use (a thread's own copy); default the model's.
            add_special_tokens: add the tokenizer's special tokens (BOS...) to a text, as every
                request does; ``/tokenize`` may turn it off (vLLM's ``add_special_tokens``).

        Raises:
            InvalidInputError: (field ``prompt``) empty, not text or token ids, text longer than
                any prompt that fits the context, or a token id outside the vocabulary.
        """
        if isinstance(prompt, ProcessedPrompt):
            ids = prompt.token_ids
            if (prompt.text is None or not isinstance(ids, list) or not ids or set(map(type, ids)) != {int}
                    or min(ids) < 0 or max(ids) >= self.vocab_size):
                return ProcessedPrompt(prompt.text, self.tokenize(ids).token_ids)  # checked id by id
            return prompt  # the tokenizer's own ids (plain ints, in range): not checked one by one again
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError("prompt", "prompt must not be empty")
            self.check_text_length(len(prompt))
            check_unicode("prompt", prompt)
            ids = self._encode(prompt, tokenizer or self.tokenizer, add_special_tokens, "prompt")
            return ProcessedPrompt(prompt, ids)
        if not isinstance(prompt, (list, tuple)):
            raise InvalidInputError("prompt", f"prompt must be a string or a list of token ids, "
                                              f"got {type(prompt).__name__}")
        if not prompt:
            raise InvalidInputError("prompt", "prompt must not be empty")
        return ProcessedPrompt(None, self.check_token_ids(prompt, "prompt"))

    @property
    def max_token_ids(self) -> int:
        """The most token ids a prompt (or a ``/detokenize`` list) may hold before it is refused
        without a look at its ids: twice the context, the text screen's bound (tokens)."""
        return 2 * self.max_model_len + 1024

    def check_token_ids(self, token_ids: list[int], field: str) -> list[int]:
        """``token_ids`` as plain ints, each checked to be in the vocabulary.

        Raises:
            InvalidInputError: naming ``field``, for more than :attr:`max_token_ids` ids (counted
                before any id is looked at, so a huge list costs no per-id work), an id outside
                ``[0, vocab_size)`` or not an integer (any integer type, numpy's too, is accepted;
                never a bool).
        """
        if len(token_ids) > self.max_token_ids:
            raise InvalidInputError(field, f"{field} has {len(token_ids)} token ids, more than {self.max_token_ids} "
                                           f"(twice max_model_len {self.max_model_len}, plus 1024)")
        if token_ids and set(map(type, token_ids)) == {int}:  # the usual list of plain ints: C loops only
            if min(token_ids) >= 0 and max(token_ids) < self.vocab_size:
                return list(token_ids)
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < self.vocab_size:
                what = "tokens" if field == "tokens" else f"{field} token ids"  # /detokenize's field is the ids
                raise InvalidInputError(field, f"{what} must be integers in [0, {self.vocab_size}), "
                                               f"got {str(t)[:40]!r} ({type(t).__name__})")
        return [int(t) for t in token_ids]

    def detokenize(self, token_ids: list[int], tokenizer=None, field: str = "tokens") -> str:
        """Token ids → text, special tokens kept (what the model reads; vLLM's ``/detokenize``).

        Raises:
            InvalidInputError: naming ``field``, for an id outside the vocabulary.
        """
        return (tokenizer or self.tokenizer).decode(self.check_token_ids(token_ids, field))

    def token_strs(self, token_ids: list[int], tokenizer=None) -> list[str]:
        """Each (in-vocabulary) token id's own string in the vocabulary (``"Ġthe"`` for a byte-level
        BPE), as ``tokenizer.convert_ids_to_tokens`` gives it."""
        return [str(t) for t in (tokenizer or self.tokenizer).convert_ids_to_tokens(token_ids)]

    def _encode(self, text: str, tokenizer, add_special_tokens: bool, field: str) -> list[int]:
        """``tokenizer.encode`` after the screen for texts far beyond the context (module docstring).

        Raises:
            InvalidInputError: naming ``field``, when the pieces' count passes twice the context.
        """
        if len(text) > self.max_model_len * _SCREEN_CHARS_PER_TOKEN:
            limit, count = 2 * self.max_model_len + 1024, 0
            for start in range(0, len(text), _SCREEN_CHUNK_CHARS):
                count += len(tokenizer.encode(text[start : start + _SCREEN_CHUNK_CHARS], add_special_tokens=False))
                if count > limit:
                    raise InvalidInputError(field, f"{field} is over {count} tokens (counted {start + _SCREEN_CHUNK_CHARS} "
                                                   f"of its {len(text)} characters); max_model_len is {self.max_model_len}")
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_text_length(self, num_chars: int, field: str = "prompt") -> None:
        """Refuses, without tokenizing, a text too long to fit the context in any tokenization.

        Raises:
            InvalidInputError: ``num_chars > max_prompt_chars``.
        """
        if num_chars > self.max_prompt_chars:
            raise InvalidInputError(field, f"{field} is {num_chars} characters, more than any prompt that fits "
                                           f"max_model_len {self.max_model_len} tokens can have")

    def apply_chat_template(
        self, conversation: list[dict[str, str]], add_generation_prompt: bool = True, tokenizer=None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Renders one conversation with the model's chat template → prompt token ids (with
        ``tokenizer``, a thread's own copy, if given). The template writes the special tokens
        itself, so a chat request adds none when encoding (``add_special_tokens``: vLLM's
        ``/tokenize`` option, default False as there).

        Raises:
            InvalidInputError: (field ``messages``) malformed messages, a conversation too long for
                the context, or one the template can't render.
        """
        if not isinstance(conversation, list) or not conversation:
            raise InvalidInputError("messages", "messages must be a non-empty list of {'role', 'content'} dicts")
        for m in conversation:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidInputError("messages", f"each message needs string 'role' and 'content', "
                                                    f"got {str(m)[:100]!r}")
        if len(conversation) > self.max_model_len:  # every message renders to at least one token
            raise InvalidInputError("messages", f"messages has {len(conversation)} messages; max_model_len is "
                                                f"{self.max_model_len} tokens")
        self.check_text_length(sum(len(m["role"]) + len(m["content"]) for m in conversation), "messages")
        for m in conversation:
            check_unicode("messages", m["role"])
            check_unicode("messages", m["content"])
        tokenizer = tokenizer or self.tokenizer
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja raises its own errors for conversations it can't render
            raise InvalidInputError("messages", f"messages could not be rendered with the chat template: {e}") from e
        return self._encode(text, tokenizer, add_special_tokens, "messages")

    # ------------------------------------------------------------------ approved prefixes
    def add_approved_prefix(self, prompt: str | list[int]) -> int:
        """Declares a public prefix every tenant may share (tokenized as a completion prompt is);
        returns its length in tokens. Raises InvalidInputError for an empty or bad prompt."""
        token_ids = self.tokenize(prompt).token_ids
        self.approved_prefixes.add(token_ids)
        return len(token_ids)

    def add_approved_system_prompt(self, content: str) -> int:
        """Approves a chat system message: the template's rendering of it, as a chat request's head.

        Raises:
            InvalidInputError: empty content, or the template can't render a lone system message.
        """
        if not isinstance(content, str) or not content:
            raise InvalidInputError("messages", "an approved system prompt must be a non-empty string")
        token_ids = self.apply_chat_template([{"role": "system", "content": content}], add_generation_prompt=False)
        self.approved_prefixes.add(token_ids)
        return len(token_ids)

    # ------------------------------------------------------------------ requests
    def check_request(
        self, params: object, cache_salt: str | None, tenant: str | None
    ) -> SamplingParams:
        """Checks what a request brings besides its prompt; returns its sampling params.

        Raises:
            InvalidInputError: naming ``sampling_params``, ``cache_salt``, ``tenant``, ``stop`` or
                ``logit_bias`` (a token id outside the vocabulary).
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidInputError("sampling_params", f"sampling_params must be a SamplingParams, "
                                                       f"got {type(params).__name__}")
        if cache_salt is not None and (
            not isinstance(cache_salt, str) or not cache_salt or len(cache_salt) > MAX_CACHE_SALT_CHARS
        ):
            raise InvalidInputError("cache_salt", f"cache_salt must be a non-empty string of at most "
                                                  f"{MAX_CACHE_SALT_CHARS} characters")
        if cache_salt is not None:
            check_unicode("cache_salt", cache_salt)
        for stop in params.stop:
            check_unicode("stop", stop)
        if params.logit_bias:
            bad = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidInputError("logit_bias", f"logit_bias token ids must be in [0, {self.vocab_size}), "
                                                      f"got {bad[0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else ""))
        try:
            validate_tenant(tenant)
        except ValueError as e:
            raise InvalidInputError("tenant", str(e)) from e
        return params

    def kv_blocks_needed(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> int:
        """:func:`kv_blocks_needed` with this engine's block size."""
        return kv_blocks_needed(self.block_size, num_prompt_tokens, max_tokens, n)

    def max_tokens_that_fit(self, num_prompt_tokens: int, n: int = 1) -> int:
        """:func:`max_tokens_that_fit` with this engine's block size, pool and context."""
        return max_tokens_that_fit(self.block_size, self.num_blocks, self.max_model_len, num_prompt_tokens, n)

    def check_prompt_fits(self, num_prompt_tokens: int) -> None:
        """Refuses a prompt the context can't hold with one generated token. Reads only immutable
        settings: the async engine calls it on its input thread, so such a prompt is refused at once,
        not after a running step.

        Raises:
            InvalidInputError: ``prompt``.
        """
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidInputError("prompt", f"prompt is {counted(num_prompt_tokens, 'token')}; max_model_len is "
                                              f"{self.max_model_len} (the prompt plus at least one generated "
                                              "token must fit)")

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Refuses a prompt the context or the KV pool can never hold with its ``max_tokens``.

        Raises:
            InvalidInputError: ``prompt`` (no room for one generated token) or ``max_tokens``.
        """
        self.check_prompt_fits(num_prompt_tokens)
        max_len = num_prompt_tokens + params.max_tokens
        if max_len > self.max_model_len:
            raise InvalidInputError("max_tokens", f"max_tokens {params.max_tokens} plus the prompt's "
                                                  f"{counted(num_prompt_tokens, 'token')} exceed max_model_len "
                                                  f"{self.max_model_len}; lower max_tokens to at most "
                                                  f"{self.max_model_len - num_prompt_tokens}")
        needed = self.kv_blocks_needed(num_prompt_tokens, params.max_tokens, params.n)
        if needed <= self.num_blocks:
            return
        alone = self.kv_blocks_needed(num_prompt_tokens, 1)
        if alone > self.num_blocks:  # the prompt itself: no max_tokens or n would fit
            raise InvalidInputError("prompt", f"the prompt ({counted(num_prompt_tokens, 'token')}) plus 1 token needs "
                                              f"{counted(alone, 'KV block')} but the pool has {self.pool_text()}; "
                                              f"shorten the prompt or {POOL_HINT}")
        samples = f" x n={params.n} samples" if params.n > 1 else ""
        raise InvalidInputError("max_tokens", f"prompt + max_tokens ({counted(max_len, 'token')}{samples}) needs "
                                              f"{counted(needed, 'KV block')} but the pool has {self.pool_text()}; "
                                              f"lower max_tokens or {POOL_HINT}")

    def pool_text(self) -> str:
        """The pool a request may count on, for a refusal: ``"32 blocks"``, or with sliding-window layers
        ``"32 blocks for it (202, less 170 that the sliding-window layers hold)"``."""
        if not self.held_blocks:
            return counted(self.num_blocks, "block")
        return (f"{counted(self.num_blocks, 'block')} for it ({self.num_blocks + self.held_blocks}, less "
                f"{self.held_blocks} that the sliding-window layers hold)")

    def make_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        cache_salt: str | None = None,
        adapter: LoRAAdapter | None = None,
        tenant: str | None = None,
        stream: bool = False,
    ) -> Request:
        """A request keyed by its model, salt, adapter and tenant, its block hashes computed.

        Under tenant isolation the blocks inside an approved prefix are keyed without the tenant,
        unless the request has a ``cache_salt``: then every block is its tenant's, so no other
        tenant can confirm a guessed salt by a hit (the salt is in the chain's root)."""
        num_shared_blocks = 0
        if tenant is not None and cache_salt is None:  # a salt shares nothing across tenants, not even these
            num_shared_blocks = self.approved_prefixes.shared_length(prompt.token_ids) // self.block_size
        return Request(
            request_id, prompt.token_ids, params, self.block_hasher, self.root_key(cache_salt, adapter),
            stream=stream, lora=adapter, tenant_key=tenant_extra_key(tenant),
            num_shared_blocks=num_shared_blocks, prompt=prompt.text,
        )


def check_unicode(field: str, text: str) -> None:
    """Refuses text that is not valid Unicode (a lone surrogate such as ``"\\ud800"``, which JSON
    can carry but UTF-8 can't): the tokenizer, the hash and the response would all fail on it.

    Raises:
        InvalidInputError: naming ``field``.
    """
    if (why := lone_surrogate(text)) is not None:
        raise InvalidInputError(field, f"{field} {why}")
