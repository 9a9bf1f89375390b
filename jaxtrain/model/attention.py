"""Causal self-attention: the layer, and the kernels it runs (cuDNN's fused kernel or XLA's; which one:
run/kernels.py, where on the devices: the placement, parallel/context.py)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn_layer

from jaxtrain.config import ModelConfig
from jaxtrain.model import documents
from jaxtrain.model.documents import Documents
from jaxtrain.model.layers import (
    cache_index,
    constrain,
    dense,
    norm,
    residual_std,
    rope,
    rope_frequencies,
    rope_scale,
)
from jaxtrain.model.mla import latent_qkv
from jaxtrain.model.placement import LOCAL, Placement


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    impl: str,
    segments: jax.Array | None = None,
    placement: Placement = LOCAL,
) -> jax.Array:
    """Causal attention, q [B, T, N, H], k [B, T, K, H], v [B, T, K, Hv] (K divides N) -> [B, T, N, Hv],
    softmax in float32. With K < N each key/value head serves N / K consecutive query heads.
    segments [B, T]: a query sees only keys of its own document (every query sees itself: no
    row is all masked).

    `impl` is settled where the job meets its devices (run/kernels.py); a model applied outside a
    job, as in tests, runs XLA's attention for auto. cudnn: cuDNN's fused kernel. xla: the same math
    as jax's XLA path in two einsums, without its grouped-query vmap, whose layout changes cost
    XLA:CPU transposes and copies: +3.5% tok/s on the issue shape (bench_torch.py, 2 cores). Inside
    a step the kernel runs where the placement puts it (parallel/context.py: per device, whole
    sequences of a share of the heads where context splits them).
    """
    kernel = cudnn_kernel if impl == "cudnn" else xla_kernel
    if placement.attend is None:
        return kernel(q, k, v, segments)
    return placement.attend(kernel, q, k, v, segments, impl)


def cudnn_kernel(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None) -> jax.Array:
    if v.shape[-1] != q.shape[-1]:  # value heads unlike the query's (MLA): `_pad_value`
        return cudnn_kernel(q, k, _pad_value(v, q.shape[-1]), segments)[..., : v.shape[-1]]
    attend = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
    if segments is None:
        return attend(q, k, v)
    if len(documents.block_sizes(q.shape[1])) > 1 and cudnn_layer.check_compute_capability("9.0"):
        return packed_attention(q, k, v, segments, _cudnn_packed)
    # Before Hopper (jax's gate for the packed layout, which the planner sets to its target), or a
    # window not a multiple of 256 tokens: documents as a [B, 1, T, S] mask, cuDNN's bias.
    return attend(q, k, v, mask=(segments[:, :, None] == segments[:, None, :])[:, None])


def packed_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, packed: Callable[..., jax.Array]
) -> jax.Array:
    """Causal attention inside each document, with no T x S array: each level of documents
    (model/documents.py `levels`) by `packed`(q, k, v, offsets, lengths) on the window seen as
    blocks, the documents inside a smallest block by XLA's kernel there, each token's output from
    its own level. A packed kernel leaves the rows outside its documents unwritten: those rows'
    outputs are not taken, and their gradients not let through (`_rows`)."""
    b, t, n, _ = q.shape
    found, _ = documents.levels(segments)
    if k.shape[2] != n:  # jax 0.10.2 steps through packed keys by the query's heads (_fix_seqlen_offsets)
        k, v = jnp.repeat(k, n // k.shape[2], axis=2), jnp.repeat(v, n // k.shape[2], axis=2)
    small = documents.block_sizes(t)[-1]
    blocks = [x.reshape(-1, small, *x.shape[2:]) for x in (q, k, v, segments)]
    y = xla_kernel(*blocks).reshape(b, t, n, v.shape[-1])
    for level in found:
        qkv = [_rows(x, level.owned).reshape(-1, level.block, *x.shape[2:]) for x in (q, k, v)]
        y_level = packed(*qkv, level.offsets, level.lengths).reshape(y.shape)
        y = jnp.where(level.owned[:, :, None, None], y_level, y)
    return y


@jax.custom_vjp
def _rows(x: jax.Array, rows: jax.Array) -> jax.Array:
    """x [B, T, ...] as it is; its gradient only at `rows` [B, T]: a packed kernel's gradient
    rows outside its documents are unwritten memory, NaN as likely as not."""
    return x


def _rows_fwd(x: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x, rows


def _rows_bwd(rows: jax.Array, g: jax.Array) -> tuple[jax.Array, None]:
    return jnp.where(rows.reshape(*rows.shape, *(1,) * (g.ndim - 2)), g, jnp.zeros_like(g)), None


_rows.defvjp(_rows_fwd, _rows_bwd)


def _cudnn_packed(
    q: jax.Array, k: jax.Array, v: jax.Array, offsets: jax.Array, lengths: jax.Array
) -> jax.Array:
    """cuDNN's fused causal attention over packed documents, each its own sequence: jax 0.10.2's
    public API takes no offsets, so its cuDNN layer is called (its signature as of 0.10.2; causal
    inside each document, as jax's packed-layout test runs it)."""
    return cudnn_layer.dot_product_attention(
        q, k, v, None, None, lengths, lengths, offsets, offsets,
        scale=1.0 / math.sqrt(q.shape[-1]), mask_type=cudnn_layer.MaskType.CAUSAL, qkv_layout="BTNH",
    )  # fmt: skip


def xla_kernel(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None) -> jax.Array:
    b, t, n, h = q.shape
    q = q * jnp.asarray(1.0 / math.sqrt(h), q.dtype)
    causal = jnp.tril(jnp.ones((t, t), bool))
    if segments is not None:
        causal = causal & (segments[:, :, None] == segments[:, None, :])[:, None]  # [B, 1, T, S]
    if k.shape[2] == n:
        logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
        logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1).astype(v.dtype), v)
    # Grouped: query heads as [kv head, group], so k and v are read once per group, not copied.
    q = q.reshape(b, t, k.shape[2], n // k.shape[2], h)
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(causal if segments is None else causal[:, None], logits, jnp.finfo(jnp.float32).min)
    y = jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(logits, axis=-1).astype(v.dtype), v)
    return y.reshape(b, t, n, v.shape[-1])


def _pad_value(v: jax.Array, size: int) -> jax.Array:
    """v [..., Hv] zero-padded to [..., size]: jax.nn.dot_product_attention (jax 0.10.2) takes only
    values of the query's head size, in every implementation, though cuDNN's fused kernel itself
    has a latent-attention mode (qH != vH, Hopper and cuDNN >= 9.10) its public API does not reach.
    The padded columns come out zero and are cut off: the AV product runs at the query's head size
    (DeepSeek-V3's 192 for 128: 1.5x its FLOPs and value bytes; QK^T, half the work, unchanged)."""
    return jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, size - v.shape[-1])])


def _masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """XLA's attention under a [1, 1, T, S] mask (the decode cache's), values of any head size."""
    y = jax.nn.dot_product_attention(q, k, _pad_value(v, q.shape[-1]), mask=mask, implementation="xla")
    return y[..., : v.shape[-1]]


class Attention(nn.Module):
    """Causal multi-head (or grouped-query, or DeepSeek's latent: model/mla.py) self-attention."""

    cfg: ModelConfig
    dtype: Any
    decode: bool = False
    placement: Placement = LOCAL

    @nn.compact
    def __call__(self, x: jax.Array, doc: Documents | None = None) -> jax.Array:
        cfg = self.cfg
        b, t, d = x.shape
        start = cache_index(self, t) if self.decode else 0
        positions = start + jnp.arange(t) if doc is None else doc.positions
        if cfg.mla:
            q, k, v = latent_qkv(cfg, self.dtype, x, positions)
        else:
            q, k, v = self._qkv(x, positions)
        if self.decode:
            cached_k = self.variable("cache", "k", jnp.zeros, (b, cfg.seq_len, *k.shape[2:]), k.dtype)
            cached_v = self.variable("cache", "v", jnp.zeros, (b, cfg.seq_len, *v.shape[2:]), v.dtype)
            cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k, (0, start, 0, 0))
            cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v, (0, start, 0, 0))
            # Query i sits at start + i and sees the cache up to there; later slots hold stale
            # entries or padding. Decoding is memory-bound: the plain XLA kernel is enough.
            mask = jnp.arange(cfg.seq_len)[None, :] <= (start + jnp.arange(t))[:, None]  # [T, S]
            y = _masked_attention(q, cached_k.value, cached_v.value, mask[None, None])
        else:
            segments = None if doc is None else doc.segments
            y = causal_attention(q, k, v, cfg.attention_impl, segments, self.placement)
        y = constrain(y, "batch", "length", "heads", None)
        out = dense(d, residual_std(cfg), self.dtype, "out", axis=(-2, -1), matmul=cfg.matmul)(y)
        return constrain(out, "batch", "length", "embed")

    def _qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Multi-head or grouped-query q [B, T, N, H], k and v [B, T, K, H], rotated at `positions`."""
        cfg = self.cfg
        n, kv_heads, head_dim, bias = cfg.n_head, cfg.kv_heads, cfg.head_size, cfg.qkv_bias
        if kv_heads == n:
            qkv = dense((3, n, head_dim), cfg.init_std, self.dtype, "qkv", bias=bias, matmul=cfg.matmul)(
                x
            )  # [B, T, 3, N, H]
            qkv = constrain(qkv, "batch", "length", None, "heads", None)
            # One split, not three index slices: its gradient is one concatenate, where the slices'
            # is three zero-padded copies added up (XLA:CPU keeps those pads: ~4% of a step).
            q, k, v = (x[:, :, 0] for x in jnp.split(qkv, 3, axis=2))  # [B, T, N, H]
        else:
            q = dense((n, head_dim), cfg.init_std, self.dtype, "q", bias=bias, matmul=cfg.matmul)(
                x
            )  # [B, T, N, H]
            q = constrain(q, "batch", "length", "heads", None)
            kv = dense((2, kv_heads, head_dim), cfg.init_std, self.dtype, "kv", bias=bias, matmul=cfg.matmul)(
                x
            )
            kv = constrain(kv, "batch", "length", None, "heads", None)
            k, v = (x[:, :, 0] for x in jnp.split(kv, 2, axis=2))  # [B, T, K, H]
        if cfg.qk_norm:
            q, k = norm(q, cfg.norm_eps, "q_norm"), norm(k, cfg.norm_eps, "k_norm")
        if cfg.pos_embedding == "rope":
            inv_freq, scale = rope_frequencies(cfg, head_dim), rope_scale(cfg)
            q = rope(q, cfg.rope_theta, positions, inv_freq, scale=scale)
            k = rope(k, cfg.rope_theta, positions, inv_freq, scale=scale)
        return q, k, v
