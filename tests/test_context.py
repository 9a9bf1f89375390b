"""Context parallelism: sequences split over the `context` mesh axis train as on one device
(attention re-splits them by heads: jaxtrain/parallel/context.py `per_device`), composed with data,
fsdp and tensor, with grouped-query heads fewer than the split, and with documents masked.

    pytest tests/test_context.py
"""

import jax
import numpy as np
import pytest
from shared import LLAMA, train_llama

from jaxtrain.config import ConfigError, load_config


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
    one_losses, one_params, one_bytes, _ = train_llama(masked, jax.devices()[:1], docs)
    losses, params, state_bytes, exchanges = train_llama([*masked, *mesh], jax.devices(), docs)
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
