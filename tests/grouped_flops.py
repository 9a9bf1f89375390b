"""The matmul FLOPs of one MoE layer's train step (forward and backward), compiled for 8 H100 with
the CUDA plugin and counted as the planner counts them, against the active FLOPs.

    .venv/bin/python tests/grouped_flops.py [IMPL]     # JSON {case: {compiled, fp8, active, experts}}

One layer (jaxtrain/model/moe.py MoeMlp, dropless) under expert parallelism, 4096 tokens a device;
the active FLOPs are the router's (float32, 6 x tokens x d x E) and the routed copies' SwiGLU
experts' (18 x tokens x k x d x ff: `experts`); `fp8`, those the planner costs at the FP8 peak.
IMPL: a model.moe.grouped_matmul (default: H100's default); the case `qwen3_expert8_fp8` runs
Qwen3's with `pallas_fp8` (the kernels on FP8 tiles: model/grouped_fp8.py) whatever IMPL, under
remat as Qwen3's config (the experts' forward twice: `experts` counts it).
"""

import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxtrain.plan import targets  # noqa: E402

targets.use_plugin()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxtrain.config.schema import ModelConfig, MoeConfig  # noqa: E402
from jaxtrain.model.moe import MoeMlp  # noqa: E402
from jaxtrain.model.placement import Placement  # noqa: E402
from jaxtrain.parallel import expert  # noqa: E402
from jaxtrain.plan import compiled, hlo, schedule  # noqa: E402
from jaxtrain.run import kernels  # noqa: E402

TOKENS = 4096  # per device
# case -> (experts, per token, d_model, d_expert, mesh.expert): Mixtral-8x7B's experts one and two
# a GPU, Qwen3-30B-A3B's sixteen.
CASES = {
    "mixtral_expert8": (8, 2, 4096, 14336, 8),
    "mixtral_expert4": (8, 2, 4096, 14336, 4),
    "qwen3_expert8": (128, 8, 2048, 768, 8),
}


def flops(
    impl: str, n_experts: int, k: int, d: int, ff: int, ep: int, remat: str = "none"
) -> dict[str, float]:
    moe = MoeConfig(n_experts=n_experts, experts_per_token=k, d_expert=ff, grouped_matmul=impl)
    # The step's placement of the experts: exchanged over `expert` (parallel/expert.py).
    placement = Placement(experts=functools.partial(expert.experts, ep=ep), expert_split=ep)
    model = MoeMlp(ModelConfig(d_model=d, mlp="swiglu", moe=moe, remat=remat), jnp.bfloat16, placement)
    mesh = Mesh(np.array(targets.target_devices(targets.get("h100"), 1, 8)[:ep]), ("expert",))
    rules = [("expert", "expert")]

    def init(x):  # type: ignore[no-untyped-def]
        with nn.logical_axis_rules(rules):
            return model.init(jax.random.key(0), x)["params"]

    def loss(params, x):  # type: ignore[no-untyped-def]
        with nn.logical_axis_rules(rules):
            y, _ = model.apply({"params": params}, x, mutable=["moe"])
        return jnp.sum(y.astype(jnp.float32) ** 2)

    x = jax.ShapeDtypeStruct((ep, TOKENS, d), jnp.bfloat16)
    # Each device's experts as its own params (P() over the manual axis: local shapes).
    params = jax.eval_shape(
        jax.shard_map(init, mesh=mesh, in_specs=P("expert"), out_specs=P(), check_vma=False), x
    )
    step = jax.shard_map(
        jax.grad(loss, argnums=(0, 1)),
        mesh=mesh,
        in_specs=(P(), P("expert")),
        out_specs=(P(), P("expert")),
        check_vma=False,
    )
    text = jax.jit(step).lower(params, x).compile().as_text()
    layout = hlo.Placement(("expert",), (ep,), [0] * ep)
    tally = compiled._Walker(text, layout).tally()  # as the planner tallies a step
    # Under remat the routed block's own backward (model/moe.py `_routed`) runs the experts' forward again
    experts = (24.0 if remat != "none" else 18.0) * TOKENS * k * d * ff
    active = 6.0 * TOKENS * d * n_experts + experts
    return {
        "compiled": tally.flops, "fp8": tally.fp8_flops, "active": active, "experts": experts,
        "kinds": by_kind(schedule.trace(text, layout)),
    }  # fmt: skip


def by_kind(events: list, times: int = 1) -> dict[str, float]:
    """The FLOPs of a schedule's ops (plan/schedule.py's events, loops by their trips) by their kind:
    the peak the bound and the forecast cost them at."""
    out: dict[str, float] = {}
    for event in events:
        inner = {}
        if event[0] == "loop":
            inner = by_kind(event[2], times * event[1])
        elif event[0] == "op" and event[2]:
            inner = {event[1]: float(event[2]) * event[6] * times}
        for kind, flops in inner.items():
            out[kind] = out.get(kind, 0.0) + flops
    return out


if __name__ == "__main__":
    device = targets.target_devices(targets.get("h100"), 1, 8)[0]  # as the step picks: by its devices
    mixtral = ModelConfig(
        d_model=4096, mlp="swiglu", moe=MoeConfig(n_experts=8, d_expert=14336)
    )  # as every case
    impl = (
        sys.argv[1]
        if len(sys.argv) > 1
        else kernels.grouped_matmul(mixtral, device.platform, device.compute_capability)
    )
    counted = {case: flops(impl, *shape) for case, shape in CASES.items()}
    # As Qwen3's config runs it (remat dots: the routed block's own backward, the copies sent to the
    # experts rounded to e4m3: model/moe.py `Wire.rows_out`)
    counted["qwen3_expert8_fp8"] = flops("pallas_fp8", *CASES["qwen3_expert8"], remat="dots")
    print(json.dumps(counted))
