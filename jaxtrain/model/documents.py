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


# cuDNN's packed form takes a fixed number of documents per sequence, and a window's count is the
# data's. So the window is cut into levels of blocks, each block split in SPLIT at the next level
# (131,072 tokens: blocks of 131,072, 8,192, 512, then 32). A document belongs to the coarsest
# level whose sub-block boundaries it crosses; a block's own documents each cross a different one
# of its SPLIT - 1 inner boundaries, so at most SPLIT - 1 of them: the bound holds for any data,
# and no document is merged or cut. Documents inside one smallest block (of at most
# SPLIT x SMALLEST tokens) are masked densely there: T x that many scores, not T x T.
SPLIT = 16
SMALLEST = 16


class Level(NamedTuple):
    """The documents of one level, in cuDNN's packed form (jax's `q_offsets`/`q_seqlen` layout)."""

    block: int  # tokens a block: the window seen as [B * T / block, block]
    offsets: jax.Array  # int32 [B * T / block, SPLIT]: each document's first token in its block; -1 after
    lengths: jax.Array  # int32 [B * T / block, SPLIT - 1]: its length; -1 after the block's last
    owned: jax.Array  # bool [B, T]: the tokens of this level's documents


def block_sizes(t: int) -> list[int]:
    """The block of each level of a window of `t` tokens, largest first; the last is masked densely."""
    sizes = [t]
    while sizes[-1] % SPLIT == 0 and sizes[-1] // SPLIT >= SMALLEST:
        sizes.append(sizes[-1] // SPLIT)
    return sizes


def levels(segments: jax.Array) -> tuple[list[Level], jax.Array]:
    """The packed levels of `segments` [B, T] (block_sizes(T) but the last), and the tokens
    [B, T] left to the smallest blocks: every token in exactly one."""
    b, t = segments.shape
    sizes = block_sizes(t)
    start, end = _spans(segments)
    inside = [start // size == (end - 1) // size for size in sizes]  # the document in one block
    out = []
    for size, within, split in zip(sizes, inside, inside[1:], strict=False):
        owned = within & ~split
        out.append(Level(size, *_packed(start, end, owned & (start == _arange(t)), size), owned))
    return out, inside[-1]


def _arange(t: int) -> jax.Array:
    return jnp.arange(t, dtype=jnp.int32)


def _spans(segments: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each token's document as [start, end) in the window, int32 [B, T] each."""
    t = _arange(segments.shape[1])
    change = segments[:, 1:] != segments[:, :-1]
    edge = jnp.ones_like(segments[:, :1], bool)
    first, last = jnp.concatenate([edge, change], axis=1), jnp.concatenate([change, edge], axis=1)
    start = jax.lax.cummax(jnp.where(first, t, 0), axis=1)
    end = jax.lax.cummin(jnp.where(last, t + 1, segments.shape[1]), axis=1, reverse=True)
    return start, end


def _packed(start: jax.Array, end: jax.Array, firsts: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """Offsets [B', SPLIT] and lengths [B', SPLIT - 1] of the documents whose first tokens are
    `firsts` [B, T], each block of `size` tokens a row B' (-1 where a block has fewer)."""
    rows = firsts.size // size
    firsts, start, end = (x.reshape(rows, size) for x in (firsts, start, end))
    slot = jnp.where(firsts, jnp.cumsum(firsts, axis=1) - 1, SPLIT)  # SPLIT: dropped below
    row = jnp.arange(rows)[:, None]
    fill = jnp.full((rows, SPLIT), -1, jnp.int32)
    offsets = fill.at[row, slot].set(start % size, mode="drop")
    lengths = fill[:, 1:].at[row, slot].set(end - start, mode="drop")
    return offsets, lengths
