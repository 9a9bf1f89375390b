"""The dense feed-forward: a block's MLP, and a mixture of experts' shared experts."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxtrain.config import ModelConfig
from jaxtrain.model import fp8
from jaxtrain.model.layers import constrain, dense, from_pieces, residual_std, to_pieces
from jaxtrain.model.placement import LOCAL, Placement


def mlp(cfg: ModelConfig, dtype: Any, x: jax.Array, hidden: int, prefix: str = "") -> jax.Array:
    """Two-layer GELU feed-forward, or SwiGLU (gate and up as one [d, 2, ff] matmul, then down), of
    `hidden` units, its params named prefix + gate_up/fc/out in the calling module (inside its
    compact method): a block's `mlp`, or a mixture of experts' `shared_` ones beside its experts."""
    if cfg.mlp == "swiglu":
        gate_up = dense((2, hidden), cfg.init_std, dtype, f"{prefix}gate_up", matmul=cfg.matmul)(
            x
        )  # [B, T, 2, ff]
        gate_up = constrain(gate_up, "batch", "length", None, "mlp")
        gate, up = (x[:, :, 0] for x in jnp.split(gate_up, 2, axis=2))
        h = nn.silu(gate) * up
    else:
        h = nn.gelu(dense(hidden, cfg.init_std, dtype, f"{prefix}fc", matmul=cfg.matmul)(x))
    h = constrain(h, "batch", "length", "mlp")
    out = dense(x.shape[-1], residual_std(cfg), dtype, f"{prefix}out", matmul=cfg.matmul)(h)
    return constrain(out, "batch", "length", "embed")


class Mlp(nn.Module):
    """A block's dense MLP (`mlp`) of cfg.ff_dim; over model.token_chunks pieces of each device's
    tokens in a scan, each piece recomputed in the backward, so one piece's hidden activations
    (Llama-3-8B's [tokens, 2, 14336] gate and up: 7.5 GB at 131,072 tokens a device) exist at a time.
    The price: the MLP's forward once more in the backward (about 1% of a step's FLOPs at a million
    tokens, where attention's work dominates). Windows the pieces do not divide (generation's) run whole."""

    cfg: ModelConfig
    dtype: Any
    placement: Placement = LOCAL

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        chunks, hidden, parts = self.cfg.token_chunks, self.cfg.ff_dim, self.placement.length_split
        if chunks == 1 or x.shape[1] % (parts * chunks):
            return mlp(self.cfg, self.dtype, x, hidden)

        def piece(module: nn.Module, carry: None, xc: jax.Array) -> tuple[None, jax.Array]:
            xc = constrain(xc, "batch", "length", "embed")
            return carry, mlp(module.cfg, module.dtype, xc, hidden)

        # Lifted (flax) scan and remat: the params stay this module's, shared by every piece.
        scan = nn.scan(
            nn.remat(piece, policy=fp8.saving_scales(self.cfg.matmul), prevent_cse=False),
            variable_broadcast="params",
            split_rngs={"params": False},
            length=chunks,
        )
        _, ys = scan(self, None, constrain(to_pieces(x, chunks, parts), None, "batch", "length", "embed"))
        return constrain(from_pieces(ys, parts), "batch", "length", "embed")
