"""GPT decoder in flax.linen: pre-norm blocks, rotary or learned positions, tied output.

Options for the Llama family (config.ModelConfig): a SwiGLU MLP, grouped-query attention,
an untied output head, q/k norms (Qwen3), q/k/v biases (Qwen2). Rotary positions rotate the
two contiguous halves of each head (rotate-half), the layout Hugging Face checkpoints use.

Params are always float32; `dtype` is the compute dtype of activations and matmuls.
Norms and rotary angles run in float32 and logits come back as float32.

    model = GPT(cfg.model, dtype=jnp.bfloat16)
    params = model.init(rng, tokens)["params"]   # tokens: int32 [B, T], T <= seq_len
    logits = model.apply({"params": params}, tokens)   # float32 [B, T, vocab]
    new_tokens = generate(params, cfg.model, prompt, 256, rng)   # KV-cached sampling

With `decode=True` the model keeps a key/value cache (flax collection "cache") of seq_len
positions per layer, and each call appends its tokens at the cache's index.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtrain.config import ModelConfig

# Logical axes of every param, by the end of its path; jaxtrain/mesh.py maps them to mesh axes.
# Attention kernels keep (heads, head_dim) apart so tensor parallelism splits whole heads.
# Grouped-query attention keeps q ([d, heads, head_dim]) apart from k and v ([d, 2, kv heads,
# head_dim]); both head axes are `heads`, so tensor parallelism splits whole groups.
PARAM_AXES: dict[tuple[str, ...], tuple[str | None, ...]] = {
    ("wte", "embedding"): ("vocab", "embed"),
    ("lm_head", "embedding"): ("vocab", "embed"),  # untied output head, laid out as wte
    ("wpe", "embedding"): (None, "embed"),
    ("attn", "qkv", "kernel"): ("embed", None, "heads", None),
    ("attn", "qkv", "bias"): (None, "heads", None),
    ("attn", "q", "kernel"): ("embed", "heads", None),
    ("attn", "q", "bias"): ("heads", None),
    ("attn", "kv", "kernel"): ("embed", None, "heads", None),
    ("attn", "kv", "bias"): (None, "heads", None),
    ("attn", "out", "kernel"): ("heads", None, "embed"),
    ("mlp", "fc", "kernel"): ("embed", "mlp"),
    ("mlp", "gate_up", "kernel"): ("embed", None, "mlp"),
    ("mlp", "out", "kernel"): ("mlp", "embed"),
    ("scale",): (None,),  # norm scales: small, replicated
    ("embedding",): (None, "embed"),  # an embedding's own params, as `GPT.gather` sees them
}


def param_axes(params: Any) -> Any:
    """Logical axes of every leaf of a param tree; a scanned stack gets a leading `layers` axis."""

    return jax.tree_util.tree_map_with_path(lambda path, leaf: logical_axes(path, len(leaf.shape)), params)


def path_names(path: tuple) -> tuple[str, ...]:
    """A tree path's keys as names: ("block_0", "attn", "qkv", "kernel"); optax states' attribute
    names (`mu`, `nu`) and sequence indices too."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def logical_axes(path: tuple, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the param at `path` (tree path keys); the first PARAM_AXES suffix wins."""
    names = path_names(path)
    for suffix, logical in PARAM_AXES.items():
        if names[-len(suffix) :] == suffix:
            return ("layers",) * (ndim - len(logical)) + logical
    raise KeyError(f"no logical axes for param {'/'.join(names)}; add it to model.PARAM_AXES")


def _constrain(x: jax.Array, *logical: str | None) -> jax.Array:
    """Pin an activation's layout by logical axes (a no-op unless the step sets axis rules)."""
    return nn.with_logical_constraint(x, logical)


def _cache_index(module: nn.Module, length: int) -> jax.Array:
    """Decoding: the first position of this call's tokens; the cache index moves past them."""
    index = module.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
    start = index.value
    index.value = start + length
    return start


def _dense(
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


def _residual_std(cfg: ModelConfig) -> float:
    # GPT-2: each block adds two residual branches, so scale their output init to keep the
    # residual stream's variance independent of depth.
    return cfg.init_std / math.sqrt(2 * cfg.n_layer)


def _norm(x: jax.Array, eps: float, name: str) -> jax.Array:
    """RMSNorm in float32 (a low-precision mean of squares is noisy), output in x's dtype."""
    y = nn.RMSNorm(epsilon=eps, dtype=jnp.float32, param_dtype=jnp.float32, name=name)(x.astype(jnp.float32))
    return y.astype(x.dtype)


def _inv_freq(cfg: ModelConfig, h: int) -> jax.Array:
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


def _rope(x: jax.Array, theta: float, positions: jax.Array | None = None, inv_freq: Any = None) -> jax.Array:
    """Rotate [B, T, N, H] by position (default 0..T-1; rotate-half layout), in float32; inv_freq:
    the frequencies (default theta's plain ones)."""
    t, h = x.shape[1], x.shape[3]
    positions = jnp.arange(t) if positions is None else positions
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    cos = jnp.cos(angles)[None, :, None, :]
    sin = jnp.sin(angles)[None, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : h // 2], xf[..., h // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# cuDNN's fused (flash) attention: half or bfloat16 inputs, head dim a multiple of 8 up to 128
# (256 on Hopper and later; 128 holds on every GPU jax supports). jax's own checks, in
# jax/_src/cudnn/fused_attention_stablehlo.py (check_layout, check_is_flash_attention).
_CUDNN_DTYPES = ("bfloat16", "float16")
_CUDNN_MAX_HEAD_DIM = 128


def attention_kernel(cfg: ModelConfig, platform: str, dtype: Any) -> str:
    """The causal attention kernel a run compiles to, "cudnn" or "xla" (resolves attention_impl auto).

    `platform` is the devices' ("gpu", "cpu", ...: jax's Device.platform), `dtype` the compute
    dtype. auto picks cuDNN on GPUs wherever it supports the dtype and head dim, XLA elsewhere
    (jax's own `implementation=None` always takes XLA's path, which materialises T x T scores).
    """
    if cfg.attention_impl != "auto":
        return cfg.attention_impl
    return _auto_kernel(platform, jnp.dtype(dtype).name, cfg.head_size)


def _auto_kernel(platform: str, dtype: str, head_dim: int) -> str:
    fits = dtype in _CUDNN_DTYPES and head_dim % 8 == 0 and head_dim <= _CUDNN_MAX_HEAD_DIM
    return "cudnn" if platform == "gpu" and fits else "xla"


def _causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, impl: str) -> jax.Array:
    """Causal attention, q [B, T, N, H], k and v [B, T, K, H] (K divides N) -> [B, T, N, H],
    softmax in float32. With K < N each key/value head serves N / K consecutive query heads.

    auto is resolved by `attention_kernel` (the train and eval steps resolve it for their mesh's
    devices; a model applied outside them, as in tests, runs XLA's attention for auto). cudnn: cuDNN's fused
    kernel, run per device (`_per_device`). xla: the same math as jax's XLA path in two einsums,
    without its grouped-query vmap, whose layout changes cost XLA:CPU transposes and copies: +3.5%
    tok/s on the issue shape (bench_torch.py, 2 cores).
    """
    if impl == "cudnn":
        kernel = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
        return _per_device(kernel, q, k, v)
    b, t, n, h = q.shape
    q = q * jnp.asarray(1.0 / math.sqrt(h), q.dtype)
    causal = jnp.tril(jnp.ones((t, t), bool))
    if k.shape[2] == n:
        logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
        logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1).astype(v.dtype), v)
    # Grouped: query heads as [kv head, group], so k and v are read once per group, not copied.
    q = q.reshape(b, t, k.shape[2], n // k.shape[2], h)
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
    y = jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(logits, axis=-1).astype(v.dtype), v)
    return y.reshape(b, t, n, h)


def _per_device(kernel: Callable[..., jax.Array], *qkv: jax.Array) -> jax.Array:
    """kernel(q, k, v) on each device's own rows and heads, manual over the mesh axes still automatic.

    cuDNN attention's custom partitioner cannot place a call inside a partly manual shard_map (the
    train step is manual over data and fsdp, automatic over tensor): XLA's GPU compiler stops on an
    AssertionError in it. With every mesh axis manual, jax lowers the kernel as is, so the
    automatic axes (tensor) become manual here, splitting heads (and any other dim) as the model's
    logical activation axes place them. Outside any mesh the kernel runs as is.
    """
    mesh = jax.sharding.get_abstract_mesh()
    auto = set(mesh.axis_names) - set(mesh.manual_axes)
    if mesh.empty or not auto:
        return kernel(*qkv)
    placed = nn.logical_to_mesh_axes(("batch", "length", "heads", None)) or P()
    spec = P(*(axis if axis in auto else None for axis in placed))
    return jax.shard_map(kernel, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, axis_names=auto)(*qkv)


class Attention(nn.Module):
    """Causal multi-head (or grouped-query) self-attention."""

    cfg: ModelConfig
    dtype: Any
    decode: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, t, d = x.shape
        n, kv_heads, head_dim, bias = cfg.n_head, cfg.kv_heads, cfg.head_size, cfg.qkv_bias
        if kv_heads == n:
            qkv = _dense((3, n, head_dim), cfg.init_std, self.dtype, "qkv", bias=bias)(x)  # [B, T, 3, N, H]
            qkv = _constrain(qkv, "batch", "length", None, "heads", None)
            # One split, not three index slices: its gradient is one concatenate, where the slices'
            # is three zero-padded copies added up (XLA:CPU keeps those pads: ~4% of a step).
            q, k, v = (x[:, :, 0] for x in jnp.split(qkv, 3, axis=2))  # [B, T, N, H]
        else:
            q = _dense((n, head_dim), cfg.init_std, self.dtype, "q", bias=bias)(x)  # [B, T, N, H]
            q = _constrain(q, "batch", "length", "heads", None)
            kv = _dense((2, kv_heads, head_dim), cfg.init_std, self.dtype, "kv", bias=bias)(x)
            kv = _constrain(kv, "batch", "length", None, "heads", None)
            k, v = (x[:, :, 0] for x in jnp.split(kv, 2, axis=2))  # [B, T, K, H]
        if cfg.qk_norm:
            q, k = _norm(q, cfg.norm_eps, "q_norm"), _norm(k, cfg.norm_eps, "k_norm")
        start = _cache_index(self, t) if self.decode else 0
        if cfg.pos_embedding == "rope":
            positions = start + jnp.arange(t)
            inv_freq = _inv_freq(cfg, head_dim)
            q, k = (
                _rope(q, cfg.rope_theta, positions, inv_freq),
                _rope(k, cfg.rope_theta, positions, inv_freq),
            )
        if self.decode:
            shape = (b, cfg.seq_len, kv_heads, head_dim)
            cached_k = self.variable("cache", "k", jnp.zeros, shape, k.dtype)
            cached_v = self.variable("cache", "v", jnp.zeros, shape, v.dtype)
            cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k, (0, start, 0, 0))
            cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v, (0, start, 0, 0))
            # Query i sits at start + i and sees the cache up to there; later slots hold stale
            # entries or padding. Decoding is memory-bound: the plain XLA kernel is enough.
            mask = jnp.arange(cfg.seq_len)[None, :] <= (start + jnp.arange(t))[:, None]  # [T, S]
            y = jax.nn.dot_product_attention(
                q, cached_k.value, cached_v.value, mask=mask[None, None], implementation="xla"
            )
        else:
            y = _causal_attention(q, k, v, cfg.attention_impl)
        y = _constrain(y, "batch", "length", "heads", None)
        out = _dense(d, _residual_std(cfg), self.dtype, "out", axis=(-2, -1))(y)
        return _constrain(out, "batch", "length", "embed")


class Mlp(nn.Module):
    """Two-layer GELU feed-forward, or SwiGLU (gate and up as one [d, 2, ff] matmul, then down)."""

    cfg: ModelConfig
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        if cfg.mlp == "swiglu":
            gate_up = _dense((2, cfg.ff_dim), cfg.init_std, self.dtype, "gate_up")(x)  # [B, T, 2, ff]
            gate_up = _constrain(gate_up, "batch", "length", None, "mlp")
            gate, up = (x[:, :, 0] for x in jnp.split(gate_up, 2, axis=2))
            h = nn.silu(gate) * up
        else:
            h = nn.gelu(_dense(cfg.ff_dim, cfg.init_std, self.dtype, "fc")(x))
        h = _constrain(h, "batch", "length", "mlp")
        out = _dense(x.shape[-1], _residual_std(self.cfg), self.dtype, "out")(h)
        return _constrain(out, "batch", "length", "embed")


class Block(nn.Module):
    """Pre-norm transformer block."""

    cfg: ModelConfig
    dtype: Any
    decode: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, _: None = None) -> tuple[jax.Array, None]:
        # (carry, per-layer input) -> (carry, per-layer output): the signature nn.scan needs.
        eps = self.cfg.norm_eps
        x = x + Attention(self.cfg, self.dtype, self.decode, name="attn")(_norm(x, eps, "ln_1"))
        x = x + Mlp(self.cfg, self.dtype, name="mlp")(_norm(x, eps, "ln_2"))
        return x, None


def _with_gather(cls: Any, gather: Callable[[Any], Any] | None, methods: list[str] | None = None) -> Any:
    """`cls` whose params pass through `gather` each time it runs (no-op when gather is None)."""
    if gather is None:
        return cls
    return nn.map_variables(cls, "params", trans_in_fn=gather, methods=methods)


def _block_class(cfg: ModelConfig, gather: Callable[[Any], Any] | None) -> Any:
    """Block, its params gathered as it runs, wrapped in nn.remat as cfg.remat asks."""
    block = _with_gather(Block, gather)
    if cfg.remat == "none":
        return block
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable if cfg.remat == "dots" else None
    # Under scan the loop body already stops CSE across the recomputation; outside it,
    # prevent_cse keeps XLA from merging the recomputed forward into the saved one.
    return nn.remat(block, policy=policy, prevent_cse=not cfg.scan_layers)


class GPT(nn.Module):
    """Decoder-only language model: int32 tokens [B, T] -> float32 logits [B, T, vocab]."""

    cfg: ModelConfig
    dtype: Any = jnp.float32
    # Applied to each layer's (and each embedding's) params right before they are used. The
    # step passes FSDP's all-gather here, so whole params exist one layer at a time; the model
    # itself never knows how params are laid out.
    gather: Callable[[Any], Any] | None = None
    decode: bool = False  # keep a KV cache (collection "cache"): see `generate`

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        embed = functools.partial(
            _with_gather(nn.Embed, self.gather, methods=["__call__", "attend"]),
            features=cfg.d_model,
            dtype=self.dtype,
            param_dtype=jnp.float32,
            embedding_init=nn.initializers.normal(cfg.init_std),
        )
        wte = embed(cfg.vocab_size, name="wte")
        x = wte(tokens)
        if cfg.pos_embedding == "learned":
            start = _cache_index(self, tokens.shape[1]) if self.decode else 0
            x = x + embed(cfg.seq_len, name="wpe")(start + jnp.arange(tokens.shape[1]))[None]
        block = _block_class(cfg, self.gather)
        if cfg.scan_layers:
            # One traced body for all layers: compile time stays flat in depth.
            stack = nn.scan(
                block,
                variable_axes={"params": 0, "cache": 0},
                split_rngs={"params": True},
                length=cfg.n_layer,
            )
            x, _ = stack(cfg, self.dtype, self.decode, name="blocks")(x, None)
        else:
            for i in range(cfg.n_layer):
                x, _ = block(cfg, self.dtype, self.decode, name=f"block_{i}")(x)
        x = _norm(x, cfg.norm_eps, "ln_f")
        head = wte if cfg.tie_embeddings else embed(cfg.vocab_size, name="lm_head")
        return _constrain(head.attend(x), "batch", "length", "vocab").astype(jnp.float32)


def param_count(params: Any) -> int:
    """Number of scalars in a param tree (arrays or jax.eval_shape structs)."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def param_summary(params: Any) -> str:
    """Parameters per module, one line each; identical consecutive blocks share a line:

    wte                       32,768
    block_0..3 (each)         attn 65,536, mlp 131,072, ln_1 128, ln_2 128
    ln_f                      128
    """
    modules: dict[str, dict[str, int]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = path_names(path)
        parts = modules.setdefault(names[0], {})
        part = names[1] if names[0].startswith("block") and len(names) > 2 else ""
        parts[part] = parts.get(part, 0) + math.prod(leaf.shape)
    rows: list[list[Any]] = []  # [label, parts, first block, last block]

    def order(name: str) -> tuple[int, int, str]:  # embeddings, blocks by number, final norm
        block = name.startswith("block")
        return (1 if block else 2 if name == "ln_f" else 0, int(name[6:]) if name[6:].isdigit() else 0, name)

    for name, parts in sorted(modules.items(), key=lambda item: order(item[0])):
        index = int(name[6:]) if name.startswith("block_") else -1
        if index > 0 and rows and rows[-1][1] == parts and rows[-1][3] == index - 1:
            rows[-1][0], rows[-1][3] = f"block_{rows[-1][2]}..{index} (each)", index
            continue
        label = name
        if name == "blocks":  # scanned: each leaf stacks every layer
            label = f"blocks ({jax.tree.leaves(params[name])[0].shape[0]} layers)"
        rows.append([label, parts, index, index])
    return "\n".join(
        f"  {label:<24}  " + ", ".join(f"{part} {n:,}".strip() for part, n in parts.items())
        for label, parts, _, _ in rows
    )


def flops_per_token(cfg: ModelConfig, n_params: int) -> float:
    """Training FLOPs per token: 6 * n_params + 12 * n_layer * d_model * seq_len.

    6N counts the forward (2N) and backward (4N) multiply-adds of every weight matmul,
    with the tied embedding counted once as the output projection (an untied input embedding
    is a lookup: not counted); 12 * L * d * T (d: heads x head size) adds the
    attention scores and weighted sum (QK^T and AV, forward and backward), as in PaLM
    (Chowdhery et al. 2022, appendix B) and nanoGPT's estimate_mfu. Causal masking is
    not discounted, so this slightly overstates attention work.
    """
    matmul_params = n_params - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
    return 6.0 * matmul_params + 12.0 * cfg.n_layer * cfg.n_head * cfg.head_size * cfg.seq_len


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
    temperature: float = 0.8,
    top_k: int | None = 40,
    dtype: Any = jnp.float32,
) -> np.ndarray:
    """Sample max_new_tokens after a 1-D prompt; returns only the new tokens, int32.

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
        tokens.append(int(token))
    return np.asarray(tokens[len(prompt) :], np.int32)
