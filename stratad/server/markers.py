"""Text held back while a reply streams: the end of what has come that may be the start of a
marker the reader looks for (a tool call's tag, a harmony header), shown only once it is known
not to be one."""

from __future__ import annotations

from collections.abc import Sequence


def held_back(text: str, markers: Sequence[str]) -> int:
    """How many of `text`'s last characters may begin one of `markers`."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0
