"""Incremental detokenization: a request's output text grown by each new token's bytes, instead of
decoding every output token again at every step, which grows with the output (milliseconds per
step at thousands of generated tokens); streaming and stop strings need the text after every token.

Exact by construction for the tokenizers it accepts (:func:`byte_concat_decoder`): a byte-level BPE
tokenizer (GPT-2's alphabet: SmolLM2, Llama 3, Qwen2/3) decodes a list of ids as the UTF-8 decode,
with U+FFFD for invalid or incomplete sequences, of the concatenation of each token's bytes, special
tokens left out when skipped. Feeding those bytes to Python's incremental UTF-8 decoder gives the
same characters as decoding them whole (the codec's contract), and the bytes it still holds (at
most an incomplete character's first 3) decode to what the whole decode ends with. Any other
tokenizer (SentencePiece's Metaspace decoder, clean-up of tokenization spaces, a custom ``_decode``)
is decoded whole as before, since its decode is not a concatenation. vLLM v0 decodes a window of
recent tokens instead (``detokenize_incrementally``'s prefix and read offsets), which works for any
tokenizer but can differ from the full decode; here the text equals ``tokenizer.decode(ids,
skip_special_tokens=True)`` exactly (``tests/engine/test_detokenizer.py``).

:class:`TokenDecoder` gives one token's exact bytes and text: the pieces the incremental decode
joins, and the token strings of logprobs.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

_SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenDecoder:
    """A single token's exact bytes and text, memoised per id (logprobs name tokens one by one).

    Byte-level BPE tokenizers (GPT-2's alphabet, as SmolLM2's) spell each byte as one character:
    the token's string maps back to its bytes exactly, a piece of a multi-byte character included.
    SentencePiece byte tokens ``<0xNN>`` are that byte; any other token is its decoded text's UTF-8.
    The text is the bytes decoded with replacement (U+FFFD for a partial character), as the token
    reads on its own.

    Args:
        tokenizer: the model's tokenizer.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_level = _byte_level_decoder() if type(decoder).__name__ == "ByteLevel" else None
        self._memo: dict[int, tuple[str, bytes]] = {}

    @property
    def byte_level(self) -> bool:
        """Whether the tokenizer's decoder is the byte-level one (GPT-2's alphabet)."""
        return self._byte_level is not None

    def text(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def bytes(self, token_id: int) -> bytes:
        return self._lookup(token_id)[1]

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        found = self._memo.get(token_id)
        if found is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece is None:  # an id past the tokenizer's vocabulary (a padded lm_head row)
                raw = b""
            elif self._byte_level is not None and all(c in self._byte_level for c in piece):
                raw = bytes(self._byte_level[c] for c in piece)
            elif (m := _SENTENCEPIECE_BYTE.fullmatch(piece)) is not None:
                raw = bytes([int(m.group(1), 16)])
            else:
                raw = self.tokenizer.decode([token_id]).encode("utf-8")
            found = self._memo[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return found


def byte_concat_decoder(tokenizer: PreTrainedTokenizerBase, decoder: TokenDecoder) -> Callable[[int], bytes] | None:
    """The bytes each token adds to ``tokenizer.decode(ids, skip_special_tokens=True)``, when that
    decode is the UTF-8 decode of their concatenation; else None.

    Args:
        tokenizer: the model's tokenizer.
        decoder: its :class:`TokenDecoder` (a token's exact bytes, and whether the tokenizer's
            decoder is the byte-level one, GPT-2's alphabet).

    Returns:
        ``id -> bytes`` (empty for a special token, which the decode skips), or None when the
        tokenizer's decode does more than concatenate (then decode whole).
    """
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # transformers < 5: no exact rule known here
        return None
    token_bytes = decoder.bytes
    if not decoder.byte_level or type(tokenizer)._decode is not TokenizersBackend._decode:
        return None
    if tokenizer.clean_up_tokenization_spaces and (
        type(tokenizer.backend_tokenizer.model).__name__ != "BPE"
        or getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    ):
        return None
    skipped = set()
    for token_id in tokenizer.added_tokens_decoder:  # what the decode skips: the special added tokens
        alone = tokenizer.decode([token_id], skip_special_tokens=True)
        if alone == "":
            skipped.add(token_id)
        elif alone != token_bytes(token_id).decode("utf-8", errors="replace"):
            return None  # an added token that decodes otherwise than its bytes (not seen so far)
    skipped = frozenset(skipped)
    return lambda token_id: b"" if token_id in skipped else token_bytes(token_id)


class IncrementalDetokenizer:
    """One request's output text, fed the new tokens' bytes (see the module docstring).

    Args:
        token_bytes: ``id -> bytes`` from :func:`byte_concat_decoder`.
    """

    __slots__ = ("_token_bytes", "_utf8", "_text", "num_ids")

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""  # the characters the bytes fed so far settle
        self.num_ids = 0  # output tokens fed so far

    def text(self, token_ids: list[int], num_ids: int) -> str:
        """The decode of ``token_ids[:num_ids]``: feeds the ids not fed yet.

        Raises:
            ValueError: ``num_ids`` is below the number already fed (the text can't go back).
        """
        if num_ids < self.num_ids:
            raise ValueError(f"num_ids {num_ids} < the {self.num_ids} tokens already decoded")
        if num_ids > self.num_ids:
            new = b"".join(map(self._token_bytes, token_ids[self.num_ids:num_ids]))
            self._text += self._utf8.decode(new)
            self.num_ids = num_ids
        pending = self._utf8.getstate()[0]  # an incomplete character's bytes
        return self._text + pending.decode("utf-8", errors="replace") if pending else self._text
