"""The dense feed-forward: a block's MLP, and a mixture of experts' shared experts."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxtrain.config import ModelConfig
from jaxtrain.model.layers import constrain, dense, residual_std


def mlp(cfg: ModelConfig, dtype: Any, x: jax.Array, hidden: int, prefix: str = "") -> jax.Array:
    """Two-layer GELU feed-forward, or SwiGLU (gate and up as one [d, 2, ff] matmul, then down), of
    `hidden` units, its params named prefix + gate_up/fc/out in the calling module (inside its
    compact method): a block's `mlp`, or a mixture of experts' `shared_` ones beside its experts."""
    if cfg.mlp == "swiglu":
        gate_up = dense((2, hidden), cfg.init_std, dtype, f"{prefix}gate_up")(x)  # [B, T, 2, ff]
        gate_up = constrain(gate_up, "batch", "length", None, "mlp")
        gate, up = (x[:, :, 0] for x in jnp.split(gate_up, 2, axis=2))
        h = nn.silu(gate) * up
    else:
        h = nn.gelu(dense(hidden, cfg.init_std, dtype, f"{prefix}fc")(x))
    h = constrain(h, "batch", "length", "mlp")
    out = dense(x.shape[-1], residual_std(cfg), dtype, f"{prefix}out")(h)
    return constrain(out, "batch", "length", "embed")


class Mlp(nn.Module):
    """A block's dense MLP (`mlp`) of cfg.ff_dim."""

    cfg: ModelConfig
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return mlp(self.cfg, self.dtype, x, self.cfg.ff_dim)
