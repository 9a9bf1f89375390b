"""The attention kernel's choice, and the per-device wrapper that lets cuDNN's kernel compile under
every mesh. The GPU program itself (cuDNN calls present, temporaries per device) is compiled for
H100s in tests/test_gpu_compile.py."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain.config import ConfigError, MeshConfig, ModelConfig, MoeConfig
from jaxtrain.model import attention, documents
from jaxtrain.parallel import context
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.run import kernels
from jaxtrain.run.kernels import attention as attention_kernel


def test_auto_picks_cudnn_on_gpus_where_it_runs_and_xla_elsewhere():
    gpt2 = ModelConfig(d_model=768, n_head=12)  # head dim 64
    assert attention_kernel(gpt2, "gpu", jnp.bfloat16) == "cudnn"
    assert attention_kernel(gpt2, "gpu", "float16") == "cudnn"
    assert attention_kernel(gpt2, "gpu", "float32") == "xla"  # cuDNN's fused kernel: half types only
    assert attention_kernel(gpt2, "cpu", "bfloat16") == "xla"
    assert attention_kernel(ModelConfig(d_model=768, n_head=64), "gpu", "bfloat16") == "xla"  # head dim 12
    assert attention_kernel(ModelConfig(d_model=1024, n_head=4), "gpu", "bfloat16") == "xla"  # head dim 256
    # Hopper and later take heads up to 256 (DeepSeek-V3's 192), as jax's own check does.
    assert attention_kernel(ModelConfig(d_model=1024, n_head=4), "gpu", "bfloat16", "9.0") == "cudnn"
    assert attention_kernel(ModelConfig(d_model=1024, n_head=4), "gpu", "bfloat16", "8.0") == "xla"
    assert attention_kernel(ModelConfig(d_model=1024, n_head=2), "gpu", "bfloat16", "10.0") == "xla"  # 512
    assert attention_kernel(ModelConfig(attention_impl="xla"), "gpu", "bfloat16") == "xla"
    assert attention_kernel(ModelConfig(attention_impl="cudnn"), "gpu", "float32") == "cudnn"  # as asked


def test_an_explicit_cudnn_the_devices_cannot_run_is_refused_in_one_line():
    """One rule, settled where the job meets its devices (run/kernels.py), never while tracing."""
    wide = ModelConfig(d_model=1024, n_head=4, attention_impl="cudnn")  # head dim 256
    assert attention_kernel(wide, "gpu", "bfloat16", "9.0") == "cudnn"
    with pytest.raises(
        ConfigError, match="cudnn takes heads of at most 128 on GPUs of compute capability 8.0"
    ):
        attention_kernel(wide, "gpu", "bfloat16", "8.0")
    with pytest.raises(ConfigError, match="cudnn needs NVIDIA GPUs, and this job runs on cpu"):
        attention_kernel(wide, "cpu", "bfloat16")


def test_auto_grouped_matmul_is_blocks_on_cpu_pallas_on_hopper_where_its_tiles_fit():
    moe = MoeConfig(n_experts=8, d_expert=768)
    qwen3 = ModelConfig(d_model=2048, n_head=16, moe=moe)
    assert kernels.grouped_matmul(qwen3, "cpu") == "blocks"
    assert kernels.grouped_matmul(qwen3, "gpu", "9.0") == "pallas"
    assert kernels.grouped_matmul(qwen3, "gpu", "8.0") == "ragged_dot"
    assert kernels.grouped_matmul(qwen3, "gpu", "9.0", tensor=8) == "ragged_dot"  # 96 a shard: not a tile
    pallas = dataclasses.replace(qwen3, moe=dataclasses.replace(moe, grouped_matmul="pallas"))
    with pytest.raises(ConfigError, match="is not a multiple of 128 for grouped_matmul pallas"):
        kernels.grouped_matmul(pallas, "gpu", "9.0", tensor=8)
    settled = kernels.settle(qwen3, "gpu", "bfloat16", "9.0")
    assert (settled.attention_impl, settled.moe.grouped_matmul) == ("cudnn", "pallas")


def test_kernel_runs_on_each_devices_rows_and_heads_inside_the_steps_shard_map():
    """The wrapper cuDNN runs in, checked with XLA's kernel on CPU: same values and gradients."""
    mesh = mesh_lib.make_mesh(shape=MeshConfig(data=2, fsdp=2, tensor=2))
    q, k, v = jax.random.normal(jax.random.key(0), (3, 8, 16, 4, 8))  # [B, T, N, H] each
    seen = []

    def kernel(q, k, v, segments=None):
        seen.append(q.shape)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    def loss(q, k, v):
        return jnp.sum(context.per_device(kernel, q, k, v, None) ** 2)

    def local(q, k, v):  # as the step runs the model: manual over the batch axes, tensor automatic
        with nn.logical_axis_rules(mesh_lib.ACTIVATION_RULES):
            out = context.per_device(kernel, q, k, v, None)
            return out, *jax.grad(loss, (0, 1, 2))(q, k, v)  # differentiated inside, as the step does

    batch = P(mesh_lib.BATCH_AXES)
    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=batch,
        out_specs=batch,
        axis_names=set(mesh_lib.BATCH_AXES),
        check_vma=False,
    )
    out, *grads = jax.jit(sharded)(q, k, v)
    assert set(seen) == {(2, 16, 2, 8)}  # 8 rows over data x fsdp, 4 heads over tensor
    want = lambda q, k, v: jnp.sum(kernel(q, k, v) ** 2)  # noqa: E731
    np.testing.assert_allclose(out, kernel(q, k, v), atol=1e-5)
    for g, w in zip(grads, jax.grad(want, (0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)


# Compiles configs/gpt2_124m.yaml (attention_impl auto) for each case and prints one JSON line
# each: the cuDNN attention calls, the q operand of the forward call, and the temp bytes.


def _packed_reference(q, k, v, offsets, lengths):
    """The rows of each block [B', T] each document covers, per cuDNN's packed form (jax's
    q_offsets / q_seqlen layout), and each row's document id (rows none covers: one alone)."""
    t = jnp.arange(q.shape[1])
    starts, ends = offsets[:, :-1, None], offsets[:, :-1, None] + lengths[:, :, None]
    covers = (lengths[:, :, None] > 0) & (starts <= t) & (t < ends)  # [B', docs, T]
    doc = jnp.where(covers.any(1), jnp.argmax(covers, axis=1), -1 - t)
    return covers.any(1)[:, :, None, None], doc


def _emulated_forward(q, k, v, offsets, lengths):
    """cuDNN's packed forward in XLA: the output and the softmax's log-sum-exp [B', N, T] of each
    covered row; the other rows NaN (cuDNN leaves them unwritten)."""
    covered, doc = _packed_reference(q, k, v, offsets, lengths)
    k, v = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=2) for x in (k, v))
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    mask = (doc[:, :, None] == doc[:, None, :]) & jnp.tril(jnp.ones((q.shape[1],) * 2, bool))
    logits = jnp.where(mask[:, None], logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    y = jnp.einsum("bnts,bsnh->btnh", jnp.exp(logits - lse[..., None]), v)
    return jnp.where(covered, y, jnp.nan), lse


def _emulated_backward(q, k, v, offsets, lengths, lse, y, g):
    """FlashAttention's backward from the saved output and stats, as cuDNN computes it, reading
    only covered rows of y and dy (others zeroed here) and writing NaN to the rest."""
    covered, doc = _packed_reference(q, k, v, offsets, lengths)
    y, g = (jnp.where(covered, x, 0) for x in (y, g))
    groups = q.shape[2] // k.shape[2]
    kr, vr = (jnp.repeat(x, groups, axis=2) for x in (k, v))
    scale = 1 / np.sqrt(q.shape[-1])
    mask = (doc[:, :, None] == doc[:, None, :]) & jnp.tril(jnp.ones((q.shape[1],) * 2, bool))
    logits = jnp.einsum("btnh,bsnh->bnts", q, kr) * scale
    p = jnp.where(mask[:, None], jnp.exp(logits - lse[..., None]), 0)
    dv = jnp.einsum("bnts,btnh->bsnh", p, g)
    dp = jnp.einsum("btnh,bsnh->bnts", g, vr)
    ds = p * (dp - jnp.einsum("btnh,btnh->bnt", g, y)[..., None])
    dq = jnp.einsum("bnts,bsnh->btnh", ds, kr) * scale
    dk = jnp.einsum("bnts,btnh->bsnh", ds, q) * scale
    dk, dv = (x.reshape(*x.shape[:2], k.shape[2], groups, -1).sum(3) for x in (dk, dv))
    return tuple(jnp.where(covered, d, jnp.nan) for d in (dq, dk, dv))


EMULATED = attention.PackedKernel(_emulated_forward, _emulated_backward)


def _random_documents(rng, b, t, tiny):
    """Segments [B, T]: documents of lengths from 1 token to the whole window, the first row's a
    run of one-token documents (`tiny` of them) inside longer ones."""
    rows = []
    for i in range(b):
        ends = set(rng.choice(np.arange(1, t), size=t // 24, replace=False).tolist())
        if i == 0:
            start = rng.integers(0, t - tiny)
            ends |= set(range(start, start + tiny))
        rows.append(np.cumsum(np.isin(np.arange(t), sorted(ends))))
    return jnp.asarray(np.stack(rows), jnp.int32)


@pytest.mark.parametrize("split, smallest, t", [(16, 16, 256), (4, 2, 64)])
def test_packed_documents_attend_exactly_as_the_dense_mask(monkeypatch, split, smallest, t):
    """attention.packed_attention (cuDNN's packed form emulated: FlashAttention's backward from
    the output and stats it is given, its unwritten rows NaN, forward and backward) gives XLA's
    masked attention's values and gradients, with one-token documents past any bound on documents
    a block: at the shipped split (256 tokens: one packed level) and at 4 (64 tokens: two packed
    levels, 3 documents a block at most), 8 query heads over 2 kv heads."""
    monkeypatch.setattr(documents, "SPLIT", split)
    monkeypatch.setattr(documents, "SMALLEST", smallest)
    assert len(documents.block_sizes(t)) == (2 if split == 16 else 3)
    segments = _random_documents(np.random.default_rng(0), 2, t, tiny=40 if t > 64 else 12)
    q = jax.random.normal(jax.random.key(1), (2, t, 8, 8))
    k, v = jax.random.normal(jax.random.key(2), (2, 2, t, 2, 8))
    g = jax.random.normal(jax.random.key(3), q.shape)

    def loss(kernel, q, k, v):
        return jnp.sum(kernel(q, k, v) * g)

    packed = lambda q, k, v: attention.packed_attention(q, k, v, segments, EMULATED)  # noqa: E731
    dense = lambda q, k, v: attention.xla_kernel(q, k, v, segments)  # noqa: E731
    np.testing.assert_allclose(jax.jit(packed)(q, k, v), dense(q, k, v), atol=1e-5)
    got = jax.jit(jax.grad(functools.partial(loss, packed), (0, 1, 2)))(q, k, v)
    for a, b in zip(got, jax.grad(functools.partial(loss, dense), (0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)
