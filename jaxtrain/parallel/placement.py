"""A model placed on a mesh: how its params and batches sit on the devices, as the inside of the
step's shard_map sees them, and the hooks (model/placement.py) that run the model there.

    layout = Layout(mesh, param_specs, dtype, reduce_dtype, zero1, expert_node)
    model = layout.place(model)        # the model with its Placement for this mesh
    with nn.logical_axis_rules(layout.rules): ...

The step is manual over the batch axes (data, expert, fsdp; `pipeline` too when it has stages) and
leaves `tensor` and `context` to the compiler, guided by the model's logical constraints
(`rules`: parallel/mesh.py).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxtrain.model.placement import Placement
from jaxtrain.model.transformer import GPT
from jaxtrain.parallel import context, data, expert, fsdp
from jaxtrain.parallel import mesh as mesh_lib


class Layout:
    """How params sit on `mesh` inside the step (`param_specs`: their specs, whole over data),
    computed in `dtype`, their gradients reduced in `reduce_dtype` (default `dtype`); `zero1`: the
    params come split over data (mesh_lib.state_specs); `expert_node`: the expert exchange goes in
    two hops, between nodes of this many expert devices, then inside them (mesh.expert_node)."""

    def __init__(
        self,
        mesh: Mesh,
        param_specs: Any,
        dtype: Any = jnp.float32,
        reduce_dtype: Any = None,
        zero1: bool = False,
        expert_node: int = 0,
    ) -> None:
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        self.manual = jax.tree.map(mesh_lib.manual_part, param_specs, is_leaf=is_spec)
        self.sizes = {a: int(mesh.shape[a]) for a in mesh_lib.BATCH_AXES}
        self.stages = int(mesh.shape[mesh_lib.PIPELINE_AXIS])  # > 1: parallel/pipeline.py's schedule
        self.rules = mesh_lib.activation_rules(mesh)
        self.batch = data.Shards(self.sizes, self.manual)
        # ZeRO-1 keeps the params split over data (mesh_lib.state_specs): the step gathers them
        # once, its weights in the compute dtype (`compute_params`); a pipeline casts its own.
        gathers_once = zero1 and self.sizes[mesh_lib.DATA_AXIS] > 1 and self.stages == 1
        reduce_dtype = dtype if reduce_dtype is None else reduce_dtype
        self.fsdp = fsdp.Fsdp(param_specs, dtype, reduce_dtype, gathers_once)
        # Params split over fsdp, or dense ones over expert (mesh_lib.param_spec): layers gather them.
        self.gathers = any(mesh.shape[a] > 1 for a in (mesh_lib.FSDP_AXIS, mesh_lib.EXPERT_AXIS))
        self.expert_split = int(mesh.shape[mesh_lib.EXPERT_AXIS])
        self.expert_node = expert_node if 1 < expert_node < self.expert_split else 0
        context_size = int(mesh.shape[mesh_lib.CONTEXT_AXIS])
        self.length_split = context_size if context_size > 1 else 1  # mesh_lib.CONTEXT_RULES
        self.tensor_split = int(mesh.shape[mesh_lib.TENSOR_AXIS])

    def place(self, model: GPT) -> GPT:
        """`model` placed on the mesh: its layers gathered a layer at a time (fsdp), its attention
        kernel run per device (context), its experts exchanged (expert)."""
        moe = model.cfg.moe.n_experts > 0
        # The experts' FP8 kernels (settled by the job: run/kernels.py) take their weights gathered as FP8
        fp8_experts = moe and model.cfg.moe.grouped_matmul == "pallas_fp8"
        placement = Placement(
            gather=self.fsdp.gather_for(model.cfg.matmul, fp8_experts) if self.gathers else None,
            stack_in=self.fsdp.stack_in_for(model.cfg.matmul, moe, fp8_experts),
            attend=context.attend,
            experts=functools.partial(expert.experts, ep=self.expert_split),
            nodes=(
                functools.partial(
                    expert.two_hops,
                    ep=self.expert_split,
                    node=self.expert_node,
                    reach=expert.node_reach(model.cfg.moe, self.expert_split // self.expert_node),
                )
                if self.expert_node
                else None
            ),
            expert_split=self.expert_split,
            length_split=self.length_split,
            tensor_split=self.tensor_split,
            tensor_axes=frozenset(
                name for name, axis in mesh_lib.ACTIVATION_RULES if axis == mesh_lib.TENSOR_AXIS
            ),
        )
        return model.clone(placement=placement)
