"""FP8 matmuls (model.matmul fp8, jaxtrain/model/fp8.py): the dot rounds its operands to e4m3 and the
gradient to e5m2 by power-of-two scales; a short run trains as bf16 does; a non-finite tensor is a
skipped step; checkpoints are the same tree either way, and an FP8 run resumes bitwise (and in
bf16); fsdp gathers the projections' weights as FP8, rounded by the whole weight's scale (bitwise
the one-device rounding), and a dot handed the gathered e4m3 weight, or the pipeline's weights
rounded once a step, computes what the dot rounding them itself does, bitwise; on 8 devices split
over context, fsdp and tensor an FP8 run trains as on one device (the GPU program:
tests/test_gpu_compile.py).

    pytest tests/test_fp8.py
"""

import dataclasses
import functools
import json
import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain.config import ConfigError, load_config
from jaxtrain.disk.checkpoint import Checkpointer
from jaxtrain.model import fp8
from jaxtrain.model.layers import Fp8Dot, dense
from jaxtrain.model.params import path_names
from jaxtrain.model.transformer import GPT
from jaxtrain.observe import gemms, peaks
from jaxtrain.parallel import fsdp, pipeline
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.run.build import build
from jaxtrain.run.job import Job

# tests/shared.py's tiny Llama in bfloat16, untied head (so the head's own matmul is tested), clipping
# on (the global norm must agree across layouts).
LLAMA = [
    "--config", "configs/tiny.yaml", "--optim.warmup_steps", "0", "--model.n_head", "4",
    "--model.mlp", "swiglu", "--model.n_kv_head", "2", "--batch_size", "8", "--dtype", "bfloat16",
    "--model.tie_embeddings", "false", "--gradient_clip_val", "0.5",
]  # fmt: skip
FP8 = ("--model.matmul", "fp8", "--model.head_matmul", "fp8")
STEPS = 4
DIMS = (((2,), (0,)), ((), ()))  # [B, T, d] x [d, f]


@functools.cache
def _build(argv: tuple[str, ...], devices: int):
    return build(Job.of_devices(load_config([*LLAMA, *argv]), jax.devices()[:devices]))


@functools.cache
def _train(argv: tuple[str, ...], devices: int) -> tuple[np.ndarray, dict]:
    """STEPS steps on one batch: the losses and the final params."""
    run = _build(argv, devices)
    state = run.init_state()
    rows = np.random.default_rng(0).integers(3, 256, (8, run.cfg.model.seq_len + 1), dtype=np.int32)
    losses = []
    for _ in range(STEPS):
        state, metrics = run.train_step(state, mesh_lib.global_batch(rows, run.mesh, 8))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state.params)


def _operands() -> tuple[jax.Array, jax.Array]:
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (2, 16, 64), jnp.float32).astype(jnp.bfloat16)
    return x, (0.02 * jax.random.normal(kw, (64, 32), jnp.float32)).astype(jnp.bfloat16)


def _rounded(a: jax.Array, dtype) -> jax.Array:
    """a as the FP8 dot sees it: divided by its power-of-two scale, rounded, multiplied back."""
    mantissa, e = np.frexp(float(jnp.abs(a.astype(jnp.float32)).max()) / float(jnp.finfo(dtype).max))
    scale = 2.0 ** (e - 1 if mantissa == 0.5 else e)  # the power of two at or above max|a| / largest
    return ((a.astype(jnp.float32) / scale).astype(dtype).astype(jnp.float32) * scale).astype(a.dtype)


def test_the_dot_multiplies_fp8_operands_and_fp8_gradients():
    x, w = _operands()
    loss = lambda dot, x, w: (dot(x, w, DIMS).astype(jnp.float32) ** 2).sum()  # noqa: E731
    y = jax.jit(fp8.fp8_dot_general, static_argnums=2)(x, w, DIMS)  # jitted, as the step runs it
    # The forward is the bf16 dot of the e4m3-rounded operands, exactly (the scales are powers of 2).
    np.testing.assert_array_equal(
        y, jax.lax.dot_general(_rounded(x, fp8.FORWARD), _rounded(w, fp8.FORWARD), DIMS)
    )
    assert not np.array_equal(y, jax.lax.dot_general(x, w, DIMS))
    # The backward: the e5m2-rounded incoming gradient against the e4m3-rounded operands.
    g = jax.grad(lambda y: (y.astype(jnp.float32) ** 2).sum())(y)
    xq, wq, gq = _rounded(x, fp8.FORWARD), _rounded(w, fp8.FORWARD), _rounded(g, fp8.GRADIENT)
    grads = jax.jit(jax.grad(functools.partial(loss, fp8.fp8_dot_general), (0, 1)))
    dx, dw = grads(x, w)
    np.testing.assert_array_equal(dx, jax.lax.dot_general(gq, wq, (((2,), (1,)), ((), ()))))
    np.testing.assert_array_equal(dw, jnp.einsum("btd,btf->df", xq, gq))
    # Within FP8's rounding of the bf16 dot's gradients (3 and 2 mantissa bits).
    for a, b in zip(
        (dx, dw), jax.grad(functools.partial(loss, jax.lax.dot_general), (0, 1))(x, w), strict=True
    ):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert 0 < np.abs(a - b).max() < 0.2 * np.abs(b).max()
    hlo = grads.lower(x, w).as_text()
    assert "f8E4M3FN" in hlo and "f8E5M2" in hlo


def _halves(a: jax.Array, dtype) -> jax.Array:
    """a's last axis cut in two, each half rounded by its own scale (`_rounded`)."""
    half = a.shape[-1] // 2
    return jnp.concatenate([_rounded(a[..., :half], dtype), _rounded(a[..., half:], dtype)], axis=-1)


def test_a_dot_split_over_tensor_scales_each_devices_block_by_its_own_max():
    """fp8.tensor_blocks: a row-parallel dot (tensor cuts the contracted dim) scales x one block a
    device, a column-parallel one (tensor cuts the kernel's output dim) the output's gradient, so no
    device needs another's max (an all-reduce over tensor in the step). By hand: each block is
    rounded by its own power-of-two scale, and the dots are the bf16 dots of the blocks' roundings.
    One half of each holds values far larger than the other's, so the blocks' scales differ."""
    x, w = _operands()
    x = x.at[..., 32:].multiply(2.0**12)  # [2, 16, 64]: the contracted dim, cut in two
    split = frozenset({"heads", "mlp"})
    assert fp8.tensor_blocks(("mlp", "embed"), DIMS, x.shape, w.shape, split, 2) == ((2, 2), fp8.WHOLE)
    assert fp8.tensor_blocks(("embed", "mlp"), DIMS, x.shape, w.shape, split, 2) == (fp8.WHOLE, (2, 2))
    assert fp8.tensor_blocks(("embed", "mlp"), DIMS, x.shape, w.shape, split, 1) == (fp8.WHOLE, fp8.WHOLE)
    assert fp8.tensor_blocks(("embed", "mlp"), DIMS, x.shape, w.shape, split, 3) == (fp8.WHOLE, fp8.WHOLE)
    blocks = ((2, 2), (2, 2))  # both at once: each rule checked against its own rounding
    y = jax.jit(functools.partial(fp8.fp8_dot_general, dimension_numbers=DIMS, blocks=blocks))(x, w)
    xq, wq = _halves(x, fp8.FORWARD), _rounded(w, fp8.FORWARD)
    np.testing.assert_array_equal(y, jax.lax.dot_general(xq, wq, DIMS))
    g = (jax.random.normal(jax.random.key(2), y.shape) * jnp.where(jnp.arange(32) < 16, 1, 2.0**-24)).astype(
        y.dtype
    )
    _, vjp = jax.vjp(lambda x, w: fp8.fp8_dot_general(x, w, DIMS, blocks=blocks), x, w)
    dx, dw = vjp(g)
    gq = _halves(g, fp8.GRADIENT)
    np.testing.assert_array_equal(dx, jax.lax.dot_general(gq, wq, (((2,), (1,)), ((), ()))))
    np.testing.assert_array_equal(dw, jnp.einsum("btd,btf->df", xq, gq))
    # One scale for the whole tensor rounds differently: the smaller half's values fall below the
    # format's range under the larger half's scale (e4m3 spans 18 octaves, e5m2 32).
    assert not np.array_equal(xq, _rounded(x, fp8.FORWARD))
    assert not np.array_equal(gq, _rounded(g, fp8.GRADIENT))
    # A non-finite value makes its block's scale non-finite, and so the output (a skipped step).
    bad = fp8.fp8_dot_general(x.at[0, 0, 40].set(jnp.inf), w, DIMS, blocks=blocks)
    assert not np.isfinite(np.asarray(bad, np.float32)).all()


def test_zeros_stay_zeros_and_a_non_finite_tensor_is_non_finite():
    x, w = _operands()
    assert float(fp8.scale_of(jnp.zeros(3), fp8.FORWARD)) == 2.0**-8  # max|x| taken as 1: 1 / 448 < 2^-8
    np.testing.assert_array_equal(fp8.fp8_dot_general(jnp.zeros_like(x), w, DIMS), 0)
    for bad in (jnp.inf, jnp.nan):
        xb = x.at[0, 0, 0].set(bad)
        assert not np.isfinite(float(fp8.scale_of(xb, fp8.FORWARD)))
        assert not np.isfinite(np.asarray(fp8.fp8_dot_general(xb, w, DIMS), np.float32)).all()
        grads = jax.grad(lambda x, w: fp8.fp8_dot_general(x, w, DIMS).astype(jnp.float32).sum(), (0, 1))(
            xb, w
        )
        assert not np.isfinite(np.asarray(grads[1], np.float32)).all()


def _maxima(jaxpr) -> int:
    """How many reduce_max a jaxpr runs, its inner jaxprs' (remat's, custom_vjp's) included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "reduce_max"
        for value in eqn.params.values():
            for inner in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(inner, "jaxpr", inner)
                n += _maxima(inner) if hasattr(inner, "eqns") else 0
    return n


def test_remat_keeps_the_activations_fp8_scales_for_the_backward():
    """Under remat (model/transformer.py, mlp.py, parallel/pipeline.py: `fp8.saving_scales`) the
    recomputed forward rounds the activation by its saved scale, not by its max again: a max that is
    an all-reduce where tensor splits the activation (Llama 3 70B on 128 x 8: 2 a layer, docs/fp8.md).
    By hand: the forward takes max|x| and max|w|, the recompute max|w| (the weight's own rounding) and
    not max|x|, the backward max|g|: 4, where remat saving nothing takes 5. The same gradients, bitwise."""
    x, w = _operands()

    def loss(x, w):
        return fp8.fp8_dot_general(x, w, DIMS).astype(jnp.float32).sum()

    grads = {}
    for policy, maxima in ((None, 5), (fp8.saving_scales("fp8"), 4)):
        grad = jax.grad(jax.checkpoint(loss, policy=policy), (0, 1))
        assert _maxima(jax.make_jaxpr(grad)(x, w).jaxpr) == maxima
        grads[maxima] = grad(x, w)
    for a, b in zip(grads[4], grads[5], strict=True):
        np.testing.assert_array_equal(a, b)
    assert fp8.saving_scales("compute") is None  # bf16 matmuls: remat as before


def test_rounding_a_rounded_tensor_again_changes_nothing():
    """What fsdp's FP8 gathers rely on (parallel/fsdp.py): the dot rounds the gathered, already
    rounded weight again, and must get the same values. Edge cases: a max landing exactly on the
    format's largest value (448 s) and on half of it (224 s), beside e4m3's smallest subnormals
    (2^-9 s, 3 x 2^-9 s: halving them would not be exact)."""
    s = 2.0**-7
    for top in (447.0 * s, 448.0 * s, 224.0 * s, 230.0 * s, 300.0 * s):
        x = jnp.array([top, -(2.0**-9) * s, 3 * 2.0**-9 * s, 0.01 * s, 17.3 * s], jnp.bfloat16)
        once = fp8.dequantize(*fp8.quantize(x, fp8.FORWARD), jnp.bfloat16)
        np.testing.assert_array_equal(fp8.dequantize(*fp8.quantize(once, fp8.FORWARD), jnp.bfloat16), once)
    # At, not above: a max of exactly 448 s is scale s (the strict rule gave 2 s).
    assert float(fp8.scale_of(jnp.array([448.0 * s]), fp8.FORWARD)) == s


def test_fsdp_gathers_a_projection_as_fp8_by_the_whole_weights_scale():
    """fsdp.gather_quantized with fp8_over (model.matmul fp8): the gather moves e4m3, and the gathered
    weight is the one-device FP8 rounding of the whole weight, bitwise, though each shard's own
    max would give it another scale; the gradient is reduce-scattered as without FP8."""
    mesh = jax.make_mesh((8,), (mesh_lib.FSDP_AXIS,), devices=jax.devices()[:8])
    w = (0.02 * jax.random.normal(jax.random.key(1), (64, 32), jnp.float32)).at[3, 5].set(0.5)
    w = jax.device_put(w, jax.sharding.NamedSharding(mesh, P(mesh_lib.FSDP_AXIS)))
    c = jax.random.normal(jax.random.key(2), (64, 32), jnp.float32)

    def loss(w: jax.Array, over: tuple[str, ...]) -> jax.Array:
        def per_device(shard: jax.Array) -> jax.Array:
            whole = fsdp.gather_quantized(shard, mesh_lib.FSDP_AXIS, 0, jnp.bfloat16, jnp.float32, over)[0]
            return whole, jax.lax.psum((whole.astype(jnp.float32) * c).sum(), mesh_lib.FSDP_AXIS)

        return jax.shard_map(
            per_device, mesh=mesh, in_specs=P(mesh_lib.FSDP_AXIS), out_specs=(P(), P()), check_vma=False
        )(w)

    gathered = jax.jit(loss, static_argnums=1)
    whole, _ = gathered(w, (mesh_lib.FSDP_AXIS,))
    np.testing.assert_array_equal(
        whole, fp8.dequantize(*fp8.quantize(w.astype(jnp.bfloat16), fp8.FORWARD), jnp.bfloat16)
    )
    assert not np.array_equal(whole, w.astype(jnp.bfloat16))
    text = gathered.lower(w, (mesh_lib.FSDP_AXIS,)).as_text()
    assert re.search(r"all_gather.*tensor<8x32xf8E4M3FN>\) -> tensor<64x32xf8E4M3FN>", text), text
    grads = [jax.jit(jax.grad(lambda w, o: loss(w, o)[1]), static_argnums=1)(w, o) for o in ((), ("fsdp",))]
    np.testing.assert_array_equal(*grads)
    assert np.abs(np.asarray(grads[0])).min() > 0


def test_a_scanned_stack_hands_its_layers_the_whole_weights_fp8_scales():
    """fsdp.Fsdp.with_scales (a scanned stack's hook under model.matmul fp8): each layer's scale
    from one all-reduce of every layer's max, before the layers run; a layer's gather by it gives
    what the gather computing its own scale gives, bitwise: the one-device rounding."""
    mesh = jax.make_mesh((1, 1, 1, 8, 1, 1), mesh_lib.MESH_AXES, devices=jax.devices()[:8])
    spec = P(None, mesh_lib.FSDP_AXIS, None)  # [layers, embed, mlp]: embed split over fsdp
    layers = fsdp.Fsdp({"params": {"mlp": {"fc": {"kernel": spec}}}}, jnp.bfloat16, jnp.float32, False)
    w = 0.02 * jax.random.normal(jax.random.key(3), (3, 64, 32), jnp.float32)
    w = w.at[1, 60, 2].set(0.7).at[2].multiply(0.1)  # layer 1's max on one shard only
    w = jax.device_put(w, jax.sharding.NamedSharding(mesh, spec))

    def per_device(stack: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        scaled = layers.with_scales({"params": {"mlp": {"fc": {"kernel": stack}}}})["params"]["mlp"]["fc"]
        given = [
            layers.gather_fp8(
                {"params": {"mlp": {"fc": {"kernel": stack[i], fsdp.SCALE: scaled[fsdp.SCALE][i]}}}}
            )
            for i in range(3)
        ]
        own = [layers.gather_fp8({"params": {"mlp": {"fc": {"kernel": stack[i]}}}}) for i in range(3)]
        pick = lambda vs: jnp.stack([v["params"]["mlp"]["fc"]["kernel"] for v in vs])  # noqa: E731
        return pick(given), pick(own), scaled[fsdp.SCALE]

    run = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=spec,
            out_specs=P(),
            axis_names={mesh_lib.FSDP_AXIS},
            check_vma=False,
        )
    )
    given, own, scales = run(w)
    np.testing.assert_array_equal(given, own)
    for i in range(3):
        whole = fp8.dequantize(*fp8.quantize(w[i].astype(jnp.bfloat16), fp8.FORWARD), jnp.bfloat16)
        np.testing.assert_array_equal(given[i], whole)
        assert float(scales[i]) == float(fp8.scale_of(w[i].astype(jnp.bfloat16), fp8.FORWARD))
    assert len(set(np.asarray(scales).tolist())) == 3  # three layers, three scales
    # One all-reduce for the three layers' scales in the stack's hook (the own-scale gathers: 3 more).
    assert run.lower(w).as_text().count("all_reduce") == 4


def test_fsdp_gathers_fp8_experts_weights_by_each_experts_scale():
    """Under model.moe.grouped_matmul pallas_fp8 (`Fsdp.gather_fp8_experts`, the stack's hook
    `experts_and_their_scales`): a routed experts' stack is gathered as e4m3, each expert rounded by
    its own whole weight's scale (the max over its fsdp shards: one expert's max sits on one shard
    here, and the experts' magnitudes differ 40 times), bitwise what the gather computing its own
    scales gives; the e4m3 values and scales [E] beside the kernel, which is their product; the
    gather moves e4m3. Without pallas_fp8 (`gather_fp8`) the experts are gathered as bf16."""
    mesh = jax.make_mesh((1, 1, 1, 8, 1, 1), mesh_lib.MESH_AXES, devices=jax.devices()[:8])
    spec = P(None, None, None, mesh_lib.FSDP_AXIS)  # [layers, expert, mlp, embed]: embed over fsdp
    layers = fsdp.Fsdp({"params": {"moe": {"out": {"kernel": spec}}}}, jnp.bfloat16, jnp.float32, False)
    w = 0.02 * jax.random.normal(jax.random.key(4), (2, 4, 16, 64), jnp.float32)
    w = w.at[0, 2, 3, 60].set(0.9).at[1, 1].multiply(40.0)
    w = jax.device_put(w, jax.sharding.NamedSharding(mesh, spec))
    out = lambda v: v["params"]["moe"]["out"]  # noqa: E731
    stacked = lambda x: {"params": {"moe": {"out": x}}}  # noqa: E731

    def per_device(stack: jax.Array) -> tuple[jax.Array, ...]:
        scales = out(layers.experts_and_their_scales(stacked({"kernel": stack})))[fsdp.SCALE]
        given = [
            out(layers.gather_fp8_experts(stacked({"kernel": stack[i], fsdp.SCALE: scales[i]})))
            for i in range(2)
        ]
        own = [out(layers.gather_fp8_experts(stacked({"kernel": stack[i]}))) for i in range(2)]
        bf16 = out(layers.gather_fp8(stacked({"kernel": stack[0]})))
        pick = lambda vs, name: jnp.stack([v[name] for v in vs])  # noqa: E731
        return (
            pick(given, "kernel"), pick(given, fp8.QUANTIZED), pick(given, fsdp.SCALE),
            pick(own, fp8.QUANTIZED), pick(own, fsdp.SCALE), jnp.float32(fp8.QUANTIZED in bf16),
        )  # fmt: skip

    run = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=spec,
            out_specs=P(),
            axis_names={mesh_lib.FSDP_AXIS},
            check_vma=False,
        )
    )
    kernel, quantized, scales, own_quantized, own_scales, bf16_has = run(w)
    assert quantized.dtype == fp8.FORWARD and scales.shape == (2, 4) and not bf16_has
    np.testing.assert_array_equal(quantized.astype(jnp.float32), own_quantized.astype(jnp.float32))
    np.testing.assert_array_equal(scales, own_scales)
    for i in range(2):
        for e in range(4):
            whole = w[i, e].astype(jnp.bfloat16)
            assert float(scales[i, e]) == float(fp8.scale_of(whole, fp8.FORWARD)), (i, e)
            np.testing.assert_array_equal(
                kernel[i, e], fp8.dequantize(*fp8.quantize(whole, fp8.FORWARD), jnp.bfloat16)
            )
    assert len(set(np.asarray(scales).ravel().tolist())) > 2  # the experts' own scales, not one
    text = run.lower(w).as_text()
    assert re.search(r"all_gather.*tensor<4x16x8xf8E4M3FN>\) -> tensor<4x16x64xf8E4M3FN>", text), text


def _dense_dots(argv: list[str]) -> tuple[dict, set]:
    """The model of `argv` under model.matmul fp8, initialised: {each dense's kernel path (its last 3
    names): whether its dot is the FP8 one}, and every param's path."""
    cfg = load_config([*argv, "--dtype", "bfloat16", "--model.matmul", "fp8"])
    dots: dict[tuple[str, ...], bool] = {}

    def record(call, args, kwargs, context):
        module = context.module
        if isinstance(module, nn.DenseGeneral) and context.method_name == "__call__":
            dots[(*module.path, "kernel")[-3:]] = module.dot_general_cls is Fp8Dot
        return call(*args, **kwargs)

    tokens = jnp.zeros((1, cfg.model.seq_len), jnp.int32)
    with nn.intercept_methods(record):
        params = jax.eval_shape(GPT(cfg.model, jnp.bfloat16).init, jax.random.key(0), tokens)["params"]
    return dots, {path_names(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)}


def test_fp8_gathers_are_the_projections_that_multiply_in_fp8():
    """fp8.projection (what fsdp gathers as FP8) names exactly the kernels whose dense multiplies
    in FP8: attention's (q and kv, GPT's qkv), MLA's, the MLPs' and a mixture's shared experts'; not
    the router, the shared experts' gate, the routed experts or the head."""
    for argv in (LLAMA, ["--config", "configs/tiny.yaml"], ["--config", "configs/deepseek_tiny.yaml"]):
        dots, paths = _dense_dots(argv)
        kernels = {k[-3:]: fp8.projection(k) for k in paths if k[-1] == "kernel"}
        assert set(dots) <= set(kernels) and any(dots.values()), (dots, kernels)
        assert kernels == {k: dots.get(k, False) for k in kernels}, dots  # the routed experts: no dense
    assert not all(kernels.values()) and not all(dots.values()), kernels  # deepseek_tiny's router


def test_fp8_needs_bfloat16_in_one_line():
    with pytest.raises(
        ConfigError, match=r"model.matmul fp8 runs its matmuls from bfloat16 .* add --dtype bfloat16"
    ):
        load_config([*LLAMA, "--dtype", "float32", "--model.matmul", "fp8"])
    with pytest.raises(ConfigError, match=r"'model.head_matmul' must be one of compute\|fp8"):
        load_config([*LLAMA, "--model.head_matmul", "e4m3"])


def test_a_short_fp8_run_trains_as_bf16_on_the_same_checkpoint_tree():
    bf16_losses, bf16_params = _train((), 1)
    losses, params = _train(FP8, 1)
    assert losses[-1] < losses[0] - 0.5
    # Measured: 4 steps, bf16 4.67 and fp8 4.67 (rounded differently: not the same run).
    np.testing.assert_allclose(losses, bf16_losses, rtol=2e-3)
    assert not np.array_equal(losses, bf16_losses)
    # Master weights stay float32 and the state is the same tree: a checkpoint of either restores
    # into the other (nothing of the scaling is saved).
    assert jax.tree.structure(params) == jax.tree.structure(bf16_params)
    assert all(
        a.dtype == np.float32 and a.shape == b.shape
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(bf16_params), strict=True)
    )
    fp8, bf16 = _build(FP8, 1), _build((), 1)
    assert fp8.abstract == bf16.abstract
    # MFU is against the peak of the dtype that runs (run/loop.py): FP8's on an H100, not bf16's.
    h100 = "NVIDIA H100 80GB HBM3"
    assert (peaks.peak_flops(h100, fp8.mfu_dtype), peaks.peak_flops(h100, bf16.mfu_dtype)) == (
        1978.9e12,
        989.4e12,
    )


def test_a_non_finite_fp8_tensor_is_a_skipped_step():
    run = _build(FP8, 1)
    state = run.init_state()
    # One weight of the first MLP's down projection made infinite: its scale is infinite, its
    # FP8 operand NaN, and so the loss and every gradient.
    params = jax.tree.map(lambda a: a, state.params)  # new dicts, the same arrays
    out = params["block_0"]["mlp"]["out"]
    out["kernel"] = out["kernel"].at[0, 0].set(jnp.inf)
    state = dataclasses.replace(state, params=params)
    rows = np.random.default_rng(0).integers(3, 256, (8, run.cfg.model.seq_len + 1), dtype=np.int32)
    before = jax.device_get((state.params, state.opt_state))
    state, metrics = run.train_step(state, mesh_lib.global_batch(rows, run.mesh, 8))
    assert not bool(metrics["finite"]) and int(metrics["skipped_steps"]) == 1
    after = jax.device_get((state.params, state.opt_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)


def test_fp8_split_over_context_fsdp_and_tensor_trains_as_on_one_device():
    one_losses, one_params = _train(FP8, 1)
    losses, params = _train(
        (*FP8, "--mesh.context", "2", "--mesh.fsdp", "2", "--mesh.tensor", "2", "--mesh.data", "1"), 8
    )
    # Measured (4 steps): losses within 2.3e-4 of one device's and params within 0.020, where bf16
    # matmuls on the same layouts gave 3.6e-5 and 0.012 (bf16's sums in another order, rounded
    # again by FP8 where a tensor's max lands on the other side of a power of two; and tensor's
    # halves of the output projections' inputs and of q's, kv's and gate_up's gradients each scaled
    # by its own max, fp8.tensor_blocks: 9.7e-5 and 0.016 with one scale a tensor).
    np.testing.assert_allclose(losses, one_losses, rtol=3e-4)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=0.03)


def test_fp8_split_over_pipeline_fsdp_and_tensor_trains_as_on_one_device():
    """4 scanned layers over 2 stages x fsdp 2 x tensor 2 in 4 microbatches, against one device
    accumulating the same 4. Measured (4 steps): losses within 1.5e-3 of one device's and params
    within 0.021, where bf16 matmuls gave 1.1e-4 and 0.012: a microbatch is one row a batch shard
    here, and each shard scales its activations and gradients by its own maximum (docs/fp8.md), so
    shards' maxima straddle a power of two more often than whole microbatches' do."""
    stack = ("--model.scan_layers", "true", "--model.n_layer", "4", "--gradient_accumulation_steps", "4")
    layers = (*FP8, *stack)
    one_losses, one_params = _train(layers, 1)
    mesh = ("--mesh.pipeline", "2", "--mesh.fsdp", "2", "--mesh.tensor", "2", "--mesh.data", "1")
    losses, params = _train((*layers, *mesh), 8)
    np.testing.assert_allclose(losses, one_losses, rtol=3e-3)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=0.03)


def test_an_fp8_checkpoint_resumes_bitwise_and_in_bf16(tmp_path):
    """Stop after 2 of STEPS steps, save, restore, go on: the same run to the bit (the scales are
    computed again from the restored state: nothing of them is saved); and bf16 takes the same
    checkpoint."""
    run, whole_losses, whole_params = _build(FP8, 1), *_train(FP8, 1)
    rows = np.random.default_rng(0).integers(3, 256, (8, run.cfg.model.seq_len + 1), dtype=np.int32)
    batch = mesh_lib.global_batch(rows, run.mesh, 8)
    state = run.init_state()
    for _ in range(2):
        state, _ = run.train_step(state, batch)
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    ckpt.save(2, state, {"step": 2, "config": {}})
    ckpt.wait()
    reader = Checkpointer(tmp_path / "ckpt", keep=2, read_only=True)
    state, losses = reader.restore(2, run.target), []
    for _ in range(STEPS - 2):
        state, metrics = run.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses == list(whole_losses[2:])
    for a, b in zip(
        jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(whole_params), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    bf16 = _build((), 1)
    _, metrics = bf16.train_step(reader.restore(2, bf16.target), batch)
    assert bool(metrics["finite"]) and float(metrics["loss"]) < whole_losses[0]
    ckpt.close()


def test_a_gathered_fp8_weight_is_multiplied_as_it_is_bitwise():
    """fsdp's FP8 gather hands the dense its e4m3 array and scale (fp8.QUANTIZED, fp8.SCALE beside the
    kernel): the dot multiplies them as they are, with neither the weight's max nor its rounding
    again, and the output and both gradients are those of the dot rounding the gathered weight
    itself, bitwise (what every FP8 run over fsdp computed before)."""
    mesh = jax.make_mesh((8,), (mesh_lib.FSDP_AXIS,), devices=jax.devices()[:8])
    w = (0.02 * jax.random.normal(jax.random.key(4), (64, 32), jnp.float32)).at[9, 1].set(0.3)
    w = jax.device_put(w, jax.sharding.NamedSharding(mesh, P(mesh_lib.FSDP_AXIS)))
    x, _ = _operands()
    c = jax.random.normal(jax.random.key(5), (2, 16, 32), jnp.float32)
    layer = dense(32, 0.02, jnp.bfloat16, "fc", matmul="fp8")

    def loss(w: jax.Array, x: jax.Array, given: bool) -> jax.Array:
        def per_device(shard: jax.Array, x: jax.Array) -> jax.Array:
            whole, quantized, scale = fsdp.gather_quantized(
                shard, mesh_lib.FSDP_AXIS, 0, jnp.bfloat16, jnp.float32, (mesh_lib.FSDP_AXIS,)
            )
            params = {"kernel": whole, **({fp8.QUANTIZED: quantized, fp8.SCALE: scale} if given else {})}
            return (layer.apply({"params": params}, x).astype(jnp.float32) * c).sum()

        return jax.shard_map(
            per_device, mesh=mesh, in_specs=(P(mesh_lib.FSDP_AXIS), P()), out_specs=P(), check_vma=False
        )(w, x)

    grads = jax.jit(jax.value_and_grad(loss, (0, 1)), static_argnums=2)
    (own, (dw_own, dx_own)), (value, (dw, dx)) = grads(w, x, False), grads(w, x, True)
    assert float(value) == float(own)
    np.testing.assert_array_equal(dw, dw_own)
    np.testing.assert_array_equal(dx, dx_own)
    # The compiled programs: the dot rounding the gathered weight itself takes its max (a reduce)
    # and writes it again as e4m3; handed the gathered e4m3 array, neither.
    texts = [grads.lower(w, x, g).compile().as_text() for g in (False, True)]
    maxima = [text.count("maximum(") for text in texts]
    rounded = [len(re.findall(r"= f8e4m3fn\[64,32\]\S* (?:convert|fusion)", text)) for text in texts]
    assert maxima[1] < maxima[0] and rounded[1] < rounded[0], (maxima, rounded)


def test_the_pipelines_stage_multiplies_its_weights_rounded_once_a_step():
    """parallel/pipeline.py under model.matmul fp8: the stage's projections rounded to e4m3 once for
    all ticks (`_casts`), which the ticks' dots multiply as they are: the output and the float32
    master's gradient are those of the dots rounding the weights themselves, bitwise."""
    cfg = load_config([*LLAMA, *FP8, "--model.scan_layers", "true", "--model.n_layer", "1"]).model
    model = GPT(cfg, jnp.bfloat16)
    x = jax.random.normal(jax.random.key(6), (2, cfg.seq_len, cfg.d_model), jnp.float32).astype(jnp.bfloat16)
    stack = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]["blocks"]
    specs = jax.tree.map(lambda _: P(mesh_lib.PIPELINE_AXIS), stack)  # each stage's own layers
    run = pipeline._stage(model)

    def loss(stack: dict, once: bool) -> jax.Array:
        casts, rounded = pipeline._casts(model, "blocks", stack, specs)
        assert len([q for q in jax.tree.leaves(rounded, is_leaf=pipeline._is_layers) if q]) == 5
        if not once:
            rounded = jax.tree.map(lambda _: None, rounded, is_leaf=pipeline._is_layers)
        return run(pipeline._layers(stack, (casts, rounded)), x, None)[0].astype(jnp.float32).sum()

    grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (own, own_grads), (value, once_grads) = grads(stack, False), grads(stack, True)
    assert float(value) == float(own)
    for a, b in zip(jax.tree.leaves(once_grads), jax.tree.leaves(own_grads), strict=True):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, b)
    assert np.abs(np.asarray(once_grads["mlp"]["out"]["kernel"])).max() > 0


# Three GEMMs of an H100 program (tests/gpu_gemms.py's llama_tiny, trimmed): an FP8 projection that is
# cuBLASLt's FP8 GEMM, one XLA left as a bf16 cuBLAS GEMM (as it does without jaxtrain's FP8
# options), and the bf16 head's.
_CALL = "  %{} = (bf16[64,64]{{1,0}}, s8[0]{{0}}) custom-call({}), " + 'custom_call_target="{}", '
_CALL += 'metadata={{op_name="jit(train_step)/jvp(GPT)/{}"}}'
H100_GEMMS = "\n".join([
    "ENTRY %main (x: f8e4m3fn[64,128], w: f8e4m3fn[128,64]) -> bf16[64,64] {",
    "  %x = f8e4m3fn[64,128]{1,0} parameter(0)",
    "  %w = f8e4m3fn[128,64]{1,0} parameter(1)",
    _CALL.format("g", "%x, %w", "__cublas$lt$matmul$f8", "mlp/out/Fp8Dot_0/fp8_dot/dot"),
    "  %xb = bf16[64,128]{1,0} fusion(%x), kind=kLoop, calls=%dequantize",
    _CALL.format("h", "%xb, %xb", "__cublas$lt$matmul", "attn/q/Fp8Dot_0/fp8_dot/dot"),
    _CALL.format("head", "%xb, %xb", "__cublas$gemm", "lm_head/dot_general"),
    "}",
])  # fmt: skip


def test_the_gemm_census_counts_fp8_gemms_and_refuses_only_a_gpus_projections_left_in_bf16():
    """observe/gemms.py, the check an FP8 job's step passes where it starts (run/build.py
    compile_train): on a CPU the FP8 dot's three GEMMs are XLA's dots over the rounded operands (the
    emulation, never refused); on a GPU a projection that is not an FP8 GEMM is refused in one line
    naming how many and which."""
    x, w = _operands()
    dot = functools.partial(fp8.fp8_dot_general, dimension_numbers=(((2,), (0,)), ((), ())))

    def forward_and_back(x: jax.Array, w: jax.Array, dy: jax.Array) -> tuple[jax.Array, ...]:
        y, vjp = jax.vjp(dot, x, w)
        return (y, *vjp(dy))  # the forward's GEMM and the backward's two

    found = gemms.census(jax.jit(forward_and_back).lower(x, w, x[..., :32]).compile().as_text())
    assert gemms.counts(found) == {"fp8": 0, "cublas": 0, "other": 3, "asked_fp8": 3, "not_fp8": 3}
    assert gemms.refusal(found, "cpu") is None
    h100 = gemms.census(H100_GEMMS)
    assert gemms.counts(h100) == {"fp8": 1, "cublas": 2, "other": 0, "asked_fp8": 2, "not_fp8": 1}
    assert gemms.summary(gemms.counts(h100)).endswith("; 1 of the 2 rounded to FP8 are FP8 GEMMs")
    assert gemms.summary(gemms.counts(found), "cpu").startswith("0 FP8, 0 other cuBLAS, 3 XLA's own")
    assert gemms.summary(gemms.counts(found), "cpu").endswith(
        "the 3 rounded to FP8 are XLA's dots (no FP8 GEMM on cpu: emulated)"
    )
    line = gemms.refusal(h100, "gpu")
    assert line is not None and "\n" not in line
    assert line.startswith("model.matmul fp8: 1 of the train step's 2 FP8 GEMMs compiled to other GEMMs ")
    assert "(1 __cublas$lt$matmul; the first: jit(train_step)/jvp(GPT)/attn/q/Fp8Dot_0/fp8_dot/dot)" in line


def test_the_plan_prints_its_gemm_counts(capsys):
    """scripts/plan.py's summary (plan/planner.py print_plan) has a GEMMs row from the plan's counts."""
    from jaxtrain.plan import planner

    plan = json.loads(Path("bench/results/plan_gpt_1b_fp8_h200x1_bench.json").read_text())
    counts = {"fp8": 120, "cublas": 6, "other": 0, "asked_fp8": 120, "not_fp8": 0}
    planner.print_plan(plan | {"gemms": counts})
    (row,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("GEMMs")]
    assert row.split(None, 1)[1] == gemms.summary(counts)
    assert row.endswith("; all of the 120 rounded to FP8 are FP8 GEMMs")
