"""Multi-head latent attention (DeepSeek-V2/V3): queries, keys and values from low-rank latents.

Keys and values of every head come from one latent of kv_lora_rank per token (RMSNorm'd), and
each key's rotary part (rope_head_dim) from one more projection shared by all heads: a decoder
could cache only those. Queries come from x directly, or through a latent of q_lora_rank. Each
query and key head is [nope_head_dim | rope_head_dim]: positions rotate only the second part.
Value heads are v_head_dim, apart from the query's. The attention itself is the layer's
(model/attention.py), as is its output projection.

With rope_interleave (DeepSeek's checkpoints) the rotary pairs are (x0, x1), (x2, x3), ...; the
rotation returns them as [evens | odds], as transformers' DeepseekV3 does: the scores are the same
either way, since query and key come out alike.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.config import ModelConfig
from jaxtrain.model.layers import constrain, dense, norm, rope, rope_frequencies, rope_scale, yarn_mscale

# transformers' DeepseekV3 builds the latents' RMSNorms with their default eps, not rms_norm_eps.
LATENT_EPS = 1e-6


def latent_qkv(cfg: ModelConfig, dtype: Any, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, ...]:
    """x [B, T, d] -> q, k [B, T, N, nope + rope], v [B, T, N, v_head_dim], rotated at `positions`.
    Called inside the attention layer's compact __call__: its params are the layer's."""
    b, t, _ = x.shape
    n, nope, rot, lora = cfg.n_head, cfg.nope_head_dim, cfg.rope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank:
        latent_q = dense(cfg.q_lora_rank, cfg.init_std, dtype, "q_a", matmul=cfg.matmul)(x)
        q = dense((n, nope + rot), cfg.init_std, dtype, "q_b", matmul=cfg.matmul)(
            norm(latent_q, LATENT_EPS, "q_a_norm")
        )
    else:
        q = dense((n, nope + rot), cfg.init_std, dtype, "q", matmul=cfg.matmul)(x)
    q = constrain(q, "batch", "length", "heads", None)  # [B, T, N, nope + rope]
    latent_kv = dense(lora + rot, cfg.init_std, dtype, "kv_a", matmul=cfg.matmul)(x)  # [B, T, lora + rope]
    kv = dense((n, nope + cfg.v_head_dim), cfg.init_std, dtype, "kv_b", matmul=cfg.matmul)(
        norm(latent_kv[..., :lora], LATENT_EPS, "kv_a_norm")
    )
    kv = constrain(kv, "batch", "length", "heads", None)  # [B, T, N, nope + v]
    inv_freq, scale = rope_frequencies(cfg, rot), rope_scale(cfg)
    q_rot = rope(q[..., nope:], cfg.rope_theta, positions, inv_freq, cfg.rope_interleave, scale)
    k_rot = rope(
        latent_kv[:, :, None, lora:], cfg.rope_theta, positions, inv_freq, cfg.rope_interleave, scale
    )
    q = jnp.concatenate([q[..., :nope], q_rot], axis=-1)
    if cfg.rope_scaling_factor and cfg.rope_mscale_all_dim:
        # DeepSeek's YaRN also sharpens the softmax by mscale(all_dim)^2: scaling q scales every score
        q = q * jnp.asarray(yarn_mscale(cfg.rope_scaling_factor, cfg.rope_mscale_all_dim) ** 2, q.dtype)
    k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rot, (b, t, n, rot))], axis=-1)
    return q, k, kv[..., nope:]
