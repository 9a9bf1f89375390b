"""The train step on 8 fake CPU devices: learning, data-parallel and accumulation equivalence."""

import re

import jax
import numpy as np
import pytest

from jaxtrain.config import load_config
from jaxtrain.errors import UserError
from jaxtrain.faults import FaultPlan
from jaxtrain.model.transformer import GPT
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.run.build import build
from jaxtrain.run.job import Job, with_topology
from jaxtrain.run.optim import decay_mask

TINY = ["--config", "configs/tiny.yaml", "--optim.warmup_steps", "0", "--gradient_clip_val", "0"]


def _build(argv, devices, faults=None):
    """The run the product builds for these flags on `devices` (data parallel over all of them)."""
    return build(Job.of_devices(load_config(TINY + argv), devices), faults)


@pytest.fixture(scope="module")
def eight_devices():
    return _build([], jax.devices())


@pytest.fixture(scope="module")
def four_microbatches():
    return _build(["--batch_size", "32", "--gradient_accumulation_steps", "4"], jax.devices())


def _run(run, batches):
    """Train `run` from its fresh state on `batches`; return (losses, grad norms, params)."""
    state = run.init_state()
    losses, norms = [], []
    for b in batches:
        state, m = run.train_step(state, mesh_lib.global_batch(b, run.mesh, b.shape[0]))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return np.array(losses), np.array(norms), jax.device_get(state.params)


def _batches(n, rows=16, seq=32, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (rows, seq + 1), dtype=np.int32) for _ in range(n)]


def _close(a, b, rtol=2e-5, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def test_loss_falls_on_a_repeated_batch(eight_devices):
    batch = _batches(1)[0]
    losses, _, _ = _run(eight_devices, [batch] * 30)
    assert losses[0] > 5.0  # ~ln(256) at init
    assert losses[-1] < losses[0] - 1.0, losses


def test_eight_devices_equal_one_device(eight_devices):
    batches = _batches(4)
    l8, n8, p8 = _run(eight_devices, batches)
    l1, n1, p1 = _run(_build([], jax.devices()[:1]), batches)
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    np.testing.assert_allclose(n8, n1, rtol=1e-4)
    _close(p8, p1, rtol=1e-4, atol=1e-5)


def test_four_microbatches_equal_one_four_times_batch(four_microbatches):
    batches = _batches(3, rows=32)
    la, na, pa = _run(four_microbatches, batches)
    lb, nb, pb = _run(_build(["--batch_size", "32"], jax.devices()), batches)
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    np.testing.assert_allclose(na, nb, rtol=1e-4)
    _close(pa, pb, rtol=1e-4, atol=1e-5)


def test_gradients_are_reduced_once_per_step(four_microbatches):
    """With 4 microbatches the compiled step still holds exactly one gradient all-reduce."""
    hlo = four_microbatches.compile_train().as_text()
    computations = dict(re.findall(r"^(?:ENTRY )?(%[\w.\-]+) .*?\{\n(.*?)\n\}", hlo, re.M | re.S))
    bodies = re.findall(r"body=(%[\w.\-]+)", hlo)
    assert bodies, "the microbatch scan should compile to a while loop"
    assert any("all-reduce(" in c for c in computations.values())
    assert not any("all-reduce(" in computations[b] for b in bodies)
    # Exactly one all-reduce in the whole program: every gradient and the loss, in one collective.
    defs = [line for line in hlo.splitlines() if re.search(r"= .*\ball-reduce(-start)?\(", line)]
    assert len(defs) == 1, defs
    assert (
        defs[0].split(" all-reduce")[0].count("f32[")
        == len(jax.tree.leaves(four_microbatches.abstract.params)) + 1
    ), defs[0]


def test_bfloat16_trains_with_float32_params():
    batch = _batches(1)[0]
    losses, _, params = _run(_build(["--dtype", "bfloat16"], jax.devices()), [batch] * 20)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(params))
    assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.5, losses


def test_float16_on_cpu_is_a_clear_error():
    with pytest.raises(UserError, match="dtype float16 needs a GPU"):
        with_topology(load_config(["--dtype", "float16"]), 8, 1, "cpu")
    with_topology(load_config(["--dtype", "float16"]), 8, 1, "gpu")


def test_weight_decay_touches_matrices_only():
    cfg = load_config(TINY)
    params = GPT(cfg.model).init(jax.random.key(0), np.zeros((1, 32), np.int32))["params"]
    flat = jax.tree_util.tree_flatten_with_path(decay_mask(params))[0]
    decayed = {jax.tree_util.keystr(p) for p, v in flat if v}
    kept = {jax.tree_util.keystr(p) for p, v in flat if not v}
    assert decayed and kept
    assert all("kernel" in k or "embedding" in k for k in decayed)
    assert all("scale" in k for k in kept)


def test_a_non_finite_step_changes_nothing_and_is_counted():
    run = _build([], jax.devices(), FaultPlan(nan_step=2))
    state, train_step = run.init_state(), run.train_step
    batch = mesh_lib.global_batch(_batches(1)[0], run.mesh, 16)
    state, m1 = train_step(state, batch)
    before = jax.device_get((state.params, state.opt_state))
    state, m2 = train_step(state, batch)  # step 2: device 0's gradient is NaN, pmean spreads it
    after = jax.device_get((state.params, state.opt_state))
    assert bool(m1["finite"]) and not bool(m2["finite"])
    assert (int(m2["bad_steps"]), int(m2["skipped_steps"]), int(state.step)) == (1, 1, 2)
    assert all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    )
    state, m3 = train_step(state, batch)
    assert bool(m3["finite"]) and int(m3["bad_steps"]) == 0 and int(m3["skipped_steps"]) == 1
