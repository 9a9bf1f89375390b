"""fsdp gathers move only this device's tensor shard, in the compute dtype, and reduce-scatter
gradients in mesh.reduce_dtype (jaxtrain/run/step.py `_fsdp_gather`): checked in the program the
step compiles to, and in the losses."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain.config import load_config
from jaxtrain.parallel.fsdp import reduce_scatter
from jaxtrain.run.build import build
from jaxtrain.run.job import Job

TINY = ["--config", "configs/tiny.yaml", "--batch_size", "16", "--mesh.fsdp", "4", "--mesh.tensor", "2"]


def _collectives(flags: list[str]) -> dict[str, set[str]]:
    """The element types of the fsdp gathers and their gradients' reduce-scatters, as the train step
    asks for them (the lowered program: XLA:CPU then widens every collective to float32)."""
    run = build(Job.of_devices(load_config([*TINY, *flags]), jax.devices()))
    text = run.train_step.lower(run.target, run.batch_shape).as_text()
    found: dict[str, set[str]] = {}
    for kind in ("all_gather", "reduce_scatter"):
        # "stablehlo.all_gather"(%x) <{...}> : (tensor<4x64xbf16>) -> tensor<16x64xbf16>; a
        # reduce-scatter has its reduction's body between the op and its types
        for result in re.findall(rf'"stablehlo\.{kind}".*?\) -> tensor<[\dx]*x(\w+)>', text, re.DOTALL):
            found.setdefault(kind, set()).add(result)
    return found


def test_bfloat16_gathers_bfloat16_params_and_reduces_float32_gradients():
    moved = _collectives(["--dtype", "bfloat16"])
    assert moved == {"all_gather": {"bf16"}, "reduce_scatter": {"f32"}}, moved


def test_reduce_dtype_compute_rounds_as_bfloat16_on_cpu():
    """On a CPU mesh the reduce-scatter itself stays float32 (XLA:CPU widens collectives and aborts
    on a bf16 reduce-scatter), with bfloat16's rounding written around it (parallel/fsdp.py
    `reduce_scatter`): 8 addends of 1 + 2^-10 (bfloat16 rounds each to 1) sum to 8, not 8.0078125.
    The GPU program reduces in bf16 (tests/test_gpu_compile.py)."""
    moved = _collectives(["--dtype", "bfloat16", "--mesh.reduce_dtype", "compute"])
    assert moved == {"all_gather": {"bf16"}, "reduce_scatter": {"f32"}}, moved
    mesh = jax.make_mesh((8,), ("fsdp",))
    g = jnp.full((8, 8), 1 + 2**-10, jnp.float32)
    for dtype, want in ((jnp.float32, 8 + 8 * 2**-10), (jnp.bfloat16, 8.0)):
        summed = jax.shard_map(
            lambda x, dtype=dtype: reduce_scatter(x, dtype, "fsdp", 0),
            mesh=mesh, in_specs=P(None), out_specs=P("fsdp"),
        )  # fmt: skip
        assert (jax.device_get(jax.jit(summed)(g)) == want).all(), dtype


def test_float32_runs_gather_float32():
    moved = _collectives([])
    assert moved == {"all_gather": {"f32"}, "reduce_scatter": {"f32"}}, moved


@pytest.mark.parametrize("reduce_dtype", ["float32", "compute"])
def test_bfloat16_fsdp_tensor_trains_like_data_parallelism(reduce_dtype):
    """Five bf16 steps under fsdp 4 x tensor 2 against data parallelism on the same 8 devices."""

    def losses(flags: list[str]) -> list[float]:
        cfg = load_config(
            ["--config", "configs/tiny.yaml", "--batch_size", "16", "--dtype", "bfloat16", *flags]
        )
        run = build(Job.of_devices(cfg, jax.devices()))
        state, step = run.init_state(), run.compile_train()
        batch = jax.random.randint(jax.random.key(1), (16, cfg.model.seq_len + 1), 0, cfg.model.vocab_size)
        batch = jax.device_put(batch, run.batch_shape.sharding)
        out = []
        for _ in range(5):
            state, m = step(state, batch)
            out.append(float(m["loss"]))
        return out

    dp = losses([])
    sharded = losses(["--mesh.fsdp", "4", "--mesh.tensor", "2", "--mesh.reduce_dtype", reduce_dtype])
    assert sharded == pytest.approx(dp, rel=2e-2), (sharded, dp)
    assert sharded[-1] < sharded[0]


def test_no_weight_is_gathered_over_tensor():
    """Under fsdp 4 x tensor 2 every all-gather is an fsdp gather (devices 0,2,4,6 and 1,3,5,7 of
    the 8) of a tensor shard: left to XLA, the weights were first gathered whole over tensor."""
    run = build(Job.of_devices(load_config([*TINY, "--dtype", "bfloat16"]), jax.devices()))
    text = run.compile_train().as_text()
    gathers = re.findall(r"= (\S+) all-gather(?:-start)?\(.*?replica_groups=(\S+),", text)
    assert gathers, text[:2000]
    assert {groups for _, groups in gathers} == {"{{0,2,4,6},{1,3,5,7}}"}, gathers
    d, heads, head_dim = run.cfg.model.d_model, run.cfg.model.n_head, run.cfg.model.head_size
    qkv = [shape for shape, _ in gathers if shape.startswith(f"f32[{d},3,")]
    assert qkv and all(shape.startswith(f"f32[{d},3,{heads // 2},{head_dim}]") for shape in qkv), qkv
