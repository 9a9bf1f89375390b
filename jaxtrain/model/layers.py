"""The small parts every layer uses: dense, RMSNorm, rotary positions, layout constraints, and
the decode cache's index."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxtrain.config import ModelConfig


def constrain(x: jax.Array, *logical: str | None) -> jax.Array:
    """Pin an activation's layout by logical axes (a no-op unless the step sets axis rules)."""
    return nn.with_logical_constraint(x, logical)


def cache_index(module: nn.Module, length: int) -> jax.Array:
    """Decoding: the first position of this call's tokens; the cache index moves past them."""
    index = module.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
    start = index.value
    index.value = start + length
    return start


def dense(
    features: int | tuple[int, ...], std: float, dtype: Any, name: str, axis: Any = -1, bias: bool = False
) -> nn.DenseGeneral:
    return nn.DenseGeneral(
        features,
        axis=axis,
        use_bias=bias,
        dtype=dtype,
        param_dtype=jnp.float32,
        kernel_init=nn.initializers.normal(std),
        name=name,
    )


def residual_std(cfg: ModelConfig) -> float:
    # GPT-2: each block adds two residual branches, so scale their output init to keep the
    # residual stream's variance independent of depth.
    return cfg.init_std / math.sqrt(2 * cfg.n_layer)


def norm(x: jax.Array, eps: float, name: str) -> jax.Array:
    """RMSNorm in float32 (a low-precision mean of squares is noisy), output in x's dtype."""
    y = nn.RMSNorm(epsilon=eps, dtype=jnp.float32, param_dtype=jnp.float32, name=name)(x.astype(jnp.float32))
    return y.astype(x.dtype)


def rope_frequencies(cfg: ModelConfig, h: int) -> jax.Array:
    """Rotary frequencies of a head of size h; with rope_scaling_factor, Llama 3.1's: wavelengths
    past the original context divided by the factor, those under original / high_freq_factor
    kept, a smooth blend between (as transformers' rope_type llama3)."""
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    factor = cfg.rope_scaling_factor
    if not factor:
        return inv_freq
    low, high, context = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_context
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return jnp.where(medium, smoothed, scaled)


def rope(
    x: jax.Array,
    theta: float,
    positions: jax.Array | None = None,
    inv_freq: Any = None,
    interleaved: bool = False,
) -> jax.Array:
    """Rotate [B, T, N, H] by position ([T] or per row [B, T]; default 0..T-1; rotate-half layout),
    in float32; inv_freq: the frequencies (default theta's plain ones). interleaved: the pairs are
    (x0, x1), (x2, x3), ..., rotated and returned as [evens | odds] (DeepSeek's, model/mla.py)."""
    t, h = x.shape[1], x.shape[3]
    positions = jnp.arange(t) if positions is None else positions
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [(B,) T, H/2]
    cos = jnp.cos(angles)[..., None, :]  # [(B,) T, 1, H/2]: over heads
    sin = jnp.sin(angles)[..., None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleaved else (xf[..., : h // 2], xf[..., h // 2 :])
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
