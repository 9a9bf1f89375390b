"""The output head: logits, or each token's next-token cross-entropy over chunks of the sequence.

At a million tokens a window's float32 logits are [1M, 128K vocabulary]: 537 GB, 67 GB on each of
8 devices sharing the window. With `model.token_chunks` n > 1 the head and the loss run over each
device's tokens n pieces at a time in a scan (as each dense MLP does: model/mlp.py), each piece
recomputed in the backward (jax.checkpoint), so one piece's logits exist at a time and the whole
[tokens, vocab] never does. Each token's loss is the same computation as at once (the same matmul
of its own row, the same softmax), so the losses and gradients equal the unchunked ones up to
float32 summation order.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxtrain.model.fp8 import fp8_dot_general
from jaxtrain.model.layers import constrain, from_pieces, to_pieces
from jaxtrain.text.format import NO_LOSS


def mean_loss(losses: jax.Array, rows: jax.Array, share: jax.Array | None = None) -> jax.Array:
    """The loss of rows [b, T+1] from each token's cross-entropy `losses` [b, T]: their mean, or with a
    loss mask (`share`: parallel/data.py `target_share`) the sum over the targets that take loss (no
    NO_LOSS bit) over `share`. The one rule the plain step, accumulation and the pipeline take."""
    return losses.mean() if share is None else jnp.where(rows[:, 1:] & NO_LOSS, 0.0, losses).sum() / share


class Embedding(nn.Embed):
    """nn.Embed whose table can be read through the model's param gather (`table`), for the
    chunked head: a flax method cannot run inside jax.lax.scan, a plain array can."""

    # The rows first, then the cast (nn.Embed casts the whole table first): the same values, and
    # the gradient is a scatter of the rows straight into the float32 table's, which XLA adds in
    # place where a loop accumulates it (a pipeline's ticks, parallel/pipeline.py: its `embed` span)
    # instead of a table of zeros cast and added whole per tick.
    rows_first: bool = False
    matmul: str = "compute"  # the logits' matmul, model.head_matmul: compute | fp8

    def table(self) -> jax.Array:
        return self.embedding

    def attend(self, query: jax.Array) -> jax.Array:
        """Logits [..., vocab] of query [..., d] against the table, in the compute dtype or in FP8."""
        return logits_matmul(query, self.embedding, self.dtype, self.matmul)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        if not self.rows_first:
            return super().__call__(inputs)
        return jnp.take(self.embedding, inputs, axis=0).astype(self.dtype)


def logits_matmul(x: jax.Array, table: jax.Array, dtype: Any, matmul: str = "compute") -> jax.Array:
    """x [..., d] times the output embedding `table` [vocab, d] transposed, multiplied in `dtype`
    (nn.Embed.attend's product), or in FP8 (model/fp8.py) with matmul "fp8"."""
    x, table = x.astype(dtype), table.astype(dtype)
    if matmul == "fp8":
        return fp8_dot_general(x, table, (((x.ndim - 1,), (1,)), ((), ())))
    return jnp.dot(x, table.T)


def logits(x: jax.Array, table: jax.Array, dtype: Any, matmul: str = "compute") -> jax.Array:
    """float32 logits [B, T, vocab] of x [B, T, d] against the output embedding `table` [vocab, d]."""
    y = logits_matmul(x, table, dtype, matmul)
    return constrain(y, "batch", "length", "vocab").astype(jnp.float32)


def token_losses(
    x: jax.Array,
    table: jax.Array,
    targets: jax.Array,
    chunks: int,
    dtype: Any,
    parts: int = 1,
    matmul: str = "compute",
) -> jax.Array:
    """Next-token cross-entropy [B, T] (float32) of final-normed x [B, T, d] against `targets` [B, T],
    `chunks` (> 1) pieces of each device's tokens at a time (the module docstring).

    The sequence may be split over `parts` devices (the logical `length` axis): each piece takes the
    same slice of every device's part, so a piece is as split as the whole and no token moves.
    """

    def piece(xc: jax.Array, yc: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(logits(xc, table, dtype, matmul), yc)

    xs = constrain(to_pieces(x, chunks, parts), None, "batch", "length", "embed")
    ys = constrain(to_pieces(targets, chunks, parts), None, "batch", "length")

    def step(carry: None, xy: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        xc = constrain(xy[0], "batch", "length", "embed")
        return carry, constrain(jax.checkpoint(piece)(xc, xy[1]), "batch", "length")

    _, losses = jax.lax.scan(step, None, (xs, ys))  # [chunks, B, T / chunks]
    return constrain(from_pieces(losses, parts), "batch", "length")
