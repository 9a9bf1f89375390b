"""AdamW with linear warmup, cosine decay, and weight decay on matrices only."""

from __future__ import annotations

from typing import Any

import jax
import optax

from jaxtrain.config import Config

# Leaves the model names `kernel` (matmuls) and `embedding` get weight decay; norm scales do not.
_DECAYED = ("kernel", "embedding")


def lr_schedule(cfg: Config) -> optax.Schedule:
    """Warmup from 0 to lr, then cosine to lr * min_lr_ratio at total_steps."""
    o = cfg.optim
    warmup = min(o.warmup_steps, max(cfg.total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        warmup_steps=warmup,
        decay_steps=max(cfg.total_steps, warmup + 1),
        end_value=o.lr * o.min_lr_ratio,
    )


def decay_mask(params: Any) -> Any:
    """True for leaves that get weight decay."""

    def is_matrix(path: tuple, _leaf: Any) -> bool:
        last = path[-1]
        return getattr(last, "key", getattr(last, "name", None)) in _DECAYED

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """AdamW. Global-norm clipping happens in the train step, which computes the norm anyway."""
    o = cfg.optim
    return optax.adamw(
        lr_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask
    )
