"""FSDP, tensor parallelism and ZeRO-1 on 8 fake CPU devices: same losses as data parallelism,
less state per device, the collectives FSDP promises, and bad meshes refused.

pytest tests/test_sharding.py     # about 1 minute on 2 cores
"""

import functools
import json
import re

import jax
import numpy as np
import pytest

from jaxtrain.cluster.detect import detect
from jaxtrain.config import ConfigError, DistConfig, load_config
from jaxtrain.errors import UserError
from jaxtrain.faults import FaultPlan
from jaxtrain.observe import memory
from jaxtrain.observe.memory import check_compiled
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.run.build import build
from jaxtrain.run.job import Job, with_topology
from jaxtrain.run.loop import train

# 4 heads so tensor 2 splits them; clipping on, so the global norm must agree across layouts.
TINY = ["--config", "configs/tiny.yaml", "--optim.warmup_steps", "0", "--model.n_head", "4"]
STEPS = 10


@functools.cache
def _build(argv: tuple[str, ...], faults: FaultPlan | None = None):
    """The run the product builds for these flags on the 8 devices; a layout two tests use is
    built (and its steps traced and compiled) once."""
    return build(Job.of_devices(load_config([*TINY, *argv]), jax.devices()), faults)


def _train(argv):
    """(losses over STEPS steps, state bytes per device, final params) for one layout."""
    return _train_run(_build(tuple(argv)))


def _train_run(run, steps=STEPS):
    cfg, mesh, state = run.cfg, run.mesh, run.init_state()
    rng = np.random.default_rng(0)
    # Two batches in turn: random tokens, but seen again, so the loss must fall.
    batches = [
        rng.integers(0, 256, (cfg.batch_size, cfg.model.seq_len + 1), dtype=np.int32) for _ in range(2)
    ]
    losses = []
    for i in range(steps):
        rows = batches[i % 2]
        state, m = run.train_step(state, mesh_lib.global_batch(rows, mesh, cfg.batch_size))
        losses.append(float(m["loss"]))
    specs = jax.tree.map(lambda s: s.spec, run.shardings)
    return np.array(losses), mesh_lib.bytes_per_device(state, specs, mesh), jax.device_get(state.params)


@pytest.fixture(scope="module")
def data_parallel():
    return _train([])


@pytest.mark.parametrize(
    "argv",
    [
        ["--mesh.data", "1", "--mesh.fsdp", "8"],
        ["--mesh.data", "1", "--mesh.fsdp", "4", "--mesh.tensor", "2"],
        ["--mesh.data", "2", "--mesh.fsdp", "2", "--mesh.tensor", "2"],
        ["--mesh.zero1", "true"],
        [
            "--mesh.data",
            "2",
            "--mesh.fsdp",
            "4",
            "--gradient_accumulation_steps",
            "2",
            "--model.remat",
            "full",
            "--mesh.zero1",
            "true",
        ],
    ],
    ids=["fsdp8", "fsdp4xtp2", "dp2xfsdp2xtp2", "zero1", "dp2xfsdp4-accum-remat-zero1"],
)
def test_every_mesh_trains_like_data_parallelism(data_parallel, argv):
    dp_losses, dp_bytes, dp_params = data_parallel
    losses, state_bytes, params = _train(argv)
    np.testing.assert_allclose(losses, dp_losses, rtol=1e-4)
    assert losses[-1] < losses[0]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(dp_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
    if argv[:4] == ["--mesh.data", "1", "--mesh.fsdp", "8"]:
        assert state_bytes <= 0.15 * dp_bytes, (state_bytes, dp_bytes)
    else:
        assert state_bytes < dp_bytes


def _hlo(argv):
    """(the run's state shapes, its compiled train step's HLO)."""
    run = _build(tuple(argv))
    return run.abstract, run.compile_train().as_text()


def _all_reduce_sizes(hlo):
    """Element counts of every all-reduce operand (tuples counted per element)."""
    sizes = []
    for line in hlo.splitlines():
        if " all-reduce(" in line or "all-reduce-start(" in line:
            shapes = line.split("=", 1)[1].split("all-reduce", 1)[0]
            sizes += [
                int(np.prod([int(d) for d in dims.split(",") if d]))
                for dims in re.findall(r"\[([\d,]*)\]", shapes)
            ]
    return sizes


def test_fsdp_reduce_scatters_gradients_and_never_all_reduces_them():
    state, hlo = _hlo(["--mesh.data", "1", "--mesh.fsdp", "8"])
    assert "all-gather" in hlo and "reduce-scatter" in hlo
    # What is all-reduced is at most one device's 1/8 shard (or a scalar, or a norm scale).
    largest = max(x.size for x in jax.tree.leaves(state.params))
    assert max(_all_reduce_sizes(hlo), default=0) <= largest // 8
    # The check would catch the regression: data parallelism all-reduces the whole gradient.
    _, dp_hlo = _hlo([])
    assert max(_all_reduce_sizes(dp_hlo)) == largest


def test_zero1_reduce_scatters_gradients_over_data_into_the_moments_layout():
    state, hlo = _hlo(["--mesh.zero1", "true"])
    # Each data shard reduces only its slice of the gradient (the moments' split): no all-reduce
    # of a whole gradient, which sends twice the bytes (the old step's).
    assert "reduce-scatter" in hlo
    largest = max(x.size for x in jax.tree.leaves(state.params))
    assert max(_all_reduce_sizes(hlo), default=0) <= largest // 8


def test_params_and_moments_are_split_the_same_way():
    run = _build(("--mesh.data", "1", "--mesh.fsdp", "4", "--mesh.tensor", "2"))
    state, shardings = run.init_state(), run.shardings
    qkv = shardings.params["block_0"]["attn"]["qkv"]["kernel"].spec
    assert qkv == jax.sharding.PartitionSpec("fsdp", None, "tensor", None)  # embed on fsdp, heads on tensor
    assert shardings.params["wte"]["embedding"].spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    assert shardings.params["ln_f"]["scale"].spec == jax.sharding.PartitionSpec(None)
    adam = shardings.opt_state[0]
    assert (
        adam.mu["block_0"]["attn"]["qkv"]["kernel"].spec == qkv
        and adam.nu["wte"]["embedding"].spec[1] == "fsdp"
    )
    assert state.params["wte"]["embedding"].addressable_shards[0].data.shape == (128, 16)


def test_zero1_splits_params_and_moments_over_data():
    shardings = _build(("--mesh.zero1", "true")).shardings
    for tree in (shardings.params, shardings.opt_state[0].mu):
        assert tree["wte"]["embedding"].spec == jax.sharding.PartitionSpec("data", None)
        assert "data" in tuple(tree["block_0"]["attn"]["qkv"]["kernel"].spec)


# A mixture of experts in bfloat16 as Qwen3-30B-A3B ships (experts over expert inside, data and
# ZeRO-1 across, 2 microbatches summed in one buffer under full remat): its step gathers the
# weights over data as a bfloat16 copy, once, and trains as the same job without ZeRO-1.
MOE_BF16 = (
    "--config", "configs/moe_tiny.yaml", "--dtype", "bfloat16", "--mesh.expert", "4",
    "--mesh.data", "2", "--model.scan_layers", "true", "--model.remat", "full",
    "--gradient_accumulation_steps", "2", "--optim.warmup_steps", "0", "--model.n_layer", "2",
)  # fmt: skip


def test_zero1_gathers_a_compute_copy_once_and_trains_as_without_it():
    plain, zero1 = (_train_run(_build(MOE_BF16 + extra), 4) for extra in ((), ("--mesh.zero1", "true")))
    # Measured: the same losses to the bit, params within 1.2e-7 (the updates' float32 rounding),
    # where 4 steps moved them up to 0.012 (over more steps bfloat16's rounding compounds).
    np.testing.assert_allclose(zero1[0], plain[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(zero1[2]), jax.tree.leaves(plain[2]), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert zero1[1] < 0.55 * plain[1]  # the float32 params split 2 ways, as the moments (was 0.67)
    hlo = _build(MOE_BF16 + ("--mesh.zero1", "true")).compile_train().as_text()  # the compile cache's
    # The experts' gate and up stack (2 layers x 2 experts a device, d_expert 176 split over data 2):
    # gathered once a step (not again after the update), from its shard rounded to bfloat16 (which
    # XLA:CPU, collectives all float32, gathers as float32; tests/test_gpu_compile.py: bfloat16)
    gathers = re.findall(r"= f32\[2,2,128,2,176\]\S* all-gather(?:-start)?\(%([\w.\-]+)\)", hlo)
    assert len(gathers) == 1, gathers
    fusion = re.search(rf"%{re.escape(gathers[0])} = .*calls=%([\w.\-]+)", hlo)
    body = hlo[hlo.index(f"%{fusion.group(1)} (") :].split("\n}")[0]
    assert "bf16[2,2,128,2,88]" in body and "convert(" in body, body


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--mesh.fsdp", "3"], "mesh data -1 x fsdp 3 x tensor 1 does not multiply to the 8 devices"),
        (
            ["--mesh.data", "2", "--mesh.fsdp", "2", "--mesh.tensor", "4"],
            "e.g. --mesh.data -1 --mesh.fsdp 2 --mesh.tensor 4",
        ),
        (["--mesh.data", "-1", "--mesh.fsdp", "-1"], "at most one mesh axis may be -1"),
        (["--mesh.tensor", "3"], "model.n_head 4 is not divisible by mesh.tensor 3"),
        (
            ["--model.n_kv_head", "1", "--mesh.tensor", "2"],
            "model.n_kv_head 1 is not divisible by mesh.tensor 2",
        ),
        (["--mesh.fsdp", "0"], "'mesh.fsdp' must be >= 1 or -1"),
        (["--mesh.fsdp", "8", "--batch_size", "4"], "not divisible by 8 devices"),
        (
            ["--mesh.tensor", "2", "--batch_size", "6"],
            "not divisible by 4 batch shards (mesh.data x mesh.fsdp)",
        ),
    ],
)
def test_bad_meshes_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        with_topology(load_config(TINY + argv), 8, 1)


def test_non_finite_skip_and_bfloat16_under_fsdp_and_tensor():
    flags = ("--mesh.data", "1", "--mesh.fsdp", "4", "--mesh.tensor", "2", "--dtype", "bfloat16")
    run = _build(flags, FaultPlan(nan_step=2))
    cfg, mesh, state, train_step = run.cfg, run.mesh, run.init_state(), run.train_step
    rows = np.random.default_rng(0).integers(0, 256, (cfg.batch_size, cfg.model.seq_len + 1), dtype=np.int32)
    batch = mesh_lib.global_batch(rows, mesh, cfg.batch_size)
    state, m1 = train_step(state, batch)
    before = jax.device_get((state.params, state.opt_state))
    state, m2 = train_step(state, batch)  # step 2: one device's gradient is NaN
    after = jax.device_get((state.params, state.opt_state))
    assert bool(m1["finite"]) and not bool(m2["finite"]) and int(m2["skipped_steps"]) == 1
    assert all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    )
    state, m3 = train_step(state, batch)
    assert bool(m3["finite"]) and float(m3["loss"]) < float(m1["loss"])
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(state.params))


class _Gpu:
    """The two things check_compiled asks of a device, as an 80 GB GPU's allocator answers them
    (jax's client takes 75% of it by default)."""

    device_kind = "NVIDIA H100 80GB HBM3"

    def memory_stats(self):
        return {"bytes_limit": 60 * 2**30}


def test_a_compiled_step_too_big_for_the_gpu_is_refused_before_the_first_step(tmp_path, monkeypatch):
    cfg = with_topology(load_config(TINY), 8, 1)
    check_compiled(56 * 2**30, _Gpu(), cfg, 8)  # fits the allocator's 60 GiB less its 5% reserve
    # 58 GiB would fit the 60 GiB but not the 57 GiB the reserve leaves (observe/memory.py `fits`).
    with pytest.raises(
        UserError, match=r"needs 58.0 GiB per device, over the 57.0 GiB of the 60.0 GiB .*--model.remat full"
    ):
        check_compiled(58 * 2**30, _Gpu(), cfg, 8)
    check_compiled(84 * 2**30, jax.devices()[0], cfg, 8)  # a CPU reports no limit: nothing to judge
    # A mixture of experts whose auto took the padded exchange on its GPUs: the ragged one first.
    moe = with_topology(load_config(["--config", "configs/moe_tiny.yaml", "--mesh.expert", "8"]), 8, 1)
    with pytest.raises(
        UserError, match=r"lower it with --model.moe.exchange ragged \(auto's padded exchange"
    ):
        check_compiled(58 * 2**30, _Gpu(), moe, 8, exchange="padded")
    with pytest.raises(UserError, match=r"lower it with --total_batch_size") as e:
        check_compiled(58 * 2**30, _Gpu(), moe, 8, exchange="ragged")
    assert "exchange" not in str(e.value)
    # The real loop: these CPU devices made to report a 64 KiB allocator limit, as a GPU reports
    # its own; the compiled tiny step is larger, so the run stops after compiling, before step 1.
    monkeypatch.setattr(memory, "limit_bytes", lambda device: 64 * 2**10)
    run_dir = tmp_path / "run"
    cfg = load_config([*TINY, "--run_dir", str(run_dir), "--total_steps", "3", "--checkpoint_interval", "1"])
    with pytest.raises(memory.OutOfMemory, match=r"the compiled step needs .* GiB per device, over the 0.0"):
        train(cfg, detect(DistConfig(), {}))
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records] == ["launch", "end"], records  # no start record, no step
    assert not any((run_dir / "checkpoints").glob("*")), "a checkpoint was written"


MUON = ["--optim.name", "muon"]


@pytest.fixture(scope="module")
def data_parallel_muon():
    return _train(MUON)


@pytest.mark.parametrize(
    "argv",
    [
        ["--mesh.data", "1", "--mesh.fsdp", "8"],
        ["--mesh.data", "1", "--mesh.fsdp", "4", "--mesh.tensor", "2"],
    ],
    ids=["fsdp8", "fsdp4xtp2"],
)
def test_muon_trains_under_fsdp_and_tensor_like_data_parallelism(data_parallel_muon, argv):
    dp_losses, dp_bytes, dp_params = data_parallel_muon
    losses, state_bytes, params = _train(MUON + argv)
    # Newton-Schulz multiplies sharded matrices: sums in another order than one device's.
    np.testing.assert_allclose(losses, dp_losses, rtol=1e-3)
    assert losses[-1] < losses[0] and state_bytes < dp_bytes
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(dp_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-4)


def test_muon_momentum_is_split_like_its_param():
    shardings = _build((*MUON, "--mesh.data", "1", "--mesh.fsdp", "4", "--mesh.tensor", "2")).shardings
    params, groups = shardings.params, shardings.opt_state.inner_states
    muon_mu = groups["muon"].inner_state[0].mu
    for path in (("attn", "qkv", "kernel"), ("attn", "out", "kernel"), ("mlp", "fc", "kernel")):
        param, mu = params["block_1"], muon_mu["block_1"]
        for key in path:
            param, mu = param[key], mu[key]
        assert mu.spec == param.spec and "fsdp" in jax.tree.leaves(tuple(param.spec)), path
    adam_nu = groups["adamw"].inner_state[0].nu
    assert adam_nu["wte"]["embedding"].spec == params["wte"]["embedding"].spec


# SwiGLU, grouped-query attention (2 kv heads), an untied head, q/k norms and biases, scanned and
# rematerialised: the layouts split kv heads, the head and the gate/up matrix like the rest.
LLAMA = [
    "--model.mlp", "swiglu", "--model.n_kv_head", "2", "--model.tie_embeddings", "false",
    "--model.qk_norm", "true", "--model.qkv_bias", "true", "--model.scan_layers", "true",
    "--model.remat", "full",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_llama_options_train_under_fsdp_and_tensor_like_data_parallelism(optim):
    argv = LLAMA + ["--optim.name", optim]
    dp_losses, dp_bytes, dp_params = _train(argv)
    losses, state_bytes, params = _train(
        argv + ["--mesh.data", "1", "--mesh.fsdp", "4", "--mesh.tensor", "2"]
    )
    np.testing.assert_allclose(losses, dp_losses, rtol=1e-4 if optim == "adamw" else 1e-3)
    assert losses[-1] < losses[0] and state_bytes < dp_bytes
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(dp_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-4)
