"""Speculation as the generator runs it: the drafter, and how each sequence's draft length
follows its acceptance (`speculation.*` in the config)."""

from __future__ import annotations

from dataclasses import dataclass

from stratad.runtime.speculation.cost import DEFAULT_TOKEN_COST
from stratad.runtime.speculation.drafter import Drafter, Drafts, PromptLookup
from stratad.runtime.speculation.length import DraftLength
from stratad.runtime.speculation.suffix import SuffixDecoding


@dataclass(frozen=True)
class Speculation:
    drafter: Drafter
    max_draft: int = 8
    token_cost: float = DEFAULT_TOKEN_COST  # the prior, until the loop measured its steps

    @classmethod
    def from_config(
        cls, drafter: str, max_draft: int, token_cost: float, backend: str,
        draft_model: Drafter | None = None,
    ) -> Speculation | None:  # fmt: skip
        """The config's setting for the engine `backend` runs; None where it is off.
        `draft_model`: the drafter of `model.draft` (`speculation.draft_model`), for
        drafter = "draft_model"."""
        if drafter == "auto":
            drafter = "prompt_lookup" if backend == "cpu" else "off"
        if drafter == "off":
            return None
        if drafter == "prompt_lookup":
            return cls(PromptLookup(), max_draft, token_cost)
        if drafter == "suffix":
            return cls(SuffixDecoding(), max_draft, token_cost)
        if drafter == "draft_model":
            if draft_model is None:
                raise ValueError('speculation.drafter "draft_model" needs model.draft')
            return cls(draft_model, max_draft, token_cost)
        raise ValueError(
            f"speculation.drafter {drafter!r}: off, prompt_lookup, suffix or draft_model"
        )

    def start(self, prompt: list[int], scope: str = "") -> tuple[Drafts, DraftLength]:
        """A new sequence's drafter (fed its prompt) and draft length; `scope`: the
        request's."""
        return self.drafter.start(prompt, scope), DraftLength(self.max_draft)
