"""Model and run set-up that several test files share (no tests here):

    from shared import MOE, MESHES, train_run, LLAMA, train_llama, bitwise_same_end

(pytest puts tests/ on sys.path, so the test files import this module by its bare name. It
imports jax: conftest.py, which must set the environment first, imports only processes.py.)
"""

import re
from pathlib import Path

import jax
import numpy as np
from processes import logged_losses

from jaxtrain.config import load_config
from jaxtrain.disk.checkpoint import Checkpointer
from jaxtrain.model.transformer import GPT
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.run.build import build
from jaxtrain.run.job import Job
from jaxtrain.run.optim import make_optimizer
from jaxtrain.run.state import abstract_state

# tests/test_moe.py's model (and tests/test_deepseek.py's meshes): tests/test_sharding.py's tiny
# model with SwiGLU experts: 8 of them, 2 per token, and a shared one every token passes through
# (split over tensor and fsdp like a dense MLP, replicated over expert); 4 heads so tensor 2 splits
# them. Clipping on: the global norm must agree across layouts.
MOE = [
    "--config", "configs/tiny.yaml", "--optim.warmup_steps", "0", "--model.n_head", "4",
    "--model.mlp", "swiglu", "--model.moe.n_experts", "8", "--model.moe.d_expert", "32",
    "--model.moe.n_shared_experts", "1", "--model.moe.z_loss_coef", "0.001",
]  # fmt: skip
MOE_STEPS = 20
DOTS = ["--model.remat", "dots"]
MESHES = {
    "expert4xdata2": ["--mesh.expert", "4", "--mesh.data", "2"],
    # expert laid inside fsdp (tests/test_deepseek.py trains the same sizes laid out as usual),
    # under remat dots (the exchange's own backward, `_routed`): Qwen3-30B-A3B's settings; each
    # device's 4 sequences in 2 groups through every block (model.moe.overlap_groups)
    "expert2_inside_fsdp2xtensor2": [
        "--mesh.expert", "2", "--mesh.fsdp", "2", "--mesh.tensor", "2", "--mesh.data", "1",
        "--mesh.expert_inner", "true", *DOTS, "--model.moe.overlap_groups", "2",
    ],
    # 2 nodes of 4 (issue 60's fake hosts): the two-hop exchange (parallel/expert.py `two_hops`)
    "expert8_in_nodes_of_4": ["--mesh.expert", "8", "--mesh.data", "1", "--mesh.expert_node", "4"],
}  # fmt: skip


def train_run(argv, n_devices, steps=MOE_STEPS, keep_starts=False, base=MOE):
    """The run built for `argv` on `n_devices` and `steps` steps of the `base` model (tests/
    test_moe.py's, tests/test_deepseek.py's): losses, last metrics, final params and the compiled
    step's HLO; each step's batch and metrics (and, keep_starts, its params)."""
    run = build(Job.of_devices(load_config(base + argv), jax.devices()[:n_devices]))
    cfg, mesh, state = run.cfg, run.mesh, run.init_state()
    compiled = run.compile_train()
    rng = np.random.default_rng(0)
    # Two batches in turn: random tokens, but seen again, so the loss must fall.
    batches = [
        rng.integers(0, 256, (cfg.batch_size, cfg.model.seq_len + 1), dtype=np.int32) for _ in range(2)
    ]
    losses, starts = [], []
    for i in range(steps):
        start = jax.device_get(state.params) if keep_starts else None  # before the step donates it
        state, m = compiled(state, mesh_lib.global_batch(batches[i % 2], mesh, cfg.batch_size))
        losses.append(float(m["loss"]))
        starts.append((start, batches[i % 2], m))
    return {
        "run": run,
        "losses": np.array(losses),
        "metrics": jax.device_get(m),
        "params": jax.device_get(state.params),
        "hlo": compiled.as_text(),
        "starts": starts,
    }


# tests/test_context.py's and tests/test_head.py's tiny Llama: 4 query heads over 2 key/value
# heads, so context 4 repeats each key/value head.
LLAMA = [
    "--config", "configs/tiny.yaml", "--optim.warmup_steps", "0", "--model.n_head", "4",
    "--model.mlp", "swiglu", "--model.n_kv_head", "2", "--batch_size", "8",
]  # fmt: skip
LLAMA_STEPS = 3


def train_llama(argv: list[str], devices: list, docs: bool) -> tuple[np.ndarray, dict, int, int]:
    """LLAMA with `argv` on `devices`, LLAMA_STEPS steps on one batch (documents of 7 tokens if
    `docs`): (losses, params, state bytes a device, all-to-alls in the compiled step)."""
    run = build(Job.of_devices(load_config(LLAMA + argv), devices))
    state = run.init_state()
    rows = np.random.default_rng(0).integers(3, 256, (8, run.cfg.model.seq_len + 1), dtype=np.int32)
    if docs:
        rows[:, ::7] = 1  # documents of 7 tokens, each starting with token 1 (--model.doc_bos 1)
    losses = []
    for _ in range(LLAMA_STEPS):
        state, metrics = run.train_step(state, mesh_lib.global_batch(rows, run.mesh, 8))
        losses.append(float(metrics["loss"]))
    text = run.compile_train().as_text()  # the program just run (the compile cache has it)
    exchanges = len(re.findall(r" all-to-all(?:-start)?\(", text))
    return np.array(losses), jax.device_get(state.params), run.state_bytes_per_device, exchanges


def final_state(run_dir: Path, step: int) -> list[np.ndarray]:
    """The saved train state of `step` in a scripts/train.py run dir, restored onto this test
    process's first device."""
    cfg = load_config(["--config", str(run_dir / "config.yaml")])
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = abstract_state(cfg, GPT(cfg.model), make_optimizer(cfg))
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), abstract)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=2, read_only=True)
    return jax.tree.leaves(jax.device_get(ckpt.restore(step, target)))


def bitwise_same_end(a: Path, b: Path, first: int, last: int) -> None:
    """Runs `a` and `b` logged the same losses, bit for bit, at steps first..last, and saved the
    same state at `last` (tests/test_faults.py's, tests/test_sharded_resume.py's)."""
    la, lb = logged_losses(a), logged_losses(b)
    assert all(la[s] == lb[s] for s in range(first, last + 1)), (la, lb)
    fa, fb = final_state(a, last), final_state(b, last)
    assert fa and all(np.array_equal(x, y) for x, y in zip(fa, fb, strict=True))
