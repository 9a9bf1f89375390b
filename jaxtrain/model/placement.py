"""What a model is given to run split over devices: the hooks it calls at the few points where a
split model computes differently from one device.

The model names logical axes (`layers.constrain`, `params.PARAM_AXES`) and nothing more: it runs no
collective, reads no mesh and names no mesh axis (tests/test_layout.py). The step makes a Placement
for its mesh (parallel/placement.py) and gives it to the model; without one (`Placement()`: init,
generation, tests of the math) every hook is absent and the model runs as on one device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# gather(variables, where=module name) -> the variables a layer computes with
Gather = Callable[..., Any]


@dataclass(frozen=True)
class Placement:
    # fsdp: each layer's (and embedding's) params, whole, right before it uses them (parallel/fsdp.py)
    gather: Gather | None = None
    # A scanned stack's params before its layers run (parallel/fsdp.py `whole_experts`)
    stack_in: Gather | None = None
    # attend(kernel, q, k, v, segments, impl) -> kernel's output, run on each device's own rows and
    # heads, whole sequences where context splits them (parallel/context.py)
    attend: Callable[..., Any] | None = None
    # experts(rows, gates, experts, w_in, w_out, wire, capacity_factor, recomputed, fp8_weights) ->
    # (each piece's outputs, share dropped):
    # a mixture of experts' routed rows to wherever their experts are (parallel/expert.py)
    experts: Callable[..., Any] | None = None
    # nodes(tokens, weights, experts, w_in, w_out, wire, capacity_factor, recomputed, fp8_weights),
    # each in pieces -> (each piece's routed output, share dropped): the same, by the two-hop
    # exchange over nodes (parallel/expert.py `two_hops`, mesh.expert_node); in place of `experts`
    nodes: Callable[..., Any] | None = None
    expert_split: int = 1  # devices a layer's experts are split over: each declares its share
    length_split: int = 1  # devices each sequence is split over (pieces of a sequence: layers.to_pieces)
    # Devices tensor parallelism splits the `tensor_axes` logical axes over: model.matmul fp8 scales
    # an activation or gradient cut along one of them one block a device (model/fp8.py tensor_blocks)
    tensor_split: int = 1
    tensor_axes: frozenset[str] = frozenset()


LOCAL = Placement()  # as on one device
