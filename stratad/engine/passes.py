"""What one pass of the offload engine computes: a decode step or a chunk of a prompt.

A pass object replaces the old sentinel (`start=None` meant decode) and the token-count
thresholds spread over the engine: each helper asks the pass what it is.
"""

from __future__ import annotations

from dataclasses import dataclass

# A chunk of at most this many tokens routes to few experts: the fused kernels read each
# routed expert where it is (VRAM slot, or a miss path). Longer chunks route to nearly every
# expert of a layer, so the layer's experts are staged whole and run as grouped GEMMs.
FUSED_MAX_TOKENS = 8


@dataclass(frozen=True)
class Decode:
    """One new token through the static cache. Its position is read on the device, so one
    captured graph serves every step of a cache; its routing moves experts between steps."""

    tokens: int = 1

    decode = True
    staged = False

    @property
    def fused(self) -> bool:
        return True


@dataclass(frozen=True)
class Chunk:
    """`tokens` prompt tokens at positions start.., attending over the cache up to their end."""

    start: int
    tokens: int

    decode = False

    @property
    def staged(self) -> bool:
        """Every expert of a layer staged into VRAM for grouped GEMMs (a long chunk)."""
        return self.tokens > FUSED_MAX_TOKENS

    @property
    def fused(self) -> bool:
        """The routed experts through the fused kernels, as a decode step reads them."""
        return not self.staged


Pass = Decode | Chunk
