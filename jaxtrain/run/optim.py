"""Optimizers: AdamW, or nanochat's Muon for hidden matrices with AdamW for the rest.

Both follow one schedule shape (linear warmup, cosine decay); each param group scales it to its
own peak lr. Weight decay touches matrices only.

    optim.name: adamw   every param: AdamW at optim.lr
    optim.name: muon    attention and MLP matrices: Muon at optim.matrix_lr (momentum orthogonalised
                        by Newton-Schulz); embeddings (the tied output head) and norm scales: AdamW
                        at optim.lr
"""

from __future__ import annotations

import math
from typing import Any

import jax
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from jaxtrain.config import Config
from jaxtrain.model.params import path_names

# Leaves the model names `kernel` (matmuls) and `embedding` get weight decay; norm scales do not.
_DECAYED = ("kernel", "embedding")

# The hidden matrices Muon updates, by param path suffix, as (input axes, output axes) counted from
# the end. Every other axis is a batch of separate matrices: a scanned stack's layer axis, and
# qkv's q/k/v axis (nanochat keeps q, k and v as three matrices).
# Shapes: model/attention.py, model/transformer.py.
_MUON_DIMS = {
    ("attn", "qkv", "kernel"): MuonDimensionNumbers(-4, (-2, -1)),  # [d, 3, heads, head_dim]
    ("attn", "q", "kernel"): MuonDimensionNumbers(-3, (-2, -1)),  # [d, heads, head_dim]
    ("attn", "kv", "kernel"): MuonDimensionNumbers(-4, (-2, -1)),  # [d, 2, kv heads, head_dim]
    ("attn", "out", "kernel"): MuonDimensionNumbers((-3, -2), -1),  # [heads, head_dim, d]
    ("mlp", "fc", "kernel"): MuonDimensionNumbers(-2, -1),  # [d, ff]
    ("mlp", "gate_up", "kernel"): MuonDimensionNumbers(-3, -1),  # [d, 2, ff]: gate and up apart
    ("mlp", "out", "kernel"): MuonDimensionNumbers(-2, -1),  # [ff, d]
    # A mixture of experts (model/moe.py): each expert's matrix apart (the router stays AdamW's)
    ("moe", "gate_up", "kernel"): MuonDimensionNumbers(-3, -1),  # [experts, d, 2, ff]
    ("moe", "fc", "kernel"): MuonDimensionNumbers(-2, -1),  # [experts, d, ff]
    ("moe", "out", "kernel"): MuonDimensionNumbers(-2, -1),  # [experts, ff, d]
    ("moe", "shared_gate_up", "kernel"): MuonDimensionNumbers(-3, -1),
    ("moe", "shared_fc", "kernel"): MuonDimensionNumbers(-2, -1),
    ("moe", "shared_out", "kernel"): MuonDimensionNumbers(-2, -1),
    # Multi-head latent attention (model/mla.py)
    ("attn", "q_a", "kernel"): MuonDimensionNumbers(-2, -1),  # [d, q latent]
    ("attn", "q_b", "kernel"): MuonDimensionNumbers(-3, (-2, -1)),  # [q latent, heads, head_dim]
    ("attn", "kv_a", "kernel"): MuonDimensionNumbers(-2, -1),  # [d, kv latent + rope]
    ("attn", "kv_b", "kernel"): MuonDimensionNumbers(-3, (-2, -1)),  # [kv latent, heads, nope + v]
}


def lr_schedule(cfg: Config, peak: float | None = None) -> optax.Schedule:
    """Warmup from 0 to `peak` (default optim.lr), then cosine to peak * min_lr_ratio at total_steps."""
    o = cfg.optim
    peak = o.lr if peak is None else peak
    warmup = min(o.warmup_steps, max(cfg.total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=warmup,
        decay_steps=max(cfg.total_steps, warmup + 1),
        end_value=peak * o.min_lr_ratio,
    )


def decay_mask(params: Any) -> Any:
    """True for leaves that get weight decay."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path_names(path)[-1] in _DECAYED, params)


def _muon_dims(path: tuple) -> MuonDimensionNumbers | None:
    names = path_names(path)
    return next((dims for suffix, dims in _MUON_DIMS.items() if names[-len(suffix) :] == suffix), None)


def muon_labels(params: Any) -> Any:
    """'muon' for the hidden matrices, 'adamw' for embeddings and norm scales."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "adamw" if _muon_dims(path) is None else "muon", params
    )


def _muon_dims_tree(updates: Any) -> Any:
    # Called on the muon group's updates (other leaves already masked out by multi_transform).
    return jax.tree_util.tree_map_with_path(lambda path, _: _muon_dims(path), updates)


def _axes(axes: int | tuple[int, ...], ndim: int) -> tuple[int, ...]:
    return tuple(a % ndim for a in (axes if isinstance(axes, tuple) else (axes,)))


def _scale_by_width() -> optax.GradientTransformation:
    """Keller Jordan's (and nanochat's) Muon step size per matrix: sqrt(max(1, fan_out / fan_in))."""

    def scale(path: tuple, u: jax.Array) -> jax.Array:
        dims = _muon_dims(path)
        assert dims is not None  # only the muon group reaches here
        fan_in = math.prod(u.shape[a] for a in _axes(dims.reduction_axis, u.ndim))
        fan_out = math.prod(u.shape[a] for a in _axes(dims.output_axis, u.ndim))
        return u * max(1.0, fan_out / fan_in) ** 0.5

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return jax.tree_util.tree_map_with_path(scale, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """The configured optimizer. Global-norm clipping happens in the train step, which computes the norm."""
    o = cfg.optim
    adamw = optax.adamw(
        lr_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask
    )
    if o.name == "adamw":
        return adamw
    muon = optax.chain(
        scale_by_muon(beta=o.muon_momentum, weight_dimension_numbers=_muon_dims_tree),
        _scale_by_width(),
        optax.add_decayed_weights(o.weight_decay),
        optax.scale_by_learning_rate(lr_schedule(cfg, o.matrix_lr)),
    )
    # Each optimizer state holds its group's leaves under their param paths, so mesh.state_specs
    # shards Muon's momentum like its param, as it does Adam's moments.
    return optax.multi_transform({"adamw": adamw, "muon": muon}, muon_labels)
