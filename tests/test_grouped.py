"""model/grouped.py's Hopper grouped matmul, run on this CPU by Pallas's Mosaic-GPU interpreter
(its TMA copies, wgmma and per-SM tile loop simulated): the routed rows as jax.lax.ragged_dot
computes them, an empty expert, NaN in the padding rows. The interpreter has no transposed
shared-memory operands, which the bf16 backward kernels use: those run only on a Hopper GPU. The
FP8 kernels (model/grouped_fp8.py) transpose only wgmma's operands, which `transposed_operands`
teaches the interpreter: their forward, dX and dW run here.

    pytest tests/test_grouped.py     # seconds
"""

import contextlib
import dataclasses
import functools
import socket

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.state.types import TransposeTransform

from jaxtrain.config import ConfigError, load_config
from jaxtrain.model import fp8
from jaxtrain.model.grouped_fp8 import ragged_matmul_fp8
from jaxtrain.model.grouped_kernels import ragged_matmul
from jaxtrain.model.moe import Given, Groups, Wire, routed
from jaxtrain.parallel.tensor import split_experts
from jaxtrain.run import kernels, preflight, verdicts
from jaxtrain.run.job import Job


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


@pytest.mark.parametrize("impl", ["pallas", "pallas_fp8"])
def test_tensor_split_experts_differentiate_through_the_kernel(impl):
    """Experts split over `tensor` (parallel/tensor.py split_experts) run the kernel inside a shard_map; its
    gradients must type as that shard_map's inputs (jax refused the program when the planner tried
    DeepSeek-V3 with tensor 8); so with the FP8 operands given as they travel. Traced only."""
    auto = (jax.sharding.AxisType.Auto,)  # as the step's mesh (parallel/mesh.py)
    mesh = jax.make_mesh((2,), ("tensor",), axis_types=auto, devices=jax.devices()[:2])
    rows, sizes = jnp.zeros((256, 128), jnp.bfloat16), jnp.array([200, 56], jnp.int32)
    w_in, w_out = jnp.zeros((2, 128, 2, 256), jnp.bfloat16), jnp.zeros((2, 256, 128), jnp.bfloat16)

    # pallas_fp8 as the routed block runs it: the rows and the output's gradient rounded where they
    # were sent, the weights as fsdp gathered them (model/moe.py `_routed`), whole or split as theirs
    scale, scales = jnp.float32(1), jnp.ones(2, jnp.float32)
    given = Given(
        rows=(rows.astype(fp8.FORWARD), scale),
        w_in=(w_in.astype(fp8.FORWARD), scales),
        w_out=(w_out.astype(fp8.FORWARD), scales),
        grad=(jnp.zeros((256, 128), fp8.GRADIENT), scale),
    )

    def loss(rows, w_in, w_out):
        fp8_given = given if impl == "pallas_fp8" else None
        return split_experts(rows, sizes, w_in, w_out, impl, given=fp8_given).astype(jnp.float32).sum()

    with jax.set_mesh(mesh), nn.logical_axis_rules([("mlp", "tensor")]):
        grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), rows, w_in, w_out)
    assert [g.shape for g in grads] == [rows.shape, w_in.shape, w_out.shape]


@contextlib.contextmanager
def transposed_operands():
    """Pallas's GPU interpreter with wgmma operands transposed in shared memory (`transpose_ref`):
    jax 0.10's interpreter reads only indexed operands; this reads the operand's tile and transposes
    it, as the hardware's descriptor does. The kernels' own code runs unchanged."""
    original = gpu_callbacks.wgmma

    def wgmma(**kw):  # type: ignore[no-untyped-def]
        perms = {}
        for name in ("a", "b"):
            transforms = kw[f"{name}_transforms"]
            if transforms and isinstance(transforms[-1], TransposeTransform):
                perms[name], kw[f"{name}_transforms"] = transforms[-1].permutation, transforms[:-1]
        if not perms:
            return original(**kw)
        memory = gpu_callbacks._get_shared_memory()
        keys = {
            gpu_callbacks.HostAllocationKey.from_array(kw[f"{n}_allocation_key_as_array"]): p
            for n, p in perms.items()
        }
        read = memory.get_buffer_content

        def transposed(key, *args, **kwargs):  # type: ignore[no-untyped-def]
            content = read(key, *args, **kwargs)
            return (np.transpose(content[0], keys[key]), *content[1:]) if key in keys else content

        memory.get_buffer_content = transposed
        try:
            return original(**kw)
        finally:
            del memory.get_buffer_content

    gpu_callbacks.wgmma = wgmma
    try:
        yield
    finally:
        gpu_callbacks.wgmma = original


def _same_roundings(rows, w, grad, sizes):
    """model/grouped_fp8.py's output and gradients (rows, w) multiplied by jax.lax.ragged_dot in
    float32 on the roundings it makes, written here from model/fp8.py's public rounding: rows and
    gradient zeroed past sum(sizes) and scaled as one tensor, each expert's weights by its own
    scale; forward e4m3, backward the gradient e5m2 against the e4m3 operands rounded to e5m2."""
    routed = (jnp.arange(rows.shape[0]) < sizes.sum())[:, None]

    def rounded(x, dtype, scale=None):
        scale = fp8.scale_of(x, dtype) if scale is None else scale
        return fp8.to_fp8(x, scale, dtype).astype(jnp.float32), scale

    (x4, sx), (g5, sg) = (
        rounded(jnp.where(routed, rows, 0), fp8.FORWARD),
        rounded(jnp.where(routed, grad, 0), fp8.GRADIENT),
    )
    sw = jnp.stack([fp8.scale_of(we, fp8.FORWARD) for we in w])[:, None, None]
    w4 = rounded(w, fp8.FORWARD, sw)[0]
    x5, w5 = (a.astype(fp8.GRADIENT).astype(jnp.float32) for a in (x4, w4))
    _, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x5 * sx, w5 * sw)
    return (jax.lax.ragged_dot(x4 * sx, w4 * sw, sizes), *vjp(g5 * sg))


def _relative(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


M, ROUTED, SIZES = 300, 228, jnp.array([100, 0, 37, 91], jnp.int32)  # tiles straddle experts; one is empty


def _fp8_problem():
    """rows [300, 128], w [4, 128, 256] (the experts' magnitudes 0.01 to 40: their scales differ),
    the output's gradient [300, 256]; rows past the routed 228 NaN in the rows and the gradient."""
    keys = jax.random.split(jax.random.key(0), 3)
    rows = jax.random.normal(keys[0], (M, 128), jnp.float32).astype(jnp.bfloat16)
    w = (
        jax.random.normal(keys[1], (4, 128, 256), jnp.float32)
        * jnp.array([1.0, 3.0, 0.01, 40.0])[:, None, None]
    )
    grad = jax.random.normal(keys[2], (M, 256), jnp.float32).astype(jnp.bfloat16)
    return rows.at[ROUTED:].set(jnp.nan), w.astype(jnp.bfloat16), grad.at[ROUTED:].set(jnp.nan)


def test_fp8_kernels_forward_and_both_gradients_are_the_same_roundings_multiplied_in_float32():
    """model/grouped_fp8.py's three kernels (forward, dX, dW), run in the interpreter, against
    `_same_roundings`, and the same bits from the operands given already rounded: what is
    left is the kernels' float32 accumulation and bfloat16 output (2^-9 a value; measured 1.7e-3
    of the norm). NaN past the routed rows reaches no routed row nor the
    weights' gradient; the empty expert's gradient is zero. Against the unrounded operands the
    same outputs differ by FP8's rounding (measured 4e-2 to 9e-2), over ten times more: the
    kernels did round, and by the right scales."""
    rows, w, grad = _fp8_problem()
    # The rows and the output's gradient already rounded, as the exchange delivers them (model/moe.py
    # `Wire.rows_out`), and the weights, as fsdp gathers them (one scale an expert): the kernels
    # multiply those, never `rows`, `w` and the cotangent (zeros here), and give the same bits
    routed = (jnp.arange(M) < ROUTED)[:, None]
    rounded = fp8.quantize(jnp.where(routed, rows, 0), fp8.FORWARD)
    g_rounded = fp8.quantize(jnp.where(routed, grad, 0), fp8.GRADIENT)
    w_rounded = jax.vmap(lambda we: fp8.quantize(we, fp8.FORWARD))(w)
    with transposed_operands():
        out, vjp = jax.vjp(lambda r, w: ragged_matmul_fp8(r, w, SIZES, M, True), rows, w)
        got = (out[:ROUTED], *vjp(grad))
        given = functools.partial(
            ragged_matmul_fp8, rounded=rounded, w_rounded=w_rounded, g_rounded=g_rounded
        )
        out, vjp = jax.vjp(lambda r, w: given(r, w, SIZES, M, True), 0 * rows, 0 * w)
        given = (out[:ROUTED], *vjp(0 * grad))
    for ours, theirs in zip(got, given, strict=True):
        np.testing.assert_array_equal(
            np.asarray(ours[:ROUTED], np.float32), np.asarray(theirs[:ROUTED], np.float32)
        )
    got = (got[0], got[1][:ROUTED], got[2])
    zeroed = [jnp.where((jnp.arange(M) < ROUTED)[:, None], a, 0).astype(jnp.float32) for a in (rows, grad)]
    want = _same_roundings(zeroed[0], w.astype(jnp.float32), zeroed[1], SIZES)
    _, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, SIZES), zeroed[0], w.astype(jnp.float32))
    unrounded = (jax.lax.ragged_dot(zeroed[0], w.astype(jnp.float32), SIZES), *vjp(zeroed[1]))
    assert not np.isnan(np.asarray(got[2], np.float32)).any() and not np.asarray(got[2][1], np.float32).any()
    for name, ours, same, exact in zip(("out", "d_rows", "d_w"), got, want, unrounded, strict=True):
        same, exact = (same[:ROUTED], exact[:ROUTED]) if name != "d_w" else (same, exact)
        error = _relative(ours, same)
        assert error < 4e-3 and _relative(ours, exact) > 10 * error, (name, error, _relative(ours, exact))


def test_the_preflights_fp8_reference_is_the_kernels_roundings():
    """run/preflight.py judges the FP8 kernels on a GPU against its own float32 reference
    (`fp8_rounded_grads`): it must be `_same_roundings` (written here apart), or the first GPU to
    run the kernels would fail right ones. No kernel runs: XLA on both sides."""
    rows, w, grad = _fp8_problem()
    rows, grad = (
        jnp.where((jnp.arange(M) < ROUTED)[:, None], a, 0).astype(jnp.float32) for a in (rows, grad)
    )
    theirs = preflight.fp8_rounded_grads(rows, w.astype(jnp.float32), grad, SIZES)
    ours = _same_roundings(rows, w.astype(jnp.float32), grad, SIZES)
    for a, b in zip(theirs, ours, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_pallas_fp8_is_autos_pick_beside_fp8_projections_and_falls_back_to_the_bf16_tiles():
    """`pallas_fp8` is what auto runs on Hopper beside model.matmul fp8 (it plans faster than the
    bf16 tiles there: docs/fp8.md), the bf16 tiles without FP8 projections; named without FP8
    projections, or off Hopper, it is one line. Its preflight check is the FP8 kernels' (kind
    grouped_matmul), and a failing one falls back to the same kernels on bf16 tiles next (where
    proven on the devices: run/verdicts.py)."""
    qwen3 = load_config(["--config", "configs/qwen3_30b_a3b.yaml"]).model
    assert kernels.settle(qwen3, "gpu", "bfloat16", "9.0").moe.grouped_matmul == "pallas"
    fp8_auto = dataclasses.replace(qwen3, matmul="fp8")
    assert kernels.settle(fp8_auto, "gpu", "bfloat16", "9.0").moe.grouped_matmul == "pallas_fp8"
    assert kernels.settle(fp8_auto, "gpu", "bfloat16", "8.0").moe.grouped_matmul == "ragged_dot"
    cfg = load_config(["--config", "configs/qwen3_30b_a3b.yaml", "--model.matmul", "fp8", *FP8_EXPERTS])
    settled = kernels.settle(cfg.model, "gpu", "bfloat16", "9.0")
    assert settled.moe.grouped_matmul == "pallas_fp8"
    with pytest.raises(ConfigError, match="needs Hopper GPUs"):
        kernels.settle(cfg.model, "gpu", "bfloat16", "8.0")
    bf16 = load_config(["--config", "configs/qwen3_30b_a3b.yaml", *FP8_EXPERTS]).model
    with pytest.raises(ConfigError, match="add --model.matmul fp8"):
        kernels.settle(bf16, "gpu", "bfloat16", "9.0")
    assert kernels.fallen_back(settled, "grouped_matmul").moe.grouped_matmul == "pallas"
    choices = verdicts.choices(cfg, settled, "bfloat16", "gpu")
    assert choices.grouped_matmul == "pallas_fp8"
    names = [c.name for c in preflight.checks(choices, "gpu", "9.0") if c.name.startswith("ragged")]
    assert names == ["ragged_matmul pallas_fp8 d2048 ff768 bfloat16"]
    assert verdicts.KIND_OF[names[0].split()[0]] == "grouped_matmul"


FP8_EXPERTS = ["--model.moe.grouped_matmul", "pallas_fp8"]


def test_a_failing_pallas_fp8_falls_back_to_the_bf16_tiles_where_proven_else_to_ragged_dot():
    """The job-start preflight's decision (run/verdicts.py) when the FP8 kernels' check fails on the
    GPUs, though pallas_fp8 was named (no GPU had run it when it shipped): the bf16 tiles next, where
    their own checks, run then, pass on these devices; where they do not (here a CPU, which cannot
    run them), on down the chain to ragged_dot, proven on CPU; each in one line. `pallas` named and
    failing is still refused."""
    moe = ["--config", "configs/tiny.yaml", "--model.mlp", "swiglu", "--model.moe.n_experts", "4",
           "--model.d_model", "128", "--model.n_head", "2", "--model.moe.d_expert", "128",
           "--dtype", "bfloat16"]  # fmt: skip
    job = Job.of_devices(load_config([*moe, "--model.matmul", "fp8", *FP8_EXPERTS]), jax.devices()[:1])
    on_gpu = kernels.settle(job.cfg.model, "gpu", "bfloat16", "9.0")
    failed = {"grouped_matmul": [(0, socket.gethostname())]}
    proven = []
    model, lines = verdicts._decide(job, on_gpu, failed, [], lambda m, kind: proven.append(m) or "")
    assert [m.moe.grouped_matmul for m in proven] == ["pallas"]  # proven before it runs
    assert model.moe.grouped_matmul == "pallas" and lines == [
        "preflight: the pallas_fp8 grouped matmul failed on cpu; running the pallas grouped matmul instead"
    ]
    model, lines = verdicts._decide(job, on_gpu, failed, [], verdicts._prover(job, "bfloat16", None))
    assert model.moe.grouped_matmul == "ragged_dot" and len(lines) == 1
    assert lines[0].startswith(
        "preflight: the pallas_fp8 grouped matmul failed on cpu; the pallas grouped matmul not proven here "
        "(cpu:0: ValueError: refused: model.moe.grouped_matmul pallas needs Hopper"
    ), lines
    assert lines[0].endswith("; running the ragged_dot grouped matmul instead")
    named = Job.of_devices(load_config([*moe, "--model.moe.grouped_matmul", "pallas"]), jax.devices()[:1])
    with pytest.raises(ConfigError, match="the pallas grouped matmul failed"):
        verdicts._decide(named, kernels.settle(named.cfg.model, "gpu", "bfloat16", "9.0"), failed, [])


def test_the_routed_blocks_own_fp8_backward_is_autodiffs_of_the_same_kernels():
    """model/moe.py `_routed` (remat's own backward) under pallas_fp8, run in the interpreter: the
    copies travel in e4m3, rounded where they are sent, and each copy's gradient times its gate is
    rounded to e5m2 where it lands, both by scales from every sender's copies. One piece on one
    device, where those scales are the kernels' own: the output and the gradients of the rows and
    both expert matrices are jax's autodiff of the same kernels (`routed(False)`: the kernels round
    by their own maxima), bitwise; the gates' within bf16's rounding of autodiff's sum."""
    # d 256: a kernel of one 128 x 128 tile crashes XLA:CPU's compile of the interpreter (a remainder
    # by zero folded in LLVM, jax 0.10.2), which no GPU program has
    n, d, ff = 256, 256, 128
    keys = jax.random.split(jax.random.key(7), 5)
    rows = jax.random.normal(keys[0], (n, d), jnp.float32).astype(jnp.bfloat16)
    gates = jax.random.uniform(keys[1], (n,), jnp.float32, 0.05, 1.0).astype(jnp.bfloat16)
    w_in = (0.1 * jax.random.normal(keys[2], (2, d, 2, ff), jnp.float32)).astype(jnp.bfloat16)
    w_out = (0.1 * jax.random.normal(keys[3], (2, ff, d), jnp.float32)).astype(jnp.bfloat16)
    ct = jax.random.normal(keys[4], (n, d), jnp.float32)
    plans = (Groups(jnp.array([100, 156], jnp.int32)),)
    wire = Wire("pallas_fp8", n, interpret=True)

    def loss(recomputed, r, g, a, b):
        (y,) = routed(recomputed)(wire, (r,), (g,), a, b, plans, None)
        return jnp.sum(y.astype(jnp.float32) * ct), y

    with transposed_operands():
        got = [
            jax.value_and_grad(functools.partial(loss, remat), (0, 1, 2, 3), has_aux=True)(
                rows, gates, w_in, w_out
            )
            for remat in (True, False)
        ]
    (_, ours), our_grads = got[0]
    (_, theirs), their_grads = got[1]
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(theirs, np.float32))
    for name, a, b in zip(("rows", "gates", "w_in", "w_out"), our_grads, their_grads, strict=True):
        assert np.isfinite(np.asarray(a, np.float32)).all() and np.asarray(a, np.float32).any(), name
        if name != "gates":
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
    # The gates' gradient <out, dy>: summed in float32 by `_routed`'s backward, from bf16 products by
    # autodiff's (measured 8e-3 of the norm), as before FP8
    assert _relative(our_grads[1], their_grads[1]) < 2e-2
