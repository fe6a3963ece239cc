"""Byte units and how sizes read in the store's log lines."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def size_text(n: int) -> str:
    """`1.25 GiB` from a GiB up, `12.0 MiB` below."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"
