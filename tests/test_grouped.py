"""model/grouped.py's Hopper grouped matmul, run on this CPU by Pallas's Mosaic-GPU interpreter
(its TMA copies, wgmma and per-SM tile loop simulated): the routed rows as jax.lax.ragged_dot
computes them, an empty expert, NaN in the padding rows. The interpreter has no transposed
shared-memory operands, which both backward kernels use: those run only on a Hopper GPU.

    pytest tests/test_grouped.py     # seconds
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.model.grouped_kernels import ragged_matmul
from jaxtrain.parallel.tensor import split_experts


def test_pallas_forward_is_ragged_dot_over_the_routed_rows_whatever_the_rows_past_them_hold():
    """Three experts' rows and an empty one in a buffer of 300 rows, 228 of them routed: tiles
    straddle experts (100 and 37 are not multiples of the 128-row tile) and share their 128-row
    tile with rows past the routed ones, which hold NaN here (the kernel leaves such rows unwritten,
    so a buffer recycled from one kernel to the next holds any bits there)."""
    m, k, n = 300, 128, 256
    sizes = jnp.array([100, 0, 37, 91], jnp.int32)
    routed = int(sizes.sum())
    keys = jax.random.split(jax.random.key(0), 2)
    rows = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(keys[1], (4, k, n), jnp.float32).astype(jnp.bfloat16)
    want = np.asarray(jax.lax.ragged_dot(rows, w, sizes, preferred_element_type=jnp.float32))
    rows = rows.at[routed:].set(jnp.nan)
    out = np.asarray(ragged_matmul(rows, w, sizes, m, True), np.float32)
    # float32 accumulation both ways; the kernel rounds its output to bfloat16 (half an ulp).
    np.testing.assert_allclose(out[:routed], want[:routed], rtol=2**-8, atol=1e-2)


def test_tensor_split_experts_differentiate_through_the_kernel():
    """Experts split over `tensor` (parallel/tensor.py split_experts) run the kernel inside a shard_map; its
    gradients must type as that shard_map's inputs (jax refused the program when the planner tried
    DeepSeek-V3 with tensor 8). Traced only: the backward kernels do not run in the interpreter."""
    auto = (jax.sharding.AxisType.Auto,)  # as the step's mesh (parallel/mesh.py)
    mesh = jax.make_mesh((2,), ("tensor",), axis_types=auto, devices=jax.devices()[:2])
    rows, sizes = jnp.zeros((256, 128), jnp.bfloat16), jnp.array([200, 56], jnp.int32)
    w_in, w_out = jnp.zeros((2, 128, 2, 256), jnp.bfloat16), jnp.zeros((2, 256, 128), jnp.bfloat16)

    def loss(rows, w_in, w_out):
        return split_experts(rows, sizes, w_in, w_out, "pallas").astype(jnp.float32).sum()

    with jax.set_mesh(mesh), nn.logical_axis_rules([("mlp", "tensor")]):
        grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), rows, w_in, w_out)
    assert [g.shape for g in grads] == [rows.shape, w_in.shape, w_out.shape]
