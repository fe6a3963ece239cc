"""Gated DeltaNet linear attention (Qwen3-Next): the geometry a spec holds.

Most layers of a Qwen3-Next model mix tokens without a KV cache: each keeps, per sequence,
a short causal convolution's last inputs and a recurrent state per value head, S [k_dim,
v_dim], updated by the gated delta rule for every token t:

    S = S * exp(g_t);   S = S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

with q and k L2-normed (q also scaled by 1 / sqrt(k_dim)), beta = sigmoid(b) and the decay
g = a * softplus(alpha + dt_bias), a < 0 per value head. Key heads serve r = v_heads /
k_heads value heads each. The output is RMS-normed per head, times silu of its gate z, and
projected back. Every `interval`-th layer (the last of each run) is full attention instead.
"""

from __future__ import annotations

import msgspec


class GatedDeltaNet(msgspec.Struct, frozen=True):
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    interval: int  # layer i attends fully where i % interval == interval - 1

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.k_dim

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: q, k and v of every head."""
        return 2 * self.key_dim + self.value_dim

    def linear(self, i: int) -> bool:
        """Whether layer i is a linear-attention (DeltaNet) layer."""
        return i % self.interval != self.interval - 1

    def describe(self) -> str:
        return (f"Gated DeltaNet linear attention ({self.k_heads} key and {self.v_heads} value"
                f" heads), full attention every {self.interval} layers")  # fmt: skip
