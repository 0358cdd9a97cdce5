"""Errors that carry what went wrong in a form callers can act on without parsing messages.

:class:`InvalidInputError` is a ``ValueError`` (so ``except ValueError`` and
``pytest.raises(ValueError)`` keep working) that names the offending input field. The server turns
it into an HTTP 400 with that field as OpenAI's ``error.param``; the offline API raises it as is.
"""

from __future__ import annotations


class InvalidInputError(ValueError):
    """An invalid request or option value.

    Args:
        field: the input field at fault (``"temperature"``, ``"prompt"``, ``"max_tokens"``, ...),
            or ``None`` when no single field is.
        message: what is wrong; by convention it starts with the field's name.
    """

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters + ``"..."`` (a value quoted in a message may be huge)."""
    return text if len(text) <= limit else text[:limit] + "..."


def clip(value: object, limit: int) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters + ``"..."``."""
    return cut(repr(value), limit)


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun`` in the number ``n`` takes, for messages: ``1 token``, ``2 tokens``, ``0 tokens``
    (``noun`` is the singular; its plural adds an ``s``)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def lone_surrogate(text: str) -> str | None:
    """Why ``text`` is not valid Unicode (a lone surrogate such as ``"\\ud800"``, which JSON can carry
    but UTF-8 can't), as the one sentence every field's error uses; None for valid text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"contains a lone surrogate (U+{ord(e.object[e.start]):04X} at character {e.start}), which is not valid Unicode"
    return None
