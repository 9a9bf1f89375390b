"""KV-cached sampling from a trained model: `generate(params, cfg, prompt, max_new_tokens, rng)`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.config import Config, ModelConfig
from jaxtrain.model.transformer import GPT


def _sample(logits: jax.Array, rng: jax.Array, temperature: float, top_k: int | None) -> jax.Array:
    """One token id from float32 logits [vocab]; temperature 0 is greedy (the argmax)."""
    if temperature == 0:
        return jnp.argmax(logits).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][-1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(rng, logits).astype(jnp.int32)


def _with_index(cache: Any, index: jax.Array) -> Any:
    """The cache with every layer's (and the position embedding's) index set to `index`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.full_like(x, index) if path[-1].key == "index" else x, cache
    )


_STATIC = ("cfg", "dtype", "temperature", "top_k")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _prefill(
    params: Any,
    window: jax.Array,
    length: jax.Array,
    rng: jax.Array,
    cfg: ModelConfig,
    dtype: Any,
    temperature: float,
    top_k: int | None,
) -> tuple[jax.Array, Any]:
    """A fresh cache holding window[0, :length] (one pass), and the token after it.

    The window has a fixed [1, seq_len] shape: right padding is invisible to earlier positions
    because attention is causal, and later steps overwrite it, so one compile serves every prompt.
    """
    logits, variables = GPT(cfg, dtype, decode=True).apply({"params": params}, window, mutable=["cache"])
    return _sample(logits[0, length - 1], rng, temperature, top_k), _with_index(variables["cache"], length)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache",))
def _extend(
    params: Any,
    cache: Any,
    token: jax.Array,
    rng: jax.Array,
    cfg: ModelConfig,
    dtype: Any,
    temperature: float,
    top_k: int | None,
) -> tuple[jax.Array, Any]:
    """Append one token at the cache's index (one position of compute); sample the next."""
    logits, variables = GPT(cfg, dtype, decode=True).apply(
        {"params": params, "cache": cache}, token.reshape(1, 1), mutable=["cache"]
    )
    return _sample(logits[0, -1], rng, temperature, top_k), variables["cache"]


def generate(
    params: Any,
    cfg: ModelConfig,
    prompt: np.ndarray,
    max_new_tokens: int,
    rng: jax.Array,
    temperature: float = Config.temperature,  # the config's defaults: one place says them
    top_k: int | None = Config.top_k or None,
    dtype: Any = jnp.float32,
    stop: Collection[int] = (),
) -> np.ndarray:
    """Sample max_new_tokens after a 1-D prompt; returns only the new tokens, int32. Sampling ends
    early at a token of `stop` (an end of text or of turn), which is not returned.

    The prompt (its last seq_len tokens) fills a KV cache in one pass; each new token then costs
    one position. When the cache is full it is refilled from the last seq_len // 2 tokens, so
    positions stay within the trained window however long the output grows.
    """
    if len(prompt) == 0:
        raise ValueError("generate needs a prompt of at least one token")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    cfg = dataclasses.replace(cfg, remat="none")  # no backward pass: nothing to rematerialise
    static = {"cfg": cfg, "dtype": dtype, "temperature": float(temperature), "top_k": top_k}
    tokens = [int(t) for t in prompt]
    cache, token, position = None, None, 0
    for i in range(max_new_tokens):
        step_rng = jax.random.fold_in(rng, i)
        if token is None or position == cfg.seq_len:
            context = tokens[-(cfg.seq_len if token is None else cfg.seq_len // 2) :]
            window = np.zeros((1, cfg.seq_len), np.int32)
            window[0, : len(context)] = context
            token, cache = _prefill(params, window, np.int32(len(context)), step_rng, **static)
            position = len(context)
        else:
            token, cache = _extend(params, cache, token, step_rng, **static)
            position += 1
        if int(token) in stop:
            break
        tokens.append(int(token))
    return np.asarray(tokens[len(prompt) :], np.int32)
