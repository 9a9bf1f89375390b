"""Packed documents inside a window, told apart by their boundary tokens: which document each token
is in, and its position inside that document.

    doc = documents(tokens, bos=128000, eos=-1)   # Llama 3: each document starts with its BOS
    doc.segments, doc.positions                    # int32 [B, T] each

Attention never crosses a document (attention.py), and rotary or learned positions restart at 0 in
each one, so a document packed after others is computed exactly as it would be alone (torchtune's
packed datasets and Hugging Face's padding-free packing restart positions the same way).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtrain.config import ModelConfig


class Documents(NamedTuple):
    segments: jax.Array  # int32 [B, T]: the document each token belongs to (rising along T)
    positions: jax.Array  # int32 [B, T]: the token's position inside its document


def packed(cfg: ModelConfig, tokens: jax.Array) -> Documents | None:
    """The documents packed in windows of `tokens` [B, T], where the model's config masks them
    (model.doc_bos or doc_eos; None where it does not): the one rule every forward takes."""
    return documents(tokens, cfg.doc_bos, cfg.doc_eos) if cfg.doc_bos >= 0 or cfg.doc_eos >= 0 else None


def documents(tokens: jax.Array, bos: int, eos: int) -> Documents:
    """A BOS starts a document, an EOS ends one (the next token starts the next); -1: not used."""
    zeros = jnp.zeros(tokens.shape, jnp.int32)
    starts = (tokens == bos).astype(jnp.int32) if bos >= 0 else zeros
    ends = (tokens == eos).astype(jnp.int32) if eos >= 0 else zeros
    segments = jnp.cumsum(starts, axis=1) + jnp.cumsum(ends, axis=1) - ends
    t = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    first = jnp.concatenate(
        [jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1
    )
    return Documents(segments, t - jax.lax.cummax(jnp.where(first, t, 0), axis=1))
