"""The one train-state pytree, created shape-first so full params never sit on one device."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxtrain.config import Config
from jaxtrain.model.params import param_axes
from jaxtrain.model.transformer import GPT
from jaxtrain.parallel import mesh as mesh_lib

# float16 starts with a large loss scale and halves it on overflow (dynamic loss scaling).
FP16_INITIAL_SCALE = 2.0**15


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # optimizer steps taken; also the data position (global, topology-free)
    params: Any
    opt_state: Any
    loss_scale: jax.Array  # 1.0 unless dtype is float16
    good_steps: jax.Array  # finite steps since the loss scale last changed
    bad_steps: jax.Array  # consecutive non-finite steps (skipped)
    skipped_steps: jax.Array  # all non-finite steps so far


def init_state(cfg: Config, model: GPT, tx: optax.GradientTransformation, rng: jax.Array) -> TrainState:
    """A fresh state; pure, so it can be traced by eval_shape and jit."""
    tokens = jnp.zeros((1, cfg.model.seq_len), jnp.int32)
    params = _unsettled(model).init(rng, tokens)["params"]
    scale = FP16_INITIAL_SCALE if cfg.dtype == "float16" else 1.0
    zero = jnp.zeros((), jnp.int32)
    return TrainState(
        step=zero,
        params=params,
        opt_state=tx.init(params),
        loss_scale=jnp.asarray(scale, jnp.float32),
        good_steps=zero,
        bad_steps=zero,
        skipped_steps=zero,
    )


def _unsettled(model: GPT) -> GPT:
    """`model` with its kernels back at auto, which a model outside a step runs as on one device
    (XLA's attention, ragged_dot): its params, whatever kernels the step runs (run/kernels.py).
    cuDNN's kernel traced outside the step's placement would check its head size against this
    host's devices (a CPU, when the planner builds a GPU job)."""
    moe = dataclasses.replace(model.cfg.moe, grouped_matmul="auto")
    return model.clone(cfg=dataclasses.replace(model.cfg, attention_impl="auto", moe=moe))


def abstract_state(cfg: Config, model: GPT, tx: optax.GradientTransformation) -> TrainState:
    """Shapes and dtypes of the state, with no memory allocated."""
    return jax.eval_shape(lambda rng: init_state(cfg, model, tx, rng), jax.random.key(0))


def state_sharding(mesh: Mesh, abstract: TrainState, zero1: bool = False) -> Any:
    """NamedSharding of every leaf: params by their logical axes, moments like their params."""
    specs = mesh_lib.state_specs(abstract, param_axes(abstract.params), mesh, zero1)
    return mesh_lib.shardings(mesh, specs)
