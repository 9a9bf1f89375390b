"""Context parallelism: sequences split over the `context` mesh axis train as on one device
(attention re-splits them by heads: jaxtrain/parallel/context.py `per_device`), composed with data,
fsdp and tensor, with grouped-query heads fewer than the split, and with documents masked.

    pytest tests/test_context.py
"""

import re

import jax
import numpy as np
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.run.build import build
from jaxtrain.run.job import Job

# A tiny Llama: 4 query heads over 2 key/value heads, so context 4 repeats each key/value head.
LLAMA = [
    "--config", "configs/tiny.yaml", "--optim.warmup_steps", "0", "--model.n_head", "4",
    "--model.mlp", "swiglu", "--model.n_kv_head", "2", "--batch_size", "8",
]  # fmt: skip
STEPS = 3


def _train(argv: list[str], devices: list, docs: bool) -> tuple[np.ndarray, dict, int, int]:
    """(losses, params, state bytes a device, all-to-alls in the compiled step)."""
    run = build(Job.of_devices(load_config(LLAMA + argv), devices))
    state = run.init_state()
    rows = np.random.default_rng(0).integers(3, 256, (8, run.cfg.model.seq_len + 1), dtype=np.int32)
    if docs:
        rows[:, ::7] = 1  # documents of 7 tokens, each starting with token 1 (--model.doc_bos 1)
    losses = []
    for _ in range(STEPS):
        state, metrics = run.train_step(state, mesh_lib.global_batch(rows, run.mesh, 8))
        losses.append(float(metrics["loss"]))
    text = run.compile_train().as_text()  # the program just run (the compile cache has it)
    exchanges = len(re.findall(r" all-to-all(?:-start)?\(", text))
    return np.array(losses), jax.device_get(state.params), run.state_bytes_per_device, exchanges


@pytest.mark.parametrize(
    ("mesh", "docs"),
    [
        (["--mesh.context", "4", "--mesh.data", "2", "--model.token_chunks", "2"], False),
        (["--mesh.context", "2", "--mesh.fsdp", "2", "--mesh.tensor", "2", "--mesh.data", "1"], True),
    ],
    ids=["context4xdata2-token_chunks2", "context2xfsdp2xtensor2-documents"],
)
def test_sequences_split_over_context_train_as_on_one_device(mesh, docs):
    masked = ["--model.doc_bos", "1"] if docs else []
    one_losses, one_params, one_bytes, _ = _train(masked, jax.devices()[:1], docs)
    losses, params, state_bytes, exchanges = _train([*masked, *mesh], jax.devices(), docs)
    # Each sequence is split over context: attention makes it whole by heads and back, an
    # all-to-all each for q, k, v and the output a layer, forward and backward (parallel/context.py).
    assert exchanges >= 8 * 2, exchanges  # 2 layers
    # The state is split over fsdp x context (ZeRO over context), not held by each context peer:
    # 4 ways here, less the norm scales and the vectors too small to split.
    assert state_bytes < 0.3 * one_bytes, (state_bytes, one_bytes)
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    # atol 1e-4 (the learning rate is 3e-3): Adam's first steps move a param whose gradient is
    # near 0 by up to the learning rate whatever its sign, so float32 noise in such a gradient
    # (attention summed in another order) moves it so: 1 of 16,384 params, 7e-5, once seen.
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


def test_a_window_or_heads_context_cannot_split_are_one_line_errors():
    with pytest.raises(ConfigError, match="model.seq_len 32 is not divisible by mesh.context 3"):
        load_config([*LLAMA, "--mesh.context", "3"])
    with pytest.raises(
        ConfigError, match="model.n_head 4 is not divisible by mesh.context x mesh.tensor = 8"
    ):
        load_config([*LLAMA, "--mesh.context", "4", "--mesh.tensor", "2"])
