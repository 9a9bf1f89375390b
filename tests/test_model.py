"""GPT model: shapes, dtypes, causality, scan == unrolled, remat, compile size, counts, sampling."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.config import ModelConfig
from jaxtrain.model import attention, layers
from jaxtrain.model import generate as generate_lib
from jaxtrain.model.generate import generate
from jaxtrain.model.params import param_count
from jaxtrain.model.transformer import GPT, flops_per_token
from jaxtrain.run import kernels

TINY = ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def _tokens(cfg: ModelConfig) -> jax.Array:
    return jax.random.randint(jax.random.key(0), (2, cfg.seq_len), 0, cfg.vocab_size, jnp.int32)


# Jitted once per (cfg, dtype): far cheaper than op-by-op dispatch on busy CPU cores.
@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_jit(cfg: ModelConfig, dtype, tokens):
    return GPT(cfg, dtype).init(jax.random.key(0), tokens)["params"]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _apply(cfg: ModelConfig, dtype, params, tokens):
    return GPT(cfg, dtype).apply({"params": params}, tokens)


def _init(cfg: ModelConfig, dtype=jnp.float32):
    return _init_jit(cfg, dtype, _tokens(cfg))


def _abstract_params(cfg: ModelConfig):
    """Param shapes without compiling or running anything."""
    return jax.eval_shape(lambda: GPT(cfg).init(jax.random.key(0), _tokens(cfg)))["params"]


def _stack_layers(params, n_layer: int):
    """Unrolled layout (block_0, block_1, ...) -> scanned layout (blocks, leading layer axis)."""
    blocks = [params[f"block_{i}"] for i in range(n_layer)]
    rest = {k: v for k, v in params.items() if not k.startswith("block_")}
    return {**rest, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)}


def _loss(cfg: ModelConfig, params, tokens):
    logits = GPT(cfg).apply({"params": params}, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grads(cfg: ModelConfig, params, tokens):
    return jax.value_and_grad(lambda p: _loss(cfg, p, tokens))(params)


def test_output_shape_and_float32_params_under_bfloat16():
    params = _init(TINY, jnp.bfloat16)
    logits = _apply(TINY, jnp.bfloat16, params, _tokens(TINY))
    assert logits.shape == (2, TINY.seq_len, TINY.vocab_size)
    assert logits.dtype == jnp.float32
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}


def test_leaf_names_fit_the_weight_decay_rule():
    # The trainer decays leaves named kernel and embedding; everything else must be a norm scale.
    for cfg in (TINY, dataclasses.replace(TINY, pos_embedding="learned", scan_layers=True)):
        paths = jax.tree_util.tree_flatten_with_path(_abstract_params(cfg))[0]
        names = {path[-1].key for path, _ in paths}
        assert names <= {"kernel", "embedding", "scale"}, names


def test_bfloat16_forward_close_to_float32():
    params, tokens = _init(TINY), _tokens(TINY)
    ref = _apply(TINY, jnp.float32, params, tokens)
    low = _apply(TINY, jnp.bfloat16, params, tokens)
    scale = float(jnp.abs(ref).max())
    np.testing.assert_allclose(low, ref, atol=0.05 * scale)


@pytest.mark.parametrize("pos_embedding", ["rope", "learned"])
def test_causal(pos_embedding):
    cfg = dataclasses.replace(TINY, pos_embedding=pos_embedding)
    params, tokens = _init(cfg), _tokens(cfg)
    t = 7
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % cfg.vocab_size)
    a = _apply(cfg, jnp.float32, params, tokens)
    b = _apply(cfg, jnp.float32, params, changed)
    np.testing.assert_array_equal(a[:, :t], b[:, :t])
    assert not np.allclose(a[:, t], b[:, t])


def test_rope_depends_only_on_relative_position():
    rng = np.random.default_rng(0)
    q = jnp.asarray(np.broadcast_to(rng.normal(size=(1, 1, 1, 8)), (1, 12, 1, 8)), jnp.float32)
    k = jnp.asarray(np.broadcast_to(rng.normal(size=(1, 1, 1, 8)), (1, 12, 1, 8)), jnp.float32)
    rq, rk = layers.rope(q, 10000.0), layers.rope(k, 10000.0)
    score = jnp.einsum("bqnh,bknh->qk", rq, rk)
    np.testing.assert_allclose(score[5, 2], score[9, 6], rtol=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(rq, axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5)


@pytest.mark.parametrize("pos_embedding", ["rope", "learned"])
def test_scan_matches_unrolled(pos_embedding):
    unrolled = dataclasses.replace(TINY, pos_embedding=pos_embedding, scan_layers=False)
    scanned = dataclasses.replace(unrolled, scan_layers=True)
    params, tokens = _init(unrolled), _tokens(unrolled)
    stacked = _stack_layers(params, TINY.n_layer)
    assert jax.tree.map(jnp.shape, stacked) == jax.tree.map(jnp.shape, _abstract_params(scanned))
    a = _apply(unrolled, jnp.float32, params, tokens)
    b = _apply(scanned, jnp.float32, stacked, tokens)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "scan_layers,remat", [(False, "full"), (False, "dots"), (True, "full"), (True, "dots")]
)
def test_remat_keeps_loss_and_grads(scan_layers, remat):
    params, tokens = _init(TINY), _tokens(TINY)
    ref_loss, ref_grads = _loss_and_grads(TINY, params, tokens)
    cfg = dataclasses.replace(TINY, scan_layers=scan_layers, remat=remat)
    if scan_layers:
        params, ref_grads = _stack_layers(params, TINY.n_layer), _stack_layers(ref_grads, TINY.n_layer)
    loss, grads = _loss_and_grads(cfg, params, tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, ref_grads)


def test_scan_program_size_flat_in_depth():
    def program_lines(cfg: ModelConfig) -> int:
        grad = jax.jit(jax.grad(lambda p, t: _loss(cfg, p, t)))
        return len(grad.lower(_abstract_params(cfg), _tokens(cfg)).as_text().splitlines())

    sizes = {
        (scan, depth): program_lines(dataclasses.replace(TINY, scan_layers=scan, n_layer=depth))
        for scan in (True, False)
        for depth in (2, 8)
    }
    assert sizes[True, 8] == sizes[True, 2], sizes
    assert sizes[False, 8] > 2 * sizes[False, 2], sizes


@pytest.mark.parametrize("pos_embedding", ["rope", "learned"])
def test_param_count_hand_formula(pos_embedding):
    cfg = dataclasses.replace(TINY, pos_embedding=pos_embedding)
    v, t, d, f, n = cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.ff_dim, cfg.n_layer
    # tied embedding once; per layer qkv + out + fc + out + 2 norm scales; final norm scale
    expected = v * d + n * (3 * d * d + d * d + 2 * d * f + 2 * d) + d
    if pos_embedding == "learned":
        expected += t * d
    assert param_count(_init(cfg)) == expected
    assert param_count(_abstract_params(cfg)) == expected


def test_flops_per_token_counts_causal_attention_at_half():
    cfg = ModelConfig(n_layer=12, d_model=768, seq_len=1024)
    n = 124_000_000
    # QK^T and AV: 2 x 2 x d x T multiply-adds per token and layer forward, x3 with the backward,
    # halved for the causal mask (cuDNN's causal kernel skips the masked half).
    assert flops_per_token(cfg, n) == 6 * n + 12 * 12 * 768 * 1024 / 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_own_attention_matches_jax_xla_attention(dtype):
    # The xla path (and auto on CPU) is our two-einsum attention: the same function as jax's.
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 24, 3, 16), dtype) for i in range(3))
    ours = attention.causal_attention(q, k, v, "xla")
    theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    assert ours.dtype == theirs.dtype == dtype
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.float32(ours), np.float32(theirs), rtol=tol, atol=tol)
    assert jnp.array_equal(attention.causal_attention(q, k, v, "auto"), ours)  # outside the steps
    assert kernels.attention(ModelConfig(attention_impl="auto"), "cpu", dtype) == "xla"  # on CPU


def test_generate():
    params = _init(TINY)
    prompt = np.array([1, 2, 3], np.int32)
    before = generate_lib._prefill._cache_size(), generate_lib._extend._cache_size()
    # 20 new tokens after 3 prompt tokens runs past seq_len 16, so the cache is refilled.
    out = generate(params, TINY, prompt, 20, jax.random.key(1))
    assert out.shape == (20,) and out.dtype == np.int32
    assert ((out >= 0) & (out < TINY.vocab_size)).all()
    np.testing.assert_array_equal(out, generate(params, TINY, prompt, 20, jax.random.key(1)))
    assert not np.array_equal(out, generate(params, TINY, prompt, 20, jax.random.key(2)))
    # Fixed shapes: one compile of the prefill and one of the step for every token and call.
    after = generate_lib._prefill._cache_size(), generate_lib._extend._cache_size()
    assert after == (before[0] + 1, before[1] + 1)


def _uncached_greedy(cfg: ModelConfig, params, prompt, n: int) -> list[int]:
    """Greedy tokens by re-running the whole window for each one (what generate did before)."""
    tokens = list(prompt)
    for _ in range(n):
        window = np.zeros((1, cfg.seq_len), np.int32)  # right padding: invisible under causal attention
        window[0, : len(tokens)] = tokens
        logits = _apply(cfg, jnp.float32, params, window)
        tokens.append(int(jnp.argmax(logits[0, len(tokens) - 1])))
    return tokens[len(prompt) :]


@pytest.mark.parametrize(
    "pos_embedding,scan_layers", [("rope", False), ("learned", False), ("rope", True), ("learned", True)]
)
def test_cached_generate_equals_uncached_greedy(pos_embedding, scan_layers):
    cfg = dataclasses.replace(TINY, pos_embedding=pos_embedding)
    params = _init(cfg)
    if scan_layers:
        cfg, params = dataclasses.replace(cfg, scan_layers=True), _stack_layers(params, TINY.n_layer)
    prompt = np.array([5, 9, 1, 33], np.int32)
    # Prompt + new tokens fill the window exactly: every cached position is checked.
    n = cfg.seq_len - len(prompt)
    out = generate(params, cfg, prompt, n, jax.random.key(0), top_k=1)
    assert out.tolist() == _uncached_greedy(cfg, params, prompt, n)


# Every Llama-family option at once: SwiGLU, 2 kv heads for 4 query heads, untied head, q/k norms
# and q/k/v biases (Qwen3 and Qwen2 style).
LLAMA = dataclasses.replace(
    TINY, n_head=4, n_kv_head=2, mlp="swiglu", d_ff=48, tie_embeddings=False, qk_norm=True, qkv_bias=True
)


def test_llama_options_param_count_scan_and_cached_decoding():
    params, tokens = _init(LLAMA), _tokens(LLAMA)
    v, d, f, n, h = LLAMA.vocab_size, LLAMA.d_model, LLAMA.ff_dim, LLAMA.n_layer, LLAMA.head_size
    q_kv = d * (4 + 2 * 2) * h + (4 + 2 * 2) * h  # q, k, v kernels and biases
    expected = 2 * v * d + n * (q_kv + 4 * h * d + 3 * d * f + 2 * d + 2 * h) + d
    assert param_count(params) == expected
    scanned = dataclasses.replace(LLAMA, scan_layers=True, remat="full")
    stacked = _stack_layers(params, LLAMA.n_layer)
    np.testing.assert_allclose(
        _apply(scanned, jnp.float32, stacked, tokens),
        _apply(LLAMA, jnp.float32, params, tokens),
        rtol=1e-5,
        atol=1e-6,
    )
    prompt = np.array([5, 9, 1, 33], np.int32)
    n_new = LLAMA.seq_len - len(prompt)
    greedy = generate(params, LLAMA, prompt, n_new, jax.random.key(0), temperature=0)
    assert greedy.tolist() == _uncached_greedy(LLAMA, params, prompt, n_new)


def test_grouped_query_attention_matches_jax():
    q = jax.random.normal(jax.random.key(0), (2, 24, 6, 16))
    k, v = (jax.random.normal(jax.random.key(i), (2, 24, 2, 16)) for i in (1, 2))
    theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(attention.causal_attention(q, k, v, "xla"), theirs, rtol=1e-5, atol=1e-6)
