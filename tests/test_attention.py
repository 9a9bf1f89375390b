"""The attention kernel's choice, and the per-device wrapper that lets cuDNN's kernel compile under
every mesh. The GPU program itself (cuDNN calls present, temporaries per device) is compiled for
H100s in tests/test_gpu_compile.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtrain.config import MeshConfig, ModelConfig
from jaxtrain.model import attention
from jaxtrain.model.attention import attention_kernel
from jaxtrain.run import mesh as mesh_lib


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
    assert attention_kernel(ModelConfig(attention_impl="cudnn"), "cpu", "float32") == "cudnn"  # as asked


def test_kernel_runs_on_each_devices_rows_and_heads_inside_the_steps_shard_map():
    """The wrapper cuDNN runs in, checked with XLA's kernel on CPU: same values and gradients."""
    mesh = mesh_lib.make_mesh(shape=MeshConfig(data=2, fsdp=2, tensor=2))
    q, k, v = jax.random.normal(jax.random.key(0), (3, 8, 16, 4, 8))  # [B, T, N, H] each
    seen = []

    def kernel(q, k, v, segments=None):
        seen.append(q.shape)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    def loss(q, k, v):
        return jnp.sum(attention._per_device(kernel, q, k, v, None) ** 2)

    def local(q, k, v):  # as the step runs the model: manual over the batch axes, tensor automatic
        with nn.logical_axis_rules(mesh_lib.ACTIVATION_RULES):
            out = attention._per_device(kernel, q, k, v, None)
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
