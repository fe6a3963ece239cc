"""How a MoE layer chooses its experts: each routing kind is an object the spec holds.

`Softmax`: softmax over every expert's logit, the top k of the probabilities (Qwen2/3-MoE,
Mixtral, OLMoE), optionally renormalised over the chosen. `TopKSoftmax`: the top k logits,
then a softmax over those (gpt-oss). `GroupedSoftmax`: the softmax's top k within the best
expert groups (DeepSeek-V2). `Sigmoid`: each expert's sigmoid
score; the choice ranks score plus a per-expert correction bias (a weight of the file,
`e_score_correction_bias`, llama.cpp's `exp_probs_b`) within the best `groups_used` of
`groups` expert groups (a group ranked by the sum of its two best), and the weights are the
chosen scores, without the bias (GLM-4.5, DeepSeek-V3). Each is a tagged struct, so a pack's
manifest (which records the spec) names the kind. Either may renormalise the chosen
weights to sum to one (`ModelSpec.norm_topk_prob`) and scale them (`ModelSpec.expert_scale`).
"""

from __future__ import annotations

import msgspec
import torch


class Softmax(msgspec.Struct, frozen=True, tag="softmax"):
    """Softmax over all experts, then the top k."""

    def choose(
        self, logits: torch.Tensor, bias: torch.Tensor | None, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, ids [T, k]) before renormalising and scaling."""
        return logits.float().softmax(-1).topk(top_k, dim=-1)

    def as_softmax(self, normalize: bool) -> bool | None:
        """Whether a softmax-then-top-k kernel computes this routing over the logits (plus the
        router's bias, where the file has one), renormalising the chosen (None: it cannot)."""
        return normalize

    def describe(self) -> str:
        return "softmax"


class Sigmoid(msgspec.Struct, frozen=True, tag="sigmoid"):
    """Sigmoid scores, chosen by score plus correction bias within the best groups."""

    groups: int = 1
    groups_used: int = 1

    def choose(
        self, logits: torch.Tensor, bias: torch.Tensor | None, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.float().sigmoid()  # [T, E]
        ranked = scores if bias is None else scores + bias.float()
        if self.groups_used < self.groups:
            t, e = ranked.shape
            grouped = ranked.view(t, self.groups, e // self.groups)
            best = grouped.topk(2, dim=-1).values.sum(-1)  # [T, groups]
            kept = torch.zeros_like(best, dtype=torch.bool)
            kept.scatter_(1, best.topk(self.groups_used, dim=-1).indices, True)
            ranked = grouped.masked_fill(~kept[..., None], float("-inf")).view(t, e)
        ids = ranked.topk(top_k, dim=-1).indices
        return scores.gather(1, ids), ids

    def as_softmax(self, normalize: bool) -> bool | None:
        return None  # sigmoid scores: no softmax computes them

    def describe(self) -> str:
        if self.groups == 1:
            return "sigmoid with correction bias"
        return f"sigmoid with correction bias, best {self.groups_used} of {self.groups} groups"


class TopKSoftmax(msgspec.Struct, frozen=True, tag="topk_softmax"):
    """The top k of the logits (plus the router's bias), weighted by a softmax over those k
    alone (gpt-oss; llama.cpp's SOFTMAX_WEIGHT gating)."""

    def choose(
        self, logits: torch.Tensor, bias: torch.Tensor | None, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.float() if bias is None else logits.float() + bias.float()
        top, ids = scores.topk(top_k, dim=-1)
        return top.softmax(-1), ids

    def as_softmax(self, normalize: bool) -> bool | None:
        return True  # a softmax over the top k logits is every logit's, renormalised

    def describe(self) -> str:
        return "softmax over the top k"


class GroupedSoftmax(msgspec.Struct, frozen=True, tag="grouped_softmax"):
    """Softmax over all experts, the top k within the best `groups_used` of `groups` expert
    groups, a group ranked by its best probability (DeepSeek-V2's group_limited_greedy, as
    DeepSeek's and transformers' code rank them; llama.cpp ranks any kind's groups by the sum
    of their best two)."""

    groups: int
    groups_used: int

    def choose(
        self, logits: torch.Tensor, bias: torch.Tensor | None, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        probs = logits.float().softmax(-1)  # [T, E]
        t, e = probs.shape
        grouped = probs.view(t, self.groups, e // self.groups)
        kept = torch.zeros((t, self.groups), dtype=torch.bool, device=probs.device)
        kept.scatter_(1, grouped.max(-1).values.topk(self.groups_used, dim=-1).indices, True)
        return grouped.masked_fill(~kept[..., None], 0.0).view(t, e).topk(top_k, dim=-1)

    def as_softmax(self, normalize: bool) -> bool | None:
        return None  # the groups' mask comes between the softmax and the top k

    def describe(self) -> str:
        return f"softmax within the best {self.groups_used} of {self.groups} expert groups"


Routing = Softmax | Sigmoid | TopKSoftmax | GroupedSoftmax
SOFTMAX = Softmax()
