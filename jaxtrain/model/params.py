"""What the model's params are called and how they are laid out: logical axes by path, names, counts."""

from __future__ import annotations

import math
from typing import Any

import jax

# Logical axes of every param, by the end of its path; jaxtrain/parallel/mesh.py maps them to mesh axes.
# Attention kernels keep (heads, head_dim) apart so tensor parallelism splits whole heads.
# Grouped-query attention keeps q ([d, heads, head_dim]) apart from k and v ([d, 2, kv heads,
# head_dim]); both head axes are `heads`, so tensor parallelism splits whole groups.
PARAM_AXES: dict[tuple[str, ...], tuple[str | None, ...]] = {
    ("wte", "embedding"): ("vocab", "embed"),
    ("lm_head", "embedding"): ("vocab", "embed"),  # untied output head, laid out as wte
    ("wpe", "embedding"): (None, "embed"),
    ("attn", "qkv", "kernel"): ("embed", None, "heads", None),
    ("attn", "qkv", "bias"): (None, "heads", None),
    ("attn", "q", "kernel"): ("embed", "heads", None),
    ("attn", "q", "bias"): ("heads", None),
    ("attn", "kv", "kernel"): ("embed", None, "heads", None),
    ("attn", "kv", "bias"): (None, "heads", None),
    ("attn", "out", "kernel"): ("heads", None, "embed"),
    # Multi-head latent attention (model/mla.py): the latents whole, the heads from them split (and
    # their latent dim over fsdp: parallel/mesh.py PARAM_RULES).
    ("attn", "q_a", "kernel"): ("embed", None),
    ("attn", "q_b", "kernel"): ("latent", "heads", None),
    ("attn", "kv_a", "kernel"): ("embed", None),
    ("attn", "kv_b", "kernel"): ("latent", "heads", None),
    ("mlp", "fc", "kernel"): ("embed", "mlp"),
    ("mlp", "gate_up", "kernel"): ("embed", None, "mlp"),
    ("mlp", "out", "kernel"): ("mlp", "embed"),
    # Mixture of experts (model/moe.py): each expert's matrices stacked on a leading `expert` axis.
    ("moe", "router", "kernel"): ("embed", None),
    ("moe", "gate_up", "kernel"): ("expert", "embed", None, "mlp"),
    ("moe", "fc", "kernel"): ("expert", "embed", "mlp"),
    ("moe", "out", "kernel"): ("expert", "mlp", "embed"),
    ("moe", "router_bias"): (None,),
    ("moe", "shared_gate_up", "kernel"): ("embed", None, "mlp"),
    ("moe", "shared_fc", "kernel"): ("embed", "mlp"),
    ("moe", "shared_out", "kernel"): ("mlp", "embed"),
    ("moe", "shared_gate", "kernel"): ("embed", None),
    ("scale",): (None,),  # norm scales: small, replicated
}


def param_axes(params: Any) -> Any:
    """Logical axes of every leaf of a param tree; a scanned stack gets a leading `layers` axis."""

    return jax.tree_util.tree_map_with_path(lambda path, leaf: logical_axes(path, len(leaf.shape)), params)


def path_names(path: tuple) -> tuple[str, ...]:
    """A tree path's keys as names: ("block_0", "attn", "qkv", "kernel"); optax states' attribute
    names (`mu`, `nu`) and sequence indices too."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def logical_axes(path: tuple, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the param at `path` (tree path keys); the first PARAM_AXES suffix wins. A
    scanned stack's layer dim is `layers` (split over `pipeline`), but `stack` for a mixture of
    experts' dense first layers (`blocks_dense`), which a pipeline's first stage runs whole
    (parallel/pipeline.py)."""
    names = path_names(path)
    lead = "stack" if "blocks_dense" in names else "layers"
    for suffix, logical in PARAM_AXES.items():
        if names[-len(suffix) :] == suffix:
            return (lead,) * (ndim - len(logical)) + logical
    raise KeyError(
        f"no logical axes for param {'/'.join(names)}; add it to jaxtrain/model/params.py PARAM_AXES"
    )


def param_count(params: Any) -> int:
    """Number of scalars in a param tree (arrays or jax.eval_shape structs)."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def param_summary(params: Any) -> str:
    """Parameters per module, one line each; identical consecutive blocks share a line:

    wte                       32,768
    block_0..3 (each)         attn 65,536, mlp 131,072, ln_1 128, ln_2 128
    ln_f                      128
    """
    modules: dict[str, dict[str, int]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = path_names(path)
        parts = modules.setdefault(names[0], {})
        part = names[1] if names[0].startswith("block") and len(names) > 2 else ""
        parts[part] = parts.get(part, 0) + math.prod(leaf.shape)
    rows: list[list[Any]] = []  # [label, parts, first block, last block]

    def order(name: str) -> tuple[int, int, str]:  # embeddings, blocks by number, final norm
        block = name.startswith("block")
        first = "" if name == "blocks_dense" else name  # a scanned model's dense layers come first
        return (1 if block else 2 if name == "ln_f" else 0, int(name[6:]) if name[6:].isdigit() else 0, first)

    for name, parts in sorted(modules.items(), key=lambda item: order(item[0])):
        index = int(name[6:]) if name.startswith("block_") else -1
        if index > 0 and rows and rows[-1][1] == parts and rows[-1][3] == index - 1:
            rows[-1][0], rows[-1][3] = f"block_{rows[-1][2]}..{index} (each)", index
            continue
        label = name
        if name.startswith("blocks"):  # scanned: each leaf stacks every layer (of its stack)
            label = f"{name} ({jax.tree.leaves(params[name])[0].shape[0]} layers)"
        rows.append([label, parts, index, index])
    return "\n".join(
        f"  {label:<24}  " + ", ".join(f"{part} {n:,}".strip() for part, n in parts.items())
        for label, parts, _, _ in rows
    )
