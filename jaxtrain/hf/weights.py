"""Every Hugging Face tensor name and where it sits in our params: one table, read both ways.

Our kernels are [in..., out...] with heads apart ([d, N, H]); torch's Linear weights are
[out, in] with heads flattened. Fused params split into several HF tensors: qkv [d, 3, N, H]
into q/k/v_proj, kv [d, 2, K, H] into k/v_proj, gate_up [d, 2, ff] into gate/up_proj. A mixture
of experts' stacked experts ([E, d, 2, ff], [E, ff, d]) into one tensor per expert, as Mixtral
(block_sparse_moe.experts.j.w1/w3/w2) and the others (mlp.experts.j.gate/up/down_proj) save them;
transformers 5 saves its fused 3-D experts in that layout too. Rotary positions need no
permutation: ours rotate contiguous halves (rotate_half), as HF's do, and MLA's interleaved pairs
are rotated in place (model/mla.py rope_interleave).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxtrain.config import ModelConfig
from jaxtrain.model.moe import is_moe_layer


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str  # the Hugging Face tensor name
    path: tuple[str, ...]  # our param's path
    layer: int | None  # index into a scanned stack (leading axis), else None
    part: tuple[int, int] | None  # (axis, index) of a fused param, counted in one layer's view
    kind: str  # same | flat | in ([d, *out] <-> [out, d]) | out ([*in, d] <-> [d, in])
    expert: int | None = None  # index into a stack of experts (after any layer axis), else None


_Row = tuple[str, tuple[str, ...], tuple[int, int] | None, str, int | None]
_Part = tuple[str, tuple[str, ...], tuple[int, int] | None, str]  # a _Row without its expert


def _experts(cfg: ModelConfig) -> list[_Row]:
    """A mixture of experts' MLP: the router (and its bias), each expert's three matrices, then the
    shared experts (and their gate)."""
    mixtral = not (cfg.qk_norm or cfg.qkv_bias or cfg.mla)  # hf/moe.py moe_architecture
    where, names = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", _SWIGLU)
    out: list[_Row] = [(f"{where}.gate.weight", ("moe", "router", "kernel"), None, "in", None)]
    if cfg.moe.router == "sigmoid":
        out.append((f"{where}.gate.e_score_correction_bias", ("moe", "router_bias"), None, "flat", None))
    for j in range(cfg.moe.n_experts):
        gate, up, down = (f"{where}.experts.{j}.{name}.weight" for name in names)
        out.append((gate, ("moe", "gate_up", "kernel"), (1, 0), "in", j))
        out.append((up, ("moe", "gate_up", "kernel"), (1, 1), "in", j))
        out.append((down, ("moe", "out", "kernel"), None, "out", j))
    if cfg.moe.n_shared_experts:
        shared = "mlp.shared_experts" if cfg.mla else "mlp.shared_expert"  # DeepSeek-V3, Qwen2-MoE
        out += [(*row, None) for row in _mlp(shared, ("moe", "shared_"))]
    if cfg.moe.shared_gate:
        out.append(("mlp.shared_expert_gate.weight", ("moe", "shared_gate", "kernel"), None, "in", None))
    return out


_SWIGLU = ("gate_proj", "up_proj", "down_proj")


def _mlp(where: str, path: tuple[str, ...]) -> list[_Part]:
    """A SwiGLU MLP (model/mlp.py): gate and up from one [d, 2, ff] kernel, then down; path's last
    name is the params' prefix ("mlp", "" for a block's; "moe", "shared_" for shared experts)."""
    gate, up, down = (f"{where}.{name}.weight" for name in _SWIGLU)
    return [
        (gate, (*path[:-1], f"{path[-1]}gate_up", "kernel"), (1, 0), "in"),
        (up, (*path[:-1], f"{path[-1]}gate_up", "kernel"), (1, 1), "in"),
        (down, (*path[:-1], f"{path[-1]}out", "kernel"), None, "out"),
    ]


def _latent_attention(cfg: ModelConfig) -> list[_Part]:
    """DeepSeek's multi-head latent attention (model/mla.py), as transformers' DeepseekV3 names it."""
    q: list[_Part]
    if cfg.q_lora_rank:
        q = [
            ("self_attn.q_a_proj.weight", ("attn", "q_a", "kernel"), None, "in"),
            ("self_attn.q_a_layernorm.weight", ("attn", "q_a_norm", "scale"), None, "flat"),
            ("self_attn.q_b_proj.weight", ("attn", "q_b", "kernel"), None, "in"),
        ]
    else:
        q = [("self_attn.q_proj.weight", ("attn", "q", "kernel"), None, "in")]
    return q + [
        ("self_attn.kv_a_proj_with_mqa.weight", ("attn", "kv_a", "kernel"), None, "in"),
        ("self_attn.kv_a_layernorm.weight", ("attn", "kv_a_norm", "scale"), None, "flat"),
        ("self_attn.kv_b_proj.weight", ("attn", "kv_b", "kernel"), None, "in"),
    ]


def _layer(cfg: ModelConfig, moe: bool) -> list[_Row]:
    """(HF name after model.layers.i., our path inside the block, part, kind, expert) for one layer."""
    out: list[_Part] = [
        ("input_layernorm.weight", ("ln_1", "scale"), None, "flat"),
        ("post_attention_layernorm.weight", ("ln_2", "scale"), None, "flat"),
    ]
    if cfg.mla:
        out += _latent_attention(cfg)
    elif cfg.kv_heads == cfg.n_head:
        out += _projections(cfg, [("q", "qkv", 0), ("k", "qkv", 1), ("v", "qkv", 2)])
    else:
        out += _projections(cfg, [("q", "q", -1), ("k", "kv", 0), ("v", "kv", 1)])
    out.append(("self_attn.o_proj.weight", ("attn", "out", "kernel"), None, "out"))
    if cfg.qk_norm:
        out.append(("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), None, "flat"))
        out.append(("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), None, "flat"))
    if not moe:
        out += _mlp("mlp", ("mlp", ""))
    return [(*row, None) for row in out] + (_experts(cfg) if moe else [])


def _projections(cfg: ModelConfig, qkv: list[tuple[str, str, int]]) -> list[_Part]:
    """q/k/v_proj (and their biases) from our fused qkv, or q and kv, kernels."""
    out: list[_Part] = []
    for x, module, i in qkv:
        w_part, b_part = ((1, i), (0, i)) if i >= 0 else (None, None)
        out.append((f"self_attn.{x}_proj.weight", ("attn", module, "kernel"), w_part, "in"))
        if cfg.qkv_bias:
            out.append((f"self_attn.{x}_proj.bias", ("attn", module, "bias"), b_part, "flat"))
    return out


def entries(cfg: ModelConfig) -> list[Entry]:
    """Every HF tensor of the model, in the order Hugging Face writes them."""
    out = [Entry("model.embed_tokens.weight", ("wte", "embedding"), None, None, "same")]
    for i in range(cfg.n_layer):
        block, layer = (f"block_{i}",), None
        if cfg.scan_layers:  # model/transformer.py scanned_stacks: the first dense ones apart
            dense = cfg.moe.first_dense if cfg.moe.n_experts else 0
            block, layer = (("blocks_dense",), i) if i < dense else (("blocks",), i - dense)
        for name, path, part, kind, expert in _layer(cfg, is_moe_layer(cfg, i)):
            out.append(Entry(f"model.layers.{i}.{name}", block + path, layer, part, kind, expert))
    out.append(Entry("model.norm.weight", ("ln_f", "scale"), None, None, "flat"))
    if not cfg.tie_embeddings:
        out.append(Entry("lm_head.weight", ("lm_head", "embedding"), None, None, "same"))
    return out


def _index(e: Entry, ndim: int) -> tuple[int | slice, ...]:
    """Where in our leaf (ndim dims) the entry's tensor sits."""
    index: list[int | slice] = [slice(None)] * ndim
    offset = 0
    if e.layer is not None:
        index[0], offset = e.layer, 1
    if e.expert is not None:
        index[offset], offset = e.expert, offset + 1
    if e.part is not None:
        index[offset + e.part[0]] = e.part[1]
    return tuple(index)


def hf_shape(e: Entry, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's shape, from our leaf's."""
    index = _index(e, len(leaf_shape))
    view = tuple(n for n, i in zip(leaf_shape, index, strict=True) if isinstance(i, slice))
    kind = e.kind
    if kind == "in":
        return (math.prod(view[1:]), view[0])
    if kind == "out":
        return (view[-1], math.prod(view[:-1]))
    if kind == "flat":
        return (math.prod(view),)
    return view


def to_hf(e: Entry, leaf: np.ndarray) -> np.ndarray:
    """The entry's HF tensor (contiguous) from our whole leaf."""
    x = leaf[_index(e, leaf.ndim)]
    if e.kind == "in":
        x = x.reshape(x.shape[0], -1).T
    elif e.kind == "out":
        x = x.reshape(-1, x.shape[-1]).T
    elif e.kind == "flat":
        x = x.reshape(-1)
    return np.ascontiguousarray(x)


def put(e: Entry, leaf: np.ndarray, tensor: np.ndarray) -> None:
    """Write the entry's HF tensor into our leaf, in place."""
    index = _index(e, leaf.ndim)
    view_shape = leaf[index].shape
    if e.kind in ("in", "out"):
        tensor = tensor.T
    leaf[index] = np.asarray(tensor).reshape(view_shape)
