"""The output head and the MLPs over pieces of the sequence (model/head.py, mlp.py): each token's
loss and every gradient as all at once, and whole [tokens, vocab] logits never in memory.

    pytest tests/test_head.py
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shared import train_llama

from jaxtrain.config import ConfigError, ModelConfig, load_config
from jaxtrain.model.transformer import GPT

# A vocabulary large beside the model, so the logits dominate a step's memory.
CFG = ModelConfig(vocab_size=4096, seq_len=512, n_layer=1, n_head=2, d_model=32, remat="full")


def _tokens(cfg: ModelConfig) -> jax.Array:
    return jax.random.randint(jax.random.key(1), (2, cfg.seq_len + 1), 0, cfg.vocab_size, jnp.int32)


def _loss(cfg: ModelConfig, params, tokens):
    return GPT(cfg).apply({"params": params}, tokens[:, :-1], tokens[:, 1:]).mean()


@functools.partial(jax.jit, static_argnums=0)
def _losses_and_grads(cfg: ModelConfig, params, tokens):
    losses = GPT(cfg).apply({"params": params}, tokens[:, :-1], tokens[:, 1:])
    return losses, jax.grad(functools.partial(_loss, cfg))(params, tokens)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_chunked_loss_and_gradients_equal_whole_logits(tied):
    whole = dataclasses.replace(CFG, tie_embeddings=tied, mlp="gelu" if tied else "swiglu")
    tokens = _tokens(whole)
    params = GPT(whole).init(jax.random.key(0), tokens[:, :-1])["params"]
    losses, grads = _losses_and_grads(whole, params, tokens)
    # Per token the same matmul row and softmax: equal but for the compiler's fusion choices.
    chunked_losses, chunked_grads = _losses_and_grads(
        dataclasses.replace(whole, token_chunks=8), params, tokens
    )
    logits = GPT(whole).apply({"params": params}, tokens[:, :-1])
    assert logits.shape == (2, whole.seq_len, whole.vocab_size)  # no targets: logits, as before
    np.testing.assert_allclose(chunked_losses, losses, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


def test_chunked_head_never_holds_whole_logits():
    tokens = _tokens(CFG)
    params = jax.eval_shape(lambda: GPT(CFG).init(jax.random.key(0), tokens[:, :-1])["params"])
    logits_bytes = 2 * CFG.seq_len * CFG.vocab_size * 4  # float32 [B, T, vocab]: 16.8 MB

    def temp_bytes(chunks: int) -> int:
        cfg = dataclasses.replace(CFG, token_chunks=chunks)
        grad = jax.jit(jax.grad(functools.partial(_loss, cfg)))
        return grad.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes

    # At once, the logits and their gradient: 45.7 MB of temporaries; in 8 pieces 17.0 MB (the
    # rest of the step), so more than whole logits' worth is never held.
    whole, chunked = temp_bytes(1), temp_bytes(8)
    assert whole - chunked > logits_bytes, (whole, chunked, logits_bytes)


def test_pieces_split_by_vocabulary_over_tensor_train_as_on_one_device():
    """Under tensor parallelism each piece's logits are split by vocabulary (context splits none):
    its softmax is reduced over tensor peers piece by piece. Measured: losses within 1e-7, params
    4.3e-5 after 3 AdamW steps (test_context.py says why that tolerance)."""
    one_losses, one_params, _, _ = train_llama([], jax.devices()[:1], docs=False)
    mesh = ["--mesh.tensor", "2", "--mesh.fsdp", "4", "--mesh.data", "1", "--model.token_chunks", "4"]
    losses, params, _, _ = train_llama(mesh, jax.devices(), docs=False)
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


def test_token_chunks_that_do_not_divide_are_a_one_line_error():
    base = ["--config", "configs/tiny.yaml", "--mesh.context", "2", "--mesh.data", "4"]
    with pytest.raises(ConfigError, match=r"mesh.context x model.token_chunks = 2 x 3: .* divides 16$"):
        load_config([*base, "--model.token_chunks", "3"])
