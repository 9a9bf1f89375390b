"""The expert-parallel exchange (parallel/expert.py `exchange`) on 8 fake CPU devices: the padded stand-in
for `ragged_all_to_all` XLA:CPU runs lands every row where the ragged one (GPUs) does, forward and
through jax's own backward of it, and the exchange routes as specified: each device receives
exactly its experts' copies, up to its receive bound, the same share of each sender's dropped.

XLA:CPU cannot run `ragged_all_to_all` (UNIMPLEMENTED), so the ragged side is its documented
semantics (jax's docstring, by hand below) and jax's own transpose rule; tests/test_gpu_compile.py
checks that the GPU program uses it and moves the routed bytes.
"""

import dataclasses
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxtrain.config import load_config
from jaxtrain.model import auto, fp8
from jaxtrain.model.moe import _dequantize, _quantize
from jaxtrain.observe import links
from jaxtrain.parallel import expert
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel.expert import (
    Exchange,
    _plan,
    exchange,
    padded_ragged_all_to_all,
    pair_bound,
    receive_bound,
)
from jaxtrain.plan import forecast
from jaxtrain.run.build import build
from jaxtrain.run.job import Job


def _shard_map(fn, n_devices, n_in):
    mesh = Mesh(np.array(jax.devices()[:n_devices]), ("x",))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * n_in, out_specs=P("x"), check_vma=False))


def _ragged_by_hand(operand, output, input_offsets, send_sizes, output_offsets):
    """XLA's ragged-all-to-all (jax's docstring, with U slices a peer: arrays of peers x U), per
    device lists: device s's slice u for device i goes to device i at output_offsets[s][i * U + u]
    (recv_sizes hold the same sizes as the receiver sees them: jax requires it)."""
    result = [o.copy() for o in output]
    peers = len(operand)
    u = len(input_offsets[0]) // peers
    for s in range(peers):
        for k in range(peers * u):
            piece = operand[s][input_offsets[s][k] : input_offsets[s][k] + send_sizes[s][k]]
            result[k // u][output_offsets[s][k] : output_offsets[s][k] + len(piece)] = piece
    return result


def _random_slices(rng, ep, n, m, u=1):
    """U slices a peer with gaps on both sides: each device sends each peer u runs of its n rows
    (peer-major), each receiver gets them in an m-row buffer in a shuffled order."""
    send = np.zeros((ep, ep * u), np.int32)
    for s in range(ep):
        send[s] = rng.multinomial(rng.integers(0, n + 1), np.ones(ep * u) / (ep * u))
    into = lambda send: send.reshape(ep, ep, u).sum(axis=(0, 2))  # noqa: E731  rows each receiver gets
    while into(send).max() > m - ep * u:  # room for a gap before each slice
        send = np.maximum(send - np.repeat(into(send) > m - ep * u, u)[None], 0)
    # Runs in order, shifted by one row where they leave room: no row is sent twice.
    in_off = np.cumsum(send, axis=1) - send + (rng.integers(0, 2, (ep, 1)) * (send.sum(axis=1) < n)[:, None])
    out_off = np.zeros((ep, ep * u), np.int32)
    for i in range(ep):
        at = 0
        for slot in rng.permutation(ep * u):  # (source, slice)
            s, k = divmod(int(slot), u)
            at += int(rng.integers(0, 2))
            out_off[s, i * u + k], at = at, at + send[s, i * u + k]
    recv = send.reshape(ep, ep, u).transpose(1, 0, 2).reshape(ep, ep * u)
    return in_off.astype(np.int32), send, out_off, recv.copy()


def test_the_padded_stand_in_lands_rows_where_ragged_all_to_all_does():
    """jax's docstring example on 2 devices, then random slices (empty ones, gaps) on 8, one and
    three slices a peer (the expert exchange sends one a peer's expert)."""
    ex = {"operand": [[1, 2, 2], [3, 4, 0]], "in": [[0, 1], [0, 1]], "send": [[1, 2], [1, 1]]}
    ex |= {"out_off": [[0, 0], [1, 2]], "recv": [[1, 1], [2, 1]]}
    fn = _shard_map(
        lambda x, a, b, c, d: padded_ragged_all_to_all(
            x, jnp.zeros(4, x.dtype), a, b, c, d, axis_name="x", width=2
        ),
        2,
        5,
    )
    got = fn(*(jnp.asarray(np.ravel(ex[k]), jnp.int32) for k in ("operand", "in", "send", "out_off", "recv")))
    assert np.asarray(got).tolist() == [1, 3, 0, 0, 2, 2, 4, 0]  # the docstring's result
    rng = np.random.default_rng(0)
    ep, n, m, d = 8, 10, 40, 3
    fn = _shard_map(
        lambda x, o, a, b, c, e: padded_ragged_all_to_all(x, o, a, b, c, e, axis_name="x", width=n), ep, 6
    )
    for u in (1, 3):
        in_off, send, out_off, recv = _random_slices(rng, ep, n, m, u)
        assert (send.reshape(ep, ep, u) > 0).sum(axis=2).max() > 1 or u == 1  # several slices to a peer
        x = rng.normal(size=(ep, n, d)).astype(np.float32)
        init = rng.normal(size=(ep, m, d)).astype(np.float32)  # rows nothing lands on keep their value
        got = fn(*(jnp.asarray(v.reshape(-1, *v.shape[2:])) for v in (x, init, in_off, send, out_off, recv)))
        want = _ragged_by_hand(list(x), list(init), in_off, send, out_off)
        np.testing.assert_array_equal(np.asarray(got).reshape(ep, m, d), np.stack(want))


def _with_stand_in(closed, args, width):
    """A jaxpr evaluated with each ragged_all_to_all run by the padded stand-in."""
    jaxpr, env = closed.jaxpr, {}
    env.update(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive.name == "ragged_all_to_all":
            outs = [padded_ragged_all_to_all(*ins, axis_name=eqn.params["axis_name"][0], width=width)]
        else:
            outs = eqn.primitive.bind(*ins, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def test_jax_backward_of_ragged_all_to_all_is_the_stand_ins_gradient():
    """jax's own VJP of ragged_all_to_all (its transpose rule: the cotangent sent back by another
    ragged_all_to_all), run with the stand-in for the primitive, equals the gradient of the
    stand-in, with two slices a peer: the GPU step's backward needs no custom_vjp."""
    rng = np.random.default_rng(1)
    ep, n, m, d = 8, 10, 30, 3
    in_off, send, out_off, recv = _random_slices(rng, ep, n, m, 2)
    x, ct = rng.normal(size=(ep, n, d)).astype(np.float32), rng.normal(size=(ep, m, d)).astype(np.float32)

    def both(x, ct, a, b, c, e):
        def forward(a2a):
            return lambda x: a2a(x, jnp.zeros((m, d), x.dtype), a, b, c, e, axis_name="x")

        stand_in = jax.tree_util.Partial(padded_ragged_all_to_all, width=n)
        autodiff = jax.vjp(forward(stand_in), x)[1](ct)[0]
        jaxs = jax.make_jaxpr(lambda x, ct: jax.vjp(forward(jax.lax.ragged_all_to_all), x)[1](ct))(x, ct)
        return jnp.stack([autodiff, _with_stand_in(jaxs, [x, ct], width=max(n, m))[0]])

    fn = _shard_map(both, ep, 6)
    got = np.asarray(
        fn(*(jnp.asarray(v.reshape(-1, *v.shape[2:])) for v in (x, ct, in_off, send, out_off, recv)))
    )
    got = got.reshape(ep, 2, n, d)
    assert np.abs(got[:, 0]).sum() > 0
    np.testing.assert_array_equal(got[:, 0], got[:, 1])


def _routed_by_hand(experts, rows, w_in, w_out, ep, capacity_factor):
    """Each device's copies (rows sorted by their experts) through their experts, computed with
    numpy: a receiver takes at most ceil(capacity_factor x n / ep) of a sender's (none dropless),
    then keeps all of them if they fit in its bound, else the same share of each sender's (rounded
    down), the first of each sender's run. -> outputs, dropped."""
    devices, n = experts.shape
    local = w_in.shape[0] // ep
    bound = receive_bound(n, ep, capacity_factor)
    pair = math.ceil(capacity_factor * n / ep) if capacity_factor else n
    dest = experts // local
    want = np.minimum((dest[:, :, None] == np.arange(ep)).sum(axis=1), pair)  # [sender, receiver]
    out, dropped = np.zeros_like(rows), 0
    for j in range(ep):
        total = want[:, j].sum()
        kept = (
            want[:, j]
            if total <= bound
            else np.floor(want[:, j].astype(np.float32) * (np.float32(bound) / np.float32(total))).astype(int)
        )
        for s in range(devices):
            run = np.flatnonzero(dest[s] == j)
            dropped += len(run) - kept[s]
            for i in run[: kept[s]]:
                h = rows[s, i] @ w_in[experts[s, i]].reshape(rows.shape[-1], -1)
                gate, up = np.split(h, 2)
                out[s, i] = (gate / (1 + np.exp(-gate)) * up) @ w_out[experts[s, i]]
    return out, dropped / experts.size


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0, 2.0])
def test_each_device_receives_its_experts_copies_up_to_its_bound(capacity_factor):
    """4 devices of 4 experts each, a router that sends most copies to the first device: dropless,
    every copy comes back through its expert; at capacity 1, the first device keeps n of its
    peers' copies (the same share of each, and at most n / 4 of any one) and the share dropped is
    counted exactly; at 2, only a sender's share of a peer (n / 2) binds. The padded exchange's
    buffer a peer is that share: its all-to-all moves capacity x the rows, not ep x."""
    rng = np.random.default_rng(2)
    ep, local, n, d, ff = 4, 4, 24, 8, 6
    skew = np.r_[np.full(local, 3.0), np.ones(local * (ep - 1))]
    experts = np.sort(rng.choice(ep * local, size=(ep, n), p=skew / skew.sum()), axis=1).astype(np.int32)
    rows = rng.normal(size=(ep, n, d)).astype(np.float32)
    w_in = (rng.normal(size=(ep * local, d, 2, ff)) * 0.5).astype(np.float32)
    w_out = (rng.normal(size=(ep * local, ff, d)) * 0.5).astype(np.float32)

    def device(r, e, a, b):
        (out,), dropped = exchange(
            (r,),
            (jnp.ones(r.shape[0], r.dtype),),
            (e,),
            "x",
            ep,
            a,
            b,
            "blocks",
            capacity_factor,
            ragged=False,
        )
        return out, dropped[None]

    mesh = Mesh(np.array(jax.devices()[:ep]), ("x",))
    fn = jax.jit(jax.shard_map(device, mesh=mesh, in_specs=(P("x"),) * 4, out_specs=P("x"), check_vma=False))
    out, dropped = fn(rows.reshape(ep * n, d), experts.reshape(-1), w_in, w_out)
    want, want_dropped = _routed_by_hand(experts, rows, w_in, w_out, ep, capacity_factor)
    np.testing.assert_allclose(np.asarray(out).reshape(ep, n, d), want, rtol=1e-5, atol=1e-5)
    assert float(np.mean(dropped)) == pytest.approx(want_dropped, abs=1e-7)
    assert (want_dropped > 0) == (capacity_factor > 0), want_dropped
    assert receive_bound(n, ep, capacity_factor) == (
        math.ceil(capacity_factor * n) if capacity_factor else ep * n
    )
    assert pair_bound(n, ep, capacity_factor) == {0.0: n, 1.0: n // 4, 2.0: n // 2}[capacity_factor]
    hlo = fn.lower(rows.reshape(ep * n, d), experts.reshape(-1), w_in, w_out).as_text()
    width = pair_bound(n, ep, capacity_factor)  # the rows' buffer: [peers, width, d] each way
    moved = {line.split("(tensor<")[-1].split(">")[0] for line in hlo.splitlines() if "all_to_all" in line}
    assert {shape for shape in moved if shape.endswith(f"x{d}xf32")} == {f"{ep}x{width}x{d}xf32"}, moved


@pytest.mark.parametrize("dispatch, pieces", [("", 1), ("", 2), ("float8_e4m3fn", 1)])
def test_the_exchanges_own_backward_is_the_routed_experts_gradient(dispatch, pieces):
    """`_exchange` has a backward of its own (model/moe.py `_routed`: it sends the copies again
    with their gradient and reruns the experts where they are, so remat re-sends nothing). On 4
    devices of 2 experts each, dropless, its forward and gradients (rows, gates, both expert
    matrices) equal jax's autodiff of the same routing computed in one place: each row through its
    expert's MLP times its gate; so in 2 pieces (each device's rows in halves, exchanged one after
    the other). FP8 dispatch: the forward equals that of the copies rounded to
    FP8 (a layout never changes the model); the backward sends the rows' gradient in FP8 too
    (DeepSeek-V3's), so there the gradients agree to FP8's rounding."""
    rng = np.random.default_rng(3)
    ep, local, n, d, ff = 4, 2, 12, 16, 6
    experts = np.sort(rng.integers(0, ep * local, (ep, n)), axis=1).astype(np.int32)
    rows = rng.normal(size=(ep * n, d)).astype(np.float32)
    gates = rng.uniform(0.1, 1.0, ep * n).astype(np.float32)
    w_in = (rng.normal(size=(ep * local, d, 2, ff)) * 0.5).astype(np.float32)
    w_out = (rng.normal(size=(ep * local, ff, d)) * 0.5).astype(np.float32)
    ct = rng.normal(size=(ep * n, d)).astype(np.float32)

    def device(r, g, e, a, b, c):
        def loss(r, g, a, b):
            cut = [jnp.split(v, pieces) for v in (r, g, e)]
            out = exchange(*cut, "x", ep, a, b, "blocks", 0.0, ragged=False, dispatch=dispatch)[0]
            out = jnp.concatenate(out)
            return jnp.sum(out * c), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(r, g, a, b)
        return out, *grads

    fn = jax.jit(
        jax.shard_map(
            device,
            mesh=Mesh(np.array(jax.devices()[:ep]), ("x",)),
            in_specs=(P("x"),) * 6,
            out_specs=(P("x"),) * 5,
            check_vma=False,
        )
    )
    got = fn(rows, gates, experts.reshape(-1), w_in, w_out, ct)

    def one_place(r, g, a, b):
        if dispatch:  # the copies rounded as the wire rounds them; their gradient passed straight
            r = r + jax.lax.stop_gradient(_dequantize(*_quantize(r, jnp.dtype(dispatch)), r.dtype) - r)
        e = experts.reshape(-1)
        h = jnp.einsum("nd,ndf->nf", r, a[e].reshape(-1, d, 2 * ff))
        out = jnp.einsum("nf,nfd->nd", jax.nn.silu(h[:, :ff]) * h[:, ff:], b[e]) * g[:, None]
        return jnp.sum(out * ct), out

    (_, want_out), want = jax.value_and_grad(one_place, argnums=(0, 1, 2, 3), has_aux=True)(
        rows, gates, w_in, w_out
    )
    np.testing.assert_allclose(got[0], want_out, rtol=1e-5, atol=1e-5)
    for name, g, w in zip(("rows", "gates", "w_in", "w_out"), got[1:], want, strict=True):
        g, w = np.asarray(g).ravel(), np.asarray(w).ravel()
        if dispatch:  # FP8's 3 mantissa bits: each value within 1/16, the whole within a few %
            assert np.dot(g, w) / (np.linalg.norm(g) * np.linalg.norm(w)) > 0.998, name
            np.testing.assert_allclose(np.linalg.norm(g), np.linalg.norm(w), rtol=0.03, err_msg=name)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)


def test_fp8_experts_copies_travel_rounded_by_one_scale_shared_over_the_expert_axis():
    """`pallas_fp8` under remat: the copies go to their experts already in e4m3 (half the bytes), by
    one power-of-two scale for the layer's pieces and every sender (`Wire.rows_scale`: the max over
    the expert axis, as a receiver's buffer holds every peer's rows and its kernel multiplies it
    by one scale), and land as the bf16 exchange would land them, rounded by that scale: the
    kernel's operand (model/grouped_fp8.py `rounded`). On 4 devices whose rows' magnitudes differ
    (the largest on the last), in 2 pieces."""
    ep, local, n, d = 4, 2, 16, 8
    rng = np.random.default_rng(5)
    experts = np.sort(rng.integers(0, ep * local, (ep, 2, n)), axis=2).astype(np.int32)
    magnitude = np.array([0.5, 1.0, 2.0, 60.0])[:, None, None, None]
    rows = jnp.asarray(rng.normal(size=(ep, 2, n, d)) * magnitude, jnp.bfloat16)
    bound = receive_bound(n, ep, 0.0)
    wire = Exchange("pallas_fp8", n, "", bound, "padded", "x", n)

    def device(r, e):
        pieces = tuple(r[0])
        scale = wire.rows_scale(pieces)
        plans = [_plan(e[0, i], "x", ep, local, bound, n) for i in range(2)]
        out = [wire.rows_out(p, plan, None, scale) for p, plan in zip(pieces, plans, strict=True)]
        as_bf16 = [wire.out(p, plan) for p, plan in zip(pieces, plans, strict=True)]
        stack = lambda xs: jnp.stack(xs)[None]  # noqa: E731
        return (
            scale[None], stack([o[0] for o in out]), stack([o[1][0] for o in out]),
            stack([o[1][1] for o in out]), stack(as_bf16), stack([plan.sizes.sum() for plan in plans]),
        )  # fmt: skip

    mesh = Mesh(np.array(jax.devices()[:ep]), ("x",))
    fn = jax.jit(jax.shard_map(device, mesh=mesh, in_specs=(P("x"),) * 2, out_specs=P("x"), check_vma=False))
    scale, recv, landed, scales, as_bf16, received = fn(rows, experts)
    want = fp8.scale_for(jnp.max(jnp.abs(rows.astype(jnp.float32))), fp8.FORWARD)
    assert landed.dtype == fp8.FORWARD and float(want) > 0
    np.testing.assert_array_equal(np.asarray(scale), float(want))  # every device's, both pieces'
    np.testing.assert_array_equal(np.asarray(scales), float(want))
    for dev in range(ep):
        for piece in range(2):
            got = int(received[dev, piece])
            assert got > 0
            keep = slice(0, got)  # rows past the received ones belong to no expert
            np.testing.assert_array_equal(
                np.asarray(landed[dev, piece, keep].astype(jnp.float32)),
                np.asarray(fp8.to_fp8(as_bf16[dev, piece, keep], want, fp8.FORWARD).astype(jnp.float32)),
            )
            np.testing.assert_array_equal(
                np.asarray(recv[dev, piece, keep]),
                np.asarray(fp8.dequantize(landed[dev, piece, keep], want, jnp.bfloat16)),
            )


def test_auto_picks_the_exchange_the_plan_forecasts_faster():
    """A job's auto costs one of its exchanges both ways by the forecast's own figures: the transfer
    it builds from its config and mesh is the plan's traced one (Qwen3-30B-A3B's 8 layers on one
    host of 8: 8 x 16 slots, 32K copies of 2,048 bf16 values a device), and the pick is the plan's."""
    root = Path(__file__).resolve().parent.parent
    plan = json.loads((root / "bench/results/plan_qwen3_30b_a3b_8l_h100x8.json").read_text())
    flags = plan["command"].split()[1:]
    job = Job.of_devices(load_config(flags[: flags.index("--target")]), jax.devices()[:8])
    cfg = job.cfg  # resolved on 8 devices, as the plan's 8 GPUs of one host
    mesh = mesh_lib.make_mesh(list(job.devices), cfg.mesh)
    xfer = expert.one_exchange(cfg, mesh, 2)
    assert xfer == pytest.approx(forecast._largest_exchange(plan["schedule_trace"]))
    # By hand: 32,768 copies of 2,048 bf16 values to 8 peers on one host, 16 experts each; in 2
    # groups of sequences (model.moe.overlap_groups) each exchange carries half of them.
    assert xfer == links.exchange_xfer(32768 * 2048 * 2, 8, 8, 16)
    moe = dataclasses.replace(cfg.model.moe, overlap_groups=2)
    groups = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe))
    assert expert.one_exchange(groups, mesh, 2) == links.exchange_xfer(32768 * 2048, 8, 8, 16)
    seconds = links.exchange_seconds(xfer, plan["forecast"]["expert_load"])
    assert auto.exchange("gpu", seconds) == plan["forecast"]["exchange"]["auto"] == "padded"
    assert auto.exchange("gpu") == "ragged" and auto.exchange("cpu", seconds) == "padded"
    # Across hosts, many slots against few bytes a peer: the ragged one's sends cost more.
    across = links.exchange_xfer(2**20, 8, 2, 16)
    assert auto.exchange("gpu", links.exchange_seconds(across, 1.25)) == "padded"
    assert auto.exchange("gpu", links.exchange_seconds(links.exchange_xfer(2**30, 8, 2, 1), 1.25)) == "ragged"


def test_fp8_projections_dispatch_the_copies_in_fp8_unless_told_not_to():
    """model.moe.dispatch_dtype auto: beside model.matmul fp8 under remat the copies (and their
    gradient) cross the expert axis in float8_e4m3fn with a float32 scale a 128 values; the results
    come back in bf16. `compute` turns it off, and without remat (where the rounding cannot live in
    the exchange's own backward) auto keeps the compute dtype. Checked in the step's lowered
    program: the element types of its all-to-alls."""
    fp8_step = ["--config", "configs/moe_tiny.yaml", "--mesh.expert", "2", "--mesh.data", "1",
                "--dtype", "bfloat16", "--model.matmul", "fp8", "--model.remat", "full"]  # fmt: skip
    rows = f"2x4096x{load_config(fp8_step).model.d_model}x"  # moe_tiny's copies of one device's tokens
    moved = {}
    for name, extra in {"auto": [], "off": ["--model.moe.dispatch_dtype", "compute"],
                        "no remat": ["--model.remat", "none"]}.items():  # fmt: skip
        cfg = load_config([*fp8_step, *extra])
        run = build(Job.of_devices(cfg, jax.devices()[:2]))
        text = run.train_step.lower(run.target, run.batch_shape).as_text()
        types = re.findall(r'"stablehlo\.all_to_all".*?: \(tensor<([\dx]*x\w+)>', text, re.DOTALL)
        moved[name] = (cfg.model.dispatch, {t.removeprefix(rows) for t in types if t.startswith(rows)})
    assert moved == {
        "auto": ("float8_e4m3fn", {"f8E4M3FN", "bf16"}),
        "off": ("", {"bf16"}),
        "no remat": ("", {"bf16"}),
    }, moved
    # bf16 projections dispatch as they compute; an explicit FP8 dispatch is taken as named
    assert load_config(fp8_step[:-4]).model.dispatch == ""
    assert (
        load_config(
            [*fp8_step[:-4], "--model.remat", "full", "--model.moe.dispatch_dtype", "float8_e4m3fn"]
        ).model.dispatch
        == "float8_e4m3fn"
    )
