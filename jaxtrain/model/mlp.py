"""The dense feed-forward: a block's MLP, and a mixture of experts' shared experts."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxtrain.config import ModelConfig
from jaxtrain.model.layers import constrain, dense, residual_std


class Mlp(nn.Module):
    """Two-layer GELU feed-forward, or SwiGLU (gate and up as one [d, 2, ff] matmul, then down)."""

    cfg: ModelConfig
    dtype: Any
    hidden: int = 0  # 0: cfg.ff_dim

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        hidden = self.hidden or cfg.ff_dim
        if cfg.mlp == "swiglu":
            gate_up = dense((2, hidden), cfg.init_std, self.dtype, "gate_up")(x)  # [B, T, 2, ff]
            gate_up = constrain(gate_up, "batch", "length", None, "mlp")
            gate, up = (x[:, :, 0] for x in jnp.split(gate_up, 2, axis=2))
            h = nn.silu(gate) * up
        else:
            h = nn.gelu(dense(hidden, cfg.init_std, self.dtype, "fc")(x))
        h = constrain(h, "batch", "length", "mlp")
        out = dense(x.shape[-1], residual_std(self.cfg), self.dtype, "out")(h)
        return constrain(out, "batch", "length", "embed")
