"""Multi-head latent attention (DeepSeek-V2/V3, Kimi): the geometry a spec holds.

Each token's keys and values come from one low-rank latent: `kv_a` projects the hidden state
to a latent of `kv_lora_rank` values plus one rotated key part of `rope_dim` shared by every
head; the latent, normed, is expanded by `kv_b` into each head's key part that RoPE leaves
alone (head_dim - rope_dim) and its value (the spec's value_dim). Queries come from `q`
directly, or through a latent of `q_lora_rank` (`q_a`, a norm, `q_b`). A head's key is its
unrotated part then the shared rotated part, as its query is. The reference and cpu engines
hold the expanded keys and values (every head's, as multi-head attention caches them); the
offload engine caches the latent and the rotated key, as llama.cpp does, and takes each
head's query into the latent through its key expansion (the same arithmetic).
"""

from __future__ import annotations

import msgspec


class Mla(msgspec.Struct, frozen=True):
    q_lora_rank: int  # 0: queries projected directly
    kv_lora_rank: int
    rope_dim: int  # the rotated part of each query and key (the key's shared by every head)

    def describe(self) -> str:
        q = f"queries through a rank-{self.q_lora_rank} latent" if self.q_lora_rank else ""
        return ", ".join(filter(None, (f"multi-head latent attention (rank {self.kv_lora_rank}"
                                       f", {self.rope_dim} rotated dims)", q)))  # fmt: skip
