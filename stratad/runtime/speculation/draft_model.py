"""Draft-model speculation: a smaller model with the target's vocabulary proposes each
sequence's next tokens, greedily (llama.cpp's `--model-draft`, vLLM's draft model).

The draft runs on the cpu engine (the compiled CPU kernels), whatever engine serves the
target, with a KV cache of its own per sequence holding the tokens the target settled. A
proposal of k tokens first feeds what was settled since the last one (the drafts that stood
and the target's own token: one pass), then decodes k - 1 more; the drafts the target did not
keep are cut from the cache at the next proposal (`KVCache.common_prefix`, `truncate`). The k
draft passes are part of what a drafted token costs the loop (`speculation.cost` times the
step from before the proposals), so a draft model that does not pay stops being asked.

The sequences of one draft model are proposed for together (`DraftSequence.propose_many`,
through `speculation.drafter.propose_all`): one batched pass of the draft per drafted position.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from stratad.config import EngineConfig
from stratad.engine.batch import Seq
from stratad.engine.kv import KVCache, KVPoolFull
from stratad.engine.reference.forward import ReferenceForward
from stratad.engine.reference.weights_mode import cpu_weights
from stratad.model.spec import ModelError
from stratad.model.text.tokenizer_build import load_tokenizer
from stratad.store.loader import load_model

log = logging.getLogger("stratad.engine")

VOCAB_SLACK = 128  # ids one vocabulary may have past the other's end (padding, as llama.cpp)


class DraftModelError(ModelError):
    """The draft model cannot draft for this target (another vocabulary): the start fails as
    for a model that cannot be served."""


def vocabulary_mismatch(target: Mapping[str, int], draft: Mapping[str, int]) -> str | None:
    """Why a model with vocabulary `draft` (token -> id) cannot draft for `target`, or None:
    every id below the smaller vocabulary's end names the same token in both, and neither
    has more than `VOCAB_SLACK` ids past it."""
    by_id = {i: t for t, i in target.items()}
    n = min(len(target), len(draft))
    if abs(len(target) - len(draft)) > VOCAB_SLACK:
        return f"{len(draft)} tokens against the model's {len(target)}"
    for token, i in sorted(draft.items(), key=lambda kv: kv[1]):
        if i < n and by_id.get(i) != token:
            return f"token {i} is {token!r} there, {by_id.get(i)!r} in the model"
    return None


@dataclass(frozen=True)
class DraftModel:
    """A drafter (`speculation.drafter = "draft_model"`): each sequence's drafts are the
    greedy tokens of `forward`, a model whose ids below `vocab` mean what the target's do."""

    forward: ReferenceForward
    vocab: int  # ids the target has (a draft token past them is not proposed)
    capacity: int  # tokens of context per sequence (the target's)

    def start(self, prompt: list[int], scope: str = "") -> DraftSequence:
        seq = DraftSequence(self.forward, self.forward.new_cache(self.capacity), self.vocab)
        seq.extend(prompt)
        return seq


class DraftSequence:
    """One sequence's drafts: its settled tokens, and the draft model's cache of them."""

    def __init__(self, forward: ReferenceForward, cache: KVCache, vocab: int) -> None:
        self.forward, self.cache, self.vocab = forward, cache, vocab
        self.tokens: list[int] = []

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def propose(self, k: int) -> list[int]:
        """Up to k greedy tokens of the draft model after the settled ones."""
        return DraftSequence.propose_many([(self, k)])[0]

    def _unsent(self, k: int) -> list[int] | None:
        """The settled tokens the draft's cache lacks (its drafts past what the target kept
        cut from it; at least the last token, for its logits), or None where k more tokens
        would not fit."""
        cache = self.cache
        if not self.tokens or k < 1:
            return None
        cache.truncate(min(cache.common_prefix(self.tokens), len(self.tokens) - 1))
        new = self.tokens[cache.length :]
        return None if cache.length + len(new) + k > cache.capacity else new

    @staticmethod
    def propose_many(asks: Sequence[tuple[DraftSequence, int]]) -> list[list[int]]:
        """Each (sequence, k)'s proposal: the sequences of one draft model go through it
        together, one batched pass per drafted position (the cpu engine's results per
        sequence are those of it alone, so the same tokens as one by one)."""
        out: list[list[int]] = [[] for _ in asks]
        feed: dict[int, list[int]] = {}
        for i, (d, k) in enumerate(asks):
            new = d._unsent(k)
            if new is not None:
                feed[i] = new
        while feed:
            by_model: dict[int, list[int]] = {}
            for i in feed:
                by_model.setdefault(id(asks[i][0].forward), []).append(i)
            nexts: dict[int, list[int]] = {}
            for at in by_model.values():
                forward = asks[at[0]][0].forward
                try:
                    rows = forward.step([Seq(asks[i][0].cache, feed[i]) for i in at])
                except KVPoolFull:
                    continue  # what was drafted stands; the next proposal starts over
                for i, logits in zip(at, rows, strict=True):
                    d, k = asks[i]
                    token = int(logits[-1].argmax())
                    if token >= d.vocab:
                        continue
                    out[i].append(token)
                    if len(out[i]) < k:
                        nexts[i] = [token]
            feed = nexts
        return out


def open_draft_model(
    path: str, target_vocab: Mapping[str, int], vocab_size: int, capacity: int,
    engine: EngineConfig,
) -> DraftModel:  # fmt: skip
    """The draft model at `path` on the cpu engine (its threads as the engine section sets
    them) for a target of vocabulary `target_vocab` (token -> id) and `vocab_size` logits;
    DraftModelError where the draft's vocabulary is not the target's."""
    model = load_model(Path(path))
    mismatch = vocabulary_mismatch(target_vocab, load_tokenizer(model).hf.get_vocab())
    if mismatch is not None:
        raise DraftModelError(f"model.draft {path}: not the model's vocabulary ({mismatch})")
    if model.spec.deltanet is not None:  # its cache is cut back to the accepted drafts
        raise DraftModelError(f"model.draft {path}: a recurrent model ({model.spec.arch})"
                              " cannot draft: its state is not cut back to the tokens that"
                              " stood")  # fmt: skip
    forward = ReferenceForward(model, weights=cpu_weights(engine))
    log.info("draft model %s: %s, %d layers, on the cpu engine", path, model.spec.arch,
             model.spec.n_layers)  # fmt: skip
    return DraftModel(forward, vocab_size, capacity)
