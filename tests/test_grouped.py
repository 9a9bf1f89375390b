"""model/grouped.py's Hopper grouped matmul, run on this CPU by Pallas's Mosaic-GPU interpreter
(its TMA copies, wgmma and per-SM tile loop simulated): the routed rows as jax.lax.ragged_dot
computes them, an empty expert, padding rows out as zeros. The interpreter has no transposed
shared-memory operands, which both backward kernels use: those run only on a Hopper GPU.

    pytest tests/test_grouped.py     # seconds
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.model.grouped import ragged_matmul


def test_pallas_forward_is_ragged_dot_over_the_routed_rows_and_zero_past_them():
    """Three experts' rows and an empty one in a buffer of 300 rows, 228 of them routed: tiles
    straddle experts (100 and 37 are not multiples of the 128-row tile) and tiles past the routed
    rows are skipped, so what they would have written must come out zero."""
    m, k, n = 300, 128, 256
    sizes = jnp.array([100, 0, 37, 91], jnp.int32)
    keys = jax.random.split(jax.random.key(0), 2)
    rows = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(keys[1], (4, k, n), jnp.float32).astype(jnp.bfloat16)
    out = np.asarray(ragged_matmul(rows, w, sizes, m, True), np.float32)
    want = np.asarray(jax.lax.ragged_dot(rows, w, sizes, preferred_element_type=jnp.float32))
    routed = int(sizes.sum())
    # float32 accumulation both ways; the kernel rounds its output to bfloat16 (half an ulp).
    np.testing.assert_allclose(out[:routed], want[:routed], rtol=2**-8, atol=1e-2)
    assert not out[routed:].any()
