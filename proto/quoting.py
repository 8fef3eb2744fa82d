"""How a message's own values appear in an error text: quoted, and cut to a bound.

An error names the value it refuses (which tenant, which version), and that value came from the sender: a
megabyte ``tenant`` or ``v`` would otherwise come back in full in the error reply and in every log line that
carries the error, so one message could make a service write megabytes. Every error text that quotes a value
from a message quotes it through :func:`quoted`.
"""

from __future__ import annotations

from typing import Any

QUOTE_CHARS = 80  # what a reader needs to recognise the value
TEXT_CHARS = 300  # one reason (a validator's message) at most


def quoted(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters with the full length said, e.g. ``'aaaa…' (1,000,000 chars)``.
    A huge container is cut before its repr is built (a repr of a deep or long list can cost as much as the
    message)."""
    if isinstance(value, (str, bytes)):
        if len(value) <= limit:
            return repr(value)
        return f"{value[:limit]!r}… ({len(value):,} {'chars' if isinstance(value, str) else 'bytes'})"
    if isinstance(value, (list, tuple, dict, set)) and len(value) > limit:
        return f"<{type(value).__name__} of {len(value):,} items>"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} chars)"


def clipped(text: str, limit: int = TEXT_CHARS) -> str:
    """A text cut to ``limit`` characters (a reason that may embed values it did not quote)."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} chars)"
