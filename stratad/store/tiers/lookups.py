"""Experts served, counted by the tier each came from: what the control socket's hit rates and
/metrics read, the same for every runner's store."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Lookups:
    vram: int = 0
    ram: int = 0
    file: int = 0

    @property
    def total(self) -> int:
        return self.vram + self.ram + self.file

    @property
    def hit_rate(self) -> float:
        """Found in VRAM, over all (0 before the first)."""
        return self.vram / self.total if self.total else 0.0

    def add(self, tier: str) -> None:
        """One expert served from `tier` ("vram", "ram" or "file")."""
        setattr(self, tier, getattr(self, tier) + 1)

    def clear(self) -> None:
        self.vram = self.ram = self.file = 0
