"""The small parts every layer uses: dense, RMSNorm, rotary positions, layout constraints, and
the decode cache's index."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxtrain.config import ModelConfig
from jaxtrain.model import fp8
from jaxtrain.model.params import logical_axes
from jaxtrain.model.placement import LOCAL


def constrain(x: jax.Array, *logical: str | None) -> jax.Array:
    """Pin an activation's layout by logical axes (a no-op unless the step sets axis rules)."""
    return nn.with_logical_constraint(x, logical)


def to_pieces(a: jax.Array, chunks: int, parts: int = 1) -> jax.Array:
    """[B, T, ...] -> [chunks, B, T / chunks, ...]: piece i holds the i-th of `chunks` equal slices of
    each device's part of the sequence (`length` split over `parts` devices: Placement.length_split),
    so a piece is split as the whole is and no token moves; `from_pieces` undoes it."""
    b, t = a.shape[:2]
    a = a.reshape(b, parts, chunks, t // (parts * chunks), *a.shape[2:])
    return jnp.moveaxis(a, 2, 0).reshape(chunks, b, t // chunks, *a.shape[4:])


def from_pieces(a: jax.Array, parts: int = 1) -> jax.Array:
    """[chunks, B, T / chunks, ...] from `to_pieces` -> [B, T, ...]."""
    chunks, b, size = a.shape[:3]
    a = a.reshape(chunks, b, parts, size // parts, *a.shape[3:])
    return jnp.moveaxis(a, 0, 2).reshape(b, chunks * size, *a.shape[4:])


def cache_index(module: nn.Module, length: int) -> jax.Array:
    """Decoding: the first position of this call's tokens; the cache index moves past them."""
    index = module.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
    start = index.value
    index.value = start + length
    return start


class Fp8Dot(nn.Module):
    """model.matmul fp8's dot_general, made by its dense (flax's `dot_general_cls`, a child with no
    params) so that it reads what the dense's variables carry: the weight already rounded to e4m3
    with its scale (`fp8.QUANTIZED`, `fp8.SCALE`: fsdp's gather and the pipeline's once-a-step cast
    put them there; the pipeline's also laid out for the forward GEMM, `fp8.TRANSPOSED`), multiplied
    as they are; else the dot rounds the weight itself. The same values
    either way (model/fp8.py). Where tensor parallelism cuts the activation or the output's gradient
    (the placement of the module the dense belongs to), each is scaled one block a tensor shard
    (`fp8.tensor_blocks`)."""

    def __call__(
        self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any = None
    ) -> jax.Array:
        layer = self.parent
        assert isinstance(layer, nn.Module)
        owner: Any = layer.parent  # the attention, MLP or mixture whose projection this is
        while isinstance(owner, nn.Module) and not hasattr(owner, "placement"):
            owner = owner.parent
        placement = getattr(owner, "placement", LOCAL)
        blocks = (fp8.WHOLE, fp8.WHOLE)
        if placement.tensor_split > 1:
            kernel_axes = logical_axes((*layer.path, "kernel"), rhs.ndim)
            blocks = fp8.tensor_blocks(
                kernel_axes,
                dimension_numbers,
                lhs.shape,
                rhs.shape,
                placement.tensor_axes,
                placement.tensor_split,
            )
        if layer.has_variable("params", fp8.QUANTIZED):
            quantized: jax.Array = layer.get_variable("params", fp8.QUANTIZED)
            scale: jax.Array = layer.get_variable("params", fp8.SCALE)
            transposed: jax.Array | None = layer.get_variable("params", fp8.TRANSPOSED)  # None unless given
            return fp8.fp8_dot_quantized(lhs, rhs, dimension_numbers, quantized, scale, transposed, blocks)
        return fp8.fp8_dot_general(lhs, rhs, dimension_numbers, precision, blocks=blocks)


def dense(
    features: int | tuple[int, ...],
    std: float,
    dtype: Any,
    name: str,
    axis: Any = -1,
    bias: bool = False,
    matmul: str = "compute",
) -> nn.DenseGeneral:
    """A projection: float32 params, computed in `dtype`; matmul "fp8" (model.matmul) multiplies in
    FP8 (model/fp8.py). The params are the same either way, so checkpoints do not depend on it."""
    return nn.DenseGeneral(
        features,
        axis=axis,
        use_bias=bias,
        dtype=dtype,
        param_dtype=jnp.float32,
        kernel_init=nn.initializers.normal(std),
        dot_general_cls=Fp8Dot if matmul == "fp8" else None,
        name=name,
    )


def residual_std(cfg: ModelConfig) -> float:
    # GPT-2: each block adds two residual branches, so scale their output init to keep the
    # residual stream's variance independent of depth.
    return cfg.init_std / math.sqrt(2 * cfg.n_layer)


def norm(x: jax.Array, eps: float, name: str) -> jax.Array:
    """RMSNorm in float32 (a low-precision mean of squares is noisy), output in x's dtype."""
    return norm_layer(eps, name)(x)


def norm_layer(eps: float, name: str) -> Callable[[jax.Array], jax.Array]:
    """`norm` as one module that may run on several inputs (its params made once)."""
    layer = nn.RMSNorm(epsilon=eps, dtype=jnp.float32, param_dtype=jnp.float32, name=name)
    return lambda x: layer(x.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig, h: int) -> jax.Array:
    """Rotary frequencies of a head of size h; with rope_scaling_factor, Llama 3.1's: wavelengths
    past the original context divided by the factor, those under original / high_freq_factor
    kept, a smooth blend between (as transformers' rope_type llama3); or YaRN's (`_yarn`)."""
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    factor = cfg.rope_scaling_factor
    if not factor:
        return inv_freq
    if cfg.rope_type == "yarn":
        return _yarn(cfg, h, inv_freq)
    low, high, context = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_context
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return jnp.where(medium, smoothed, scaled)


def _yarn(cfg: ModelConfig, h: int, inv_freq: jax.Array) -> jax.Array:
    """YaRN (Peng et al. 2023), as transformers' rope_type yarn with truncate: frequencies turning
    fewer than beta_slow times over the original context divided by the factor, more than beta_fast
    kept, a linear ramp over the dims between."""

    def dim(rotations: float) -> float:  # the dim whose frequency turns `rotations` times
        context = cfg.rope_original_context
        return h * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low = max(math.floor(dim(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(dim(cfg.rope_beta_slow)), h - 1)
    ramp = jnp.clip((jnp.arange(h // 2, dtype=jnp.float32) - low) / max(high - low, 0.001), 0, 1)
    return inv_freq / cfg.rope_scaling_factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_scale(cfg: ModelConfig) -> float:
    """What YaRN multiplies the rotated parts by (transformers' attention_factor); 1 otherwise."""
    if not cfg.rope_scaling_factor or cfg.rope_type != "yarn":
        return 1.0
    factor, mscale, all_dim = cfg.rope_scaling_factor, cfg.rope_mscale, cfg.rope_mscale_all_dim
    if mscale and all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor)


def rope(
    x: jax.Array,
    theta: float,
    positions: jax.Array | None = None,
    inv_freq: Any = None,
    interleaved: bool = False,
    scale: float = 1.0,
) -> jax.Array:
    """Rotate [B, T, N, H] by position ([T] or per row [B, T]; default 0..T-1; rotate-half layout),
    in float32; inv_freq: the frequencies (default theta's plain ones). interleaved: the pairs are
    (x0, x1), (x2, x3), ..., rotated and returned as [evens | odds] (DeepSeek's, model/mla.py);
    scale: what cos and sin are multiplied by (YaRN's, `rope_scale`)."""
    t, h = x.shape[1], x.shape[3]
    positions = jnp.arange(t) if positions is None else positions
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [(B,) T, H/2]
    cos = scale * jnp.cos(angles)[..., None, :]  # [(B,) T, 1, H/2]: over heads
    sin = scale * jnp.sin(angles)[..., None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleaved else (xf[..., : h // 2], xf[..., h // 2 :])
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
