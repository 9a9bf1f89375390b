"""Causal self-attention: the layer, and the kernels it runs (cuDNN's fused kernel or XLA's; which one:
run/kernels.py, where on the devices: the placement, parallel/context.py)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn_layer

from jaxtrain.config import ModelConfig
from jaxtrain.model import auto, documents
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
    job, as in tests, runs auto by model/auto.py (XLA's). cudnn: cuDNN's fused kernel. xla: the same math
    as jax's XLA path in two einsums, without its grouped-query vmap, whose layout changes cost
    XLA:CPU transposes and copies: +3.5% tok/s on the issue shape (bench_torch.py, 2 cores). Inside
    a step the kernel runs where the placement puts it (parallel/context.py: per device, whole
    sequences of a share of the heads where context splits them).
    """
    impl = auto.outside_a_job("attention", impl)
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
        return packed_attention(q, k, v, segments, CUDNN_PACKED)
    # Before Hopper (jax's gate for the packed layout, which the planner sets to its target), or a
    # window not a multiple of 256 tokens: documents as a [B, 1, T, S] mask, cuDNN's bias.
    return attend(q, k, v, mask=(segments[:, :, None] == segments[:, None, :])[:, None])


class PackedKernel(NamedTuple):
    """A kernel over packed documents (cuDNN's form: jax's `q_offsets`/`q_seqlen` per block row):
    forward(q, k, v, offsets, lengths) -> (out, stats); backward(q, k, v, offsets, lengths, stats,
    out, dout) -> (dq, dk, dv), q with as many heads as k. It reads only the rows inside its
    documents and leaves the others unwritten."""

    forward: Callable[..., tuple[jax.Array, jax.Array]]
    backward: Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def packed_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, kernel: PackedKernel
) -> jax.Array:
    """Causal attention inside each document, with no T x S array: each level of documents
    (model/documents.py `levels`) by `kernel` on the window seen as blocks, the documents inside a
    smallest block by XLA's kernel there, each token's output from its own level."""
    return _packed(kernel, q, k, v, segments)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _packed(kernel: PackedKernel, q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array) -> jax.Array:
    return _packed_fwd(kernel, q, k, v, segments)[0]


def _packed_fwd(kernel: PackedKernel, q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array) -> Any:
    """The output, and what the backward keeps: one output for every level (each level's rows
    hold that level's own output, all its backward reads), each level's softmax stats. A level's
    query heads go through the kernel one of each key/value head's group at a time: it takes as
    many query heads as key heads (jax 0.10.2 steps through packed keys by the query's heads,
    `_fix_seqlen_offsets`)."""
    b, t, n, _ = q.shape
    found, _ = documents.levels(segments)
    small = documents.block_sizes(t)[-1]

    def dense(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return xla_kernel(*_blocks((q, k, v, segments), small)).reshape(b, t, n, v.shape[-1])

    y, dense_vjp = jax.vjp(dense, q, k, v)
    q5, y5, stats = _grouped(q, k.shape[2]), _grouped(y, k.shape[2]), []
    for level in found:
        inside = level.owned[:, :, None, None]
        for i in range(q5.shape[3]):
            q_i, y5 = jax.lax.optimization_barrier((q5[:, :, :, i], y5))  # one call at a time
            out, s = kernel.forward(*_blocks((q_i, k, v), level.block), level.offsets, level.lengths)
            y5 = y5.at[:, :, :, i].set(jnp.where(inside, out.reshape(b, t, *out.shape[2:]), y5[:, :, :, i]))
            stats.append(s)
    y = y5.reshape(y.shape)
    return y, (q, k, v, segments, y, stats, dense_vjp)


def _packed_bwd(kernel: PackedKernel, res: Any, g: jax.Array) -> tuple[jax.Array | None, ...]:
    """Each level's gradient, taken at its own rows only (a packed kernel's other rows are
    unwritten memory), summed with the smallest blocks' (XLA's, at theirs). One call at a time,
    each after the sums before it (an optimization barrier): left to XLA, every call's gradients
    were live at once (7 GB a GPU at 1M tokens)."""
    q, k, v, segments, y, stats, dense_vjp = res
    found, rest = documents.levels(segments)
    dq, dk, dv = dense_vjp(jnp.where(rest[:, :, None, None], g, jnp.zeros_like(g)))
    q5, y5, g5, dq5 = (_grouped(x, k.shape[2]) for x in (q, y, g, dq))
    calls = iter(stats)
    for level in found:
        inside = level.owned[:, :, None, None]
        for i in range(q5.shape[3]):
            ins, (dq5, dk, dv) = jax.lax.optimization_barrier(
                ((q5[:, :, :, i], y5[:, :, :, i], g5[:, :, :, i]), (dq5, dk, dv))
            )
            views = _blocks((ins[0], k, v, *ins[1:]), level.block)
            grads = kernel.backward(*views[:3], level.offsets, level.lengths, next(calls), *views[3:])
            dq_i, dk_i, dv_i = (
                jnp.where(inside, e.reshape(d.shape), 0) for d, e in zip((dk, dk, dv), grads, strict=True)
            )
            dq5, dk, dv = dq5.at[:, :, :, i].add(dq_i), dk + dk_i, dv + dv_i
    return dq5.reshape(q.shape), dk, dv, None


_packed.defvjp(_packed_fwd, _packed_bwd)


def _blocks(arrays: tuple[jax.Array, ...], size: int) -> list[jax.Array]:
    """[B, T, ...] arrays seen as [B * T / size, size, ...]: the window's blocks as rows."""
    return [x.reshape(-1, size, *x.shape[2:]) for x in arrays]


def _grouped(x: jax.Array, kv_heads: int) -> jax.Array:
    """x [B, T, N, H] as [B, T, K, N / K, H]: query head k * G + g serves key/value head k, as in
    `causal_attention`."""
    return x.reshape(*x.shape[:2], kv_heads, x.shape[2] // kv_heads, x.shape[3])


def _cudnn_params(q: jax.Array) -> dict[str, Any]:
    """jax 0.10.2's cuDNN layer's parameters (fused_attention_stablehlo, whose primitives are
    bound directly: its public API takes no offsets), causal inside each document."""
    return dict(
        scale=1.0 / math.sqrt(q.shape[-1]), seed=42, dropout_rate=0.0, variadic_args=(False, False),
        mask_type=cudnn_layer.MaskType.CAUSAL, layout=cudnn_layer.AttentionLayout.BTNH.value,
        sliding_window_length=None,
    )  # fmt: skip


def _cudnn_forward(q: jax.Array, k: jax.Array, v: jax.Array, offsets: jax.Array, lengths: jax.Array) -> Any:
    none = jnp.zeros(0, q.dtype)  # no bias, no page tables
    bind = cudnn_layer._dot_product_attention_fwd_p_wrapper.bind
    y, stats = bind(
        q, k, v, none, lengths, lengths, offsets, offsets, none, none, **_cudnn_params(q), is_training=True
    )
    return y, stats


def _cudnn_backward(
    q: jax.Array, k: jax.Array, v: jax.Array, offsets: jax.Array, lengths: jax.Array, stats: jax.Array,
    y: jax.Array, g: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    none = jnp.zeros(0, q.dtype)
    bind = cudnn_layer._dot_product_attention_bwd_p_wrapper.bind
    dq, dk, dv = bind(
        q, k, v, none, lengths, lengths, offsets, offsets, none, none, stats, y, g, **_cudnn_params(q)
    )
    return dq, dk, dv


CUDNN_PACKED = PackedKernel(_cudnn_forward, _cudnn_backward)


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
