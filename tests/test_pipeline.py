"""Pipeline parallelism: a tiny Llama of 8 layers split into stages over the `pipeline` mesh axis
trains as on one device (jaxtrain/parallel/pipeline.py), composed with data, fsdp and tensor, under
gradient accumulation (the microbatches the pipeline runs), with remat and documents masked, and
so do 5 layers over 2 stages (padded to 6); its checkpoints restore on other pipeline sizes and
on none, and so do those of 6 layers over 4 stages; more stages than layers is one line.

    pytest tests/test_pipeline.py
"""

import functools

import jax
import numpy as np
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.disk.checkpoint import Checkpointer
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel.pipeline import bubble
from jaxtrain.run.build import build
from jaxtrain.run.job import Job

# 8 scanned layers, an untied head (its gradient only on the last stage, the embedding's only on
# the first), 4 microbatches of one row per device, clipping on (the global norm over the stages).
LLAMA = [
    "--config", "configs/tiny.yaml", "--optim.warmup_steps", "0", "--model.n_head", "4",
    "--model.mlp", "swiglu", "--model.n_kv_head", "2", "--batch_size", "8", "--model.n_layer", "8",
    "--model.scan_layers", "true", "--model.tie_embeddings", "false",
    "--gradient_accumulation_steps", "4", "--gradient_clip_val", "0.5",
]  # fmt: skip
# Documents of 7 tokens each (token 1 starts one), and each stage one checkpoint.
DOCS_REMAT = ["--model.doc_bos", "1", "--model.remat", "full"]
STEPS = 3


@functools.cache
def _build(argv: tuple[str, ...], devices: int):
    return build(Job.of_devices(load_config([*LLAMA, *argv]), jax.devices()[:devices]))


def _train(argv: tuple[str, ...], devices: int) -> tuple[np.ndarray, dict, int]:
    run = _build(argv, devices)
    state = run.init_state()
    rows = np.random.default_rng(0).integers(3, 256, (8, run.cfg.model.seq_len + 1), dtype=np.int32)
    if "--model.doc_bos" in argv:
        rows[:, ::7] = 1
    losses = []
    for _ in range(STEPS):
        state, metrics = run.train_step(state, mesh_lib.global_batch(rows, run.mesh, 8))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state.params), run.state_bytes_per_device


@pytest.mark.parametrize(
    ("mesh", "options"),
    [
        # 2 microbatches over 4 stages: stages 2 and 3 run the head of none (a masked slot). Remat
        # full without FSDP: the 405B plan's path (ticks checkpointed, layers unrolled on weights
        # cast once a step).
        (
            ("--mesh.pipeline", "4", "--mesh.data", "2", "--gradient_accumulation_steps", "2"),
            ("--model.remat", "full"),
        ),
        (("--mesh.pipeline", "2", "--mesh.fsdp", "2", "--mesh.tensor", "2", "--mesh.data", "1"), DOCS_REMAT),
        # 5 layers over 2 stages (3 each, the last stage's third zero padding): the stack stored
        # whole by layers and split over pipeline by d_model (the 405B's 126 over 32), regrouped in
        # the step; with tensor, ZeRO-1 over data and remat full without FSDP, as the 405B plan.
        (
            ("--mesh.pipeline", "2", "--mesh.data", "2", "--mesh.tensor", "2", "--mesh.zero1", "true"),
            ("--model.n_layer", "5", "--model.remat", "full"),
        ),
    ],
    ids=[
        "pipeline4xdata2-remat",
        "pipeline2xfsdp2xtensor2-documents-remat",
        "5layers-pipeline2xdata2xtensor2-zero1-remat",
    ],
)
def test_layers_split_over_stages_train_as_on_one_device(mesh, options):
    one_losses, one_params, one_bytes = _train(tuple(options), 1)
    losses, params, state_bytes = _train((*options, *mesh), 8)
    # Each stage holds its layers only (and its fsdp x tensor share of them).
    assert state_bytes < 0.5 * one_bytes, (state_bytes, one_bytes)
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    # atol 1e-4 as in tests/test_context.py: Adam's first steps move a param whose gradient is near
    # 0 by up to the learning rate whatever the sign of its float32 noise.
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


# DeepSeek tiny: its dense first layer (run by stage 0), then 4 MoE layers of MLA, a shared
# expert, the grouped sigmoid router and its bias updates; 2 microbatches (each stage idles one
# tick of three).
DEEPSEEK = [
    "--config", "configs/deepseek_tiny.yaml", "--optim.warmup_steps", "0", "--batch_size", "8",
    "--model.n_layer", "5", "--model.scan_layers", "true",
    "--gradient_accumulation_steps", "2", "--model.moe.balance_coef", "0.01",
    "--model.moe.z_loss_coef", "0.001",
]  # fmt: skip


def test_a_mixture_of_experts_over_pipeline_x_expert_x_fsdp_trains_as_on_one_device():
    """Pipeline 2 x expert 2 x fsdp 2: the dense first layer on stage 0, each stage's experts
    exchanged inside its expert group, its layers' router losses (balance, z: coefficients raised
    to count) added on the ticks it holds a microbatch, the expert load of every layer on every
    stage for the bias update and the logs."""
    rows = np.random.default_rng(1).integers(3, 256, (8, 65), dtype=np.int32)
    # A batch shard's microbatch m is its row m: one device takes the same microbatches in this order.
    order = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])
    runs = {}
    for name, argv, devices, batch in [
        ("one", [], 1, rows[order]),
        ("pipeline", ["--mesh.pipeline", "2", "--mesh.expert", "2", "--mesh.fsdp", "2"], 8, rows),
    ]:
        run = build(Job.of_devices(load_config([*DEEPSEEK, *argv]), jax.devices()[:devices]))
        state, metrics = run.init_state(), []
        for _ in range(STEPS):
            state, m = run.train_step(state, mesh_lib.global_batch(batch, run.mesh, 8))
            metrics.append(jax.device_get(m))
        runs[name] = metrics, jax.device_get(state.params)
    (one, one_params), (piped, params) = runs["one"], runs["pipeline"]
    for key in ("loss", "moe_balance_loss", "moe_z_loss"):
        np.testing.assert_allclose([m[key] for m in piped], [m[key] for m in one], rtol=1e-5, err_msg=key)
    for a, b in zip(piped, one, strict=True):
        assert a["expert_load"].shape == (4, 8)
        np.testing.assert_allclose(a["expert_load"], b["expert_load"], atol=1e-6)
    assert one[-1]["moe_balance_loss"] > 1.0  # routing uneven: the balance loss has work to do
    bias = params["blocks"]["moe"]["router_bias"]
    assert np.abs(bias).max() > 0  # moved by the loads
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


def test_stages_hold_consecutive_layers_and_the_program_shifts_activations():
    run = _build(("--mesh.pipeline", "4", "--mesh.data", "2"), 8)
    spec = run.shardings.params["blocks"]["attn"]["q"]["kernel"].spec
    assert spec[0] == "pipeline" and run.shardings.params["lm_head"]["embedding"].spec[0] is None
    hlo = run.compile_train().as_text()
    assert "collective-permute" in hlo  # activations (and their gradients) passed stage to stage
    assert bubble(4, 4) == pytest.approx(3 / 7)


@pytest.mark.parametrize("layers", [(), ("--model.n_layer", "6")], ids=["8layers", "6layers-padded"])
def test_checkpoints_restore_across_pipeline_sizes_and_to_none(tmp_path, layers):
    """8 layers split by layers over 4 stages; 6 stored whole, split by d_model (3 a stage over 2)."""
    source = _build((*layers, "--mesh.pipeline", "4", "--mesh.data", "2"), 8)
    state = source.init_state()
    state = state.replace(params=jax.tree.map(lambda x: x + 0.25, state.params))  # not the init
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    ckpt.save(3, state, {"step": 3, "config": {}})
    ckpt.wait()
    saved = jax.tree.leaves(jax.device_get(state))
    reader = Checkpointer(tmp_path / "ckpt", keep=2, read_only=True)
    other = ("--mesh.pipeline", "2", "--mesh.fsdp", "2", "--mesh.tensor", "2", "--mesh.data", "1")
    for argv, devices in ((other, 8), ((), 1)):
        target = _build((*layers, *argv), devices).target
        restored = jax.tree.leaves(jax.device_get(reader.restore(3, target)))
        assert all(np.array_equal(a, b) for a, b in zip(saved, restored, strict=True)), argv
    ckpt.close()


def test_a_layer_count_the_stages_cannot_take_is_one_line():
    load_config([*LLAMA, "--mesh.pipeline", "3"])  # 8 layers over 3 stages: 3, 3 and 2 (padded)
    with pytest.raises(
        ConfigError, match=r"mesh.pipeline 16 is more stages than model.n_layer 8 .* at most 8$"
    ):
        load_config([*LLAMA, "--mesh.pipeline", "16"])
    with pytest.raises(ConfigError, match="set model.scan_layers true"):
        load_config([*LLAMA, "--model.scan_layers", "false", "--mesh.pipeline", "2"])
    both = ["--mesh.pipeline", "2", "--mesh.context", "2", "--mesh.tensor", "2", "--mesh.data", "1"]
    with pytest.raises(
        ConfigError, match=r"SPMD partitioner aborts .* not both: e.g. --mesh.context 1 --mesh.fsdp 2$"
    ):
        load_config([*LLAMA, *both])  # before: XLA's 'Check failed', the process aborted (exit 134)
    nearest = load_config([*LLAMA, *both[:2], "--mesh.tensor", "2", "--mesh.data", "1", "--mesh.fsdp", "2"])
    assert (nearest.mesh.pipeline, nearest.mesh.tensor, nearest.mesh.fsdp) == (2, 2, 2)  # what it names loads
    deepseek = ["--config", "configs/deepseek_tiny.yaml", "--model.scan_layers", "true"]  # 1 dense + 2 MoE
    load_config([*deepseek, "--mesh.pipeline", "2"])
    with pytest.raises(
        ConfigError, match=r"pipeline 4 .* model.n_layer 3 less moe.first_dense 1 .* at most 2$"
    ):
        load_config([*deepseek, "--mesh.pipeline", "4"])


def _lowered(argv: tuple[str, ...], manual_axes=None) -> tuple[str, str]:
    """The train and eval steps of LLAMA with `argv` on 8 devices, lowered (StableHLO text), with
    the steps manual over `manual_axes(mesh)` in place of parallel/mesh.py's when given."""
    with pytest.MonkeyPatch.context() as patch:  # the eval step takes its axes when built
        if manual_axes is None:
            run = _build(argv, 8)
        else:
            patch.setattr(mesh_lib, "manual_axes", manual_axes)
            run = build(Job.of_devices(load_config([*LLAMA, *argv]), jax.devices()))
        train = run.train_step.lower(run.target, run.batch_shape).as_text()
        return train, run.eval_step.lower(run.target.params, run.batch_shape).as_text()


def test_without_a_pipeline_the_step_is_the_program_it_was():
    """Pipeline 1 (every mesh before pipelines) lowers the very program of a step manual over the
    batch axes alone, as every step was before pipelines (parallel/mesh.py `manual_axes`): the
    whole StableHLO text of the train and eval steps compared, not a line of it."""
    data = ("--mesh.data", "2", "--mesh.fsdp", "4", "--gradient_accumulation_steps", "1")
    real = _lowered(data)
    assert real == _lowered(data, lambda mesh: set(mesh_lib.BATCH_AXES))
    # The comparison sees the pipeline leak in: manual over its 1 stage too is another program as
    # lowered (XLA:CPU compiles the two alike, measured: the guard is on what the step emits).
    leaked = _lowered(data, lambda mesh: {*mesh_lib.BATCH_AXES, mesh_lib.PIPELINE_AXIS})
    assert real[0] != leaked[0] and real[1] != leaked[1]
    # Nor does the schedule run: no stage hands activations on, where 4 stages do (ppermute).
    assert "collective_permute" in _lowered(("--mesh.pipeline", "4", "--mesh.data", "2"))[0]
    for text in real:
        assert "collective_permute" not in text
        # No param nor activation split over the axis: it is named in the mesh's declaration only.
        named = [line for line in text.splitlines() if "pipeline" in line]
        assert len(named) == 1 and named[0].lstrip().startswith('sdy.mesh @mesh = <["pipeline"=1,'), named
