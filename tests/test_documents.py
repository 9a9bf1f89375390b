"""Packed documents: attention never crosses a boundary token and positions restart in each, so a
packed window computes each document exactly as it computes it alone; prepare frames documents
with the tokenizer's own boundary tokens and records them in the manifest.

    pytest tests/test_documents.py
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.config import ModelConfig
from jaxtrain.model.transformer import GPT

BOS, EOS = 1, 2


def _docs(rng: np.random.Generator, lengths: list[int], bos: int, eos: int) -> list[np.ndarray]:
    out = []
    for n in lengths:
        body = rng.integers(3, 64, n)
        out.append(
            np.concatenate([[bos] if bos >= 0 else [], body, [eos] if eos >= 0 else []]).astype(np.int32)
        )
    return out


MODELS = {
    "llama": ModelConfig(
        vocab_size=64, seq_len=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32, mlp="swiglu", d_ff=64,
        tie_embeddings=False, attention_impl="xla",
    ),
    "gpt_learned_scan": ModelConfig(
        vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=32, pos_embedding="learned",
        scan_layers=True, attention_impl="xla",
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "name,bos,eos", [("llama", BOS, -1), ("gpt_learned_scan", -1, EOS), ("llama", BOS, EOS)]
)
def test_packed_documents_compute_as_each_alone(name, bos, eos):
    cfg = dataclasses.replace(MODELS[name], doc_bos=bos, doc_eos=eos)
    docs = _docs(np.random.default_rng(0), [7, 12, 5], bos, eos)
    packed = np.concatenate(docs)
    # One batch: the packed window, then each document alone, right-padded (causal attention: the
    # padding after a document changes nothing before it).
    rows = np.full((1 + len(docs), len(packed)), 3, np.int32)
    rows[0] = packed
    for i, d in enumerate(docs):
        rows[1 + i, : len(d)] = d
    model = GPT(cfg, jnp.float32)
    params = model.init(jax.random.key(0), jnp.asarray(rows[:1]))["params"]
    out = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(rows)))
    alone = np.concatenate([out[1 + i, : len(d)] for i, d in enumerate(docs)])
    np.testing.assert_allclose(out[0], alone, atol=1e-5, rtol=0)
    if bos >= 0 and eos >= 0:
        return
    # Without the mask the later documents attend to the earlier ones: the test can tell.
    plain = GPT(dataclasses.replace(cfg, doc_bos=-1, doc_eos=-1), jnp.float32)
    unmasked = np.asarray(jax.jit(plain.apply)({"params": params}, jnp.asarray(rows[:1])))[0]
    assert np.abs(unmasked[len(docs[0]) :] - alone[len(docs[0]) :]).max() > 1e-3
