"""The layouts a search may compile, and the order it compiles them in: meshes that can exist
(`layouts`), and each one's step time estimated from the model's shape, the batch and the
target's links, with no compile (`ranked`), with the memory it needs at least (`memory_floor`,
`first_fsdp`).

    order = candidates.ranked(cfg, candidates.layouts(cfg, devices, 8), devices, 8, targets.get("h100"))

A search's budget (16 compiles) covers a few of a 70B or 405B model's 50 to 70 layouts; compiled in
a fixed order (tensor largest first, ...), the ones we ship came too late to be tried (issue 47).
The estimate only orders the candidates: what a search reports is each compiled plan's forecast
(forecast.py). It counts what decides the order between layouts, at the datasheet's rates
(targets.py), under full remat (the search's first setting):
  compute       the model's FLOPs (6N + attention, the forward again under remat) over the devices,
                a pipeline's padding layers included;
  synchronous   tensor's all-reduces of each layer's activations and context's all-to-alls of its
                queries, keys, values and output: the next op waits for them; with compute,
                stretched by a pipeline's bubble (parallel/pipeline.py: `bubble`);
  overlapped    fsdp's gathers of every layer (forward, recompute) and its gradients' reduce-scatter,
                each microbatch, and the data axis's gradient reduction once a step, ring bytes as
                plan/hlo.py counts them, over the network where the group spans hosts; EXPOSED of it
                counted, the share a compiled schedule leaves waiting (docs/scaling.md: XLA starts a
                cross-host gather about one matmul before its use).
Left out: the experts' token exchange, memory-bound ops, kernels' efficiencies (the forecast has
them), a pipeline's activation sends (small beside its compute).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxtrain.config import Config, check
from jaxtrain.errors import UserError
from jaxtrain.observe.memory import fits
from jaxtrain.plan import targets
from jaxtrain.plan.compiled import usable_bytes
from jaxtrain.run.job import resolve_mesh

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# The share of the overlappable traffic a compiled schedule leaves exposed, about: the 70B plan as
# shipped (bench/results/plan_llama3_70b_h100_128x8.json) leaves 0.54 s of its communication exposed
# beside 1.39 s of network transfers. An order, not a forecast: nothing reported is computed with it.
EXPOSED = 0.5
# Bytes a param costs a device in the train state, at least: float32 params (4) and Adam's two
# float32 moments (8); ZeRO-1 splits both over data too. Gradients and compute copies come on top.
STATE_BYTES = 12
GRADIENT_BYTES = 4  # float32, beside the state at the update

Layout = tuple[int, int, int, int, list[int]]  # tensor, context, expert, pipeline, fsdp widths


def with_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """cfg with dotted-key overrides (mesh.fsdp, model.remat, device_batch_size, ...)."""
    for key, value in overrides.items():
        if "." in key:
            part, leaf = key.split(".")
            cfg = dataclasses.replace(cfg, **{part: dataclasses.replace(getattr(cfg, part), **{leaf: value})})
        else:
            cfg = dataclasses.replace(cfg, **{key: value})
    return cfg


def layouts(cfg: Config, devices: int, gpus_per_host: int) -> list[tuple[int, int, int, int, list[int]]]:
    """(tensor, context, expert, pipeline, fsdp widths) to search, only meshes that can exist:
    tensor inside a host, largest first; context in what the host leaves, smallest first (1:
    whole sequences); then expert, largest first (1 for a dense model); then no pipeline, then the
    pipelines a dense scanned model's layers take (`pipelines`), deepest first; fsdp widths whose
    mesh divides the devices (data fills the rest). Each is held to the checks a user's config
    meets (config/checks.py: heads, key/value heads, experts, window over tensor and context) and
    to the device count (run/job.py: resolve_mesh), the same rules, before any compile."""
    powers = [2**i for i in range(devices.bit_length()) if devices % 2**i == 0]
    n_experts = cfg.model.moe.n_experts
    out = []
    for tensor in sorted((n for n in powers if n <= gpus_per_host), reverse=True):
        for context in [c for c in powers if c == 1 or c * tensor <= gpus_per_host]:
            inner = tensor * context
            experts = [e for e in powers if e * inner <= devices and n_experts % e == 0] if n_experts else [1]
            for expert in sorted(experts, reverse=True):
                for pipe in pipelines(cfg, devices // (inner * expert)):
                    fsdps = [f for f in powers if devices % (f * inner * expert * pipe) == 0]
                    if fsdps and can_exist(cfg, mesh_overrides(cfg, tensor, context, expert, pipe), devices):
                        out.append((tensor, context, expert, pipe, fsdps))
    return out


def mesh_overrides(cfg: Config, tensor: int, context: int, expert: int, pipe: int) -> dict[str, Any]:
    """A layout as the flags that set it over `cfg`: every axis the search varies that differs from
    the config's (a context or pipeline the config sets is undone where the layout has none)."""
    axes = {"context": context, "expert": expert, "pipeline": pipe}
    return {"mesh.data": -1, "mesh.tensor": tensor} | {
        f"mesh.{a}": n
        for a, n in axes.items()
        if n != getattr(cfg.mesh, a) or (a == "expert" and cfg.model.moe.n_experts)
    }


def can_exist(cfg: Config, mesh: dict[str, Any], devices: int) -> bool:
    """Whether a mesh (overrides, fsdp 1: wider ones are its multiples) passes the config's checks
    and multiplies to the devices: the rules a user's job meets, not a copy of them."""
    try:
        candidate = with_overrides(cfg, {**mesh, "mesh.fsdp": 1})
        check(candidate)
        resolve_mesh(candidate.mesh, devices)
    except UserError:
        return False
    return True


def inner_choice(expert: int, fsdp: int, inner: int, gpus_per_host: int) -> bool:
    """Whether laying expert inside fsdp (`mesh.expert_inner`) changes which collectives cross
    hosts: the expert group (with the `inner` tensor x context devices) fits a host and the fsdp
    groups do not all fit beside it."""
    return expert > 1 and fsdp > 1 and expert * inner <= gpus_per_host < expert * fsdp * inner


def pipelines(cfg: Config, devices: int) -> list[int]:
    """1, then the pipeline sizes (powers of two, at most `devices` and the layers of a scanned
    model's stack the stages split: a mixture of experts' dense first layers run before them)
    whose stages pad the layers by at most 1/16 of them, deepest first: a stage's tick runs its
    padding layers too (parallel/pipeline.py), so 126 layers over 32 stages cost 128, and 80 over
    32, 96."""
    m = cfg.model
    if not m.scan_layers:
        return [1]
    n = m.n_layer - (min(m.moe.first_dense, m.n_layer) if m.moe.n_experts else 0)  # the stack split
    sizes = [2**i for i in range(1, devices.bit_length()) if devices % 2**i == 0 and 2**i <= n]
    deep = [p for p in sizes if 16 * (-(-n // p) * p - n) <= n]
    return [1, *sorted(deep, reverse=True)]


def activation_floor(
    cfg: Config, device_batch: int, context: int = 1, pipeline: int = 1, rows: int = 0, tensor: int = 1
) -> int:
    """Bytes a device holds at least at this device batch, whatever the mesh and remat: the input
    of every layer, saved for the backward (tensor parallelism does not split it; context
    parallelism splits each sequence). Under a pipeline: its stage's input for each of its `rows`
    (every microbatch's), whatever the device batch, split along the sequence over tensor where
    context does not split it (parallel/pipeline.py: `held`)."""
    m = cfg.model
    per_row = m.seq_len * m.d_model * DTYPE_BYTES.get(cfg.dtype, 4) // context
    if pipeline > 1:
        return rows * per_row // (tensor if context == 1 else 1)
    return m.n_layer * device_batch * per_row


def rows_of(cfg: Config) -> int:
    """Sequences in one optimizer step."""
    return cfg.total_batch_size // cfg.model.seq_len if cfg.total_batch_size else cfg.batch_size


def first_batch(cfg: Config, tensor: int, context: int, pipe: int, per_shard: int, limit: int) -> int:
    """The device batch a search tries first: one row per microbatch under a pipeline, else the
    largest power of two that divides a shard's rows and whose `memory_floor` can fit (1 at least)."""
    if pipe > 1:
        return 1
    sizes = [b for b in range(per_shard, 0, -1) if per_shard % b == 0 and b & (b - 1) == 0]
    return next((b for b in sizes if fits(memory_floor(cfg, b, tensor, context, pipe, per_shard), limit)), 1)


def params(cfg: Config) -> tuple[float, float]:
    """(a layer's matmul params a token computes with, every param): from the shape, no model built.
    A mixture of experts' layer counts its routed experts per token and its shared ones; its
    total, every expert."""
    m = cfg.model
    attention = 2 * m.d_model * m.head_size * (m.n_head + m.kv_heads)
    per_matrix = m.d_model * (3 if m.mlp == "swiglu" else 2)
    moe = m.moe
    shared = moe.d_shared or moe.n_shared_experts * m.expert_dim
    active = per_matrix * ((moe.experts_per_token * m.expert_dim + shared) if moe.n_experts else m.ff_dim)
    every = per_matrix * ((moe.n_experts * m.expert_dim + shared) if moe.n_experts else m.ff_dim)
    embeddings = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
    return attention + active, m.n_layer * (attention + every) + embeddings


def ring(size: float, group: int, stride: int, gpus_per_host: int, kind: str) -> tuple[float, float]:
    """(NVLink bytes, network bytes) a device sends in a collective of `size` bytes over `group`
    devices `stride` apart: plan/hlo.py's `transfer` rule (an all-reduce's ring twice)."""
    if group == 1:
        return 0.0, 0.0
    per_host = max(1, min(group, gpus_per_host // stride))
    hosts = group // per_host
    times = 2.0 if kind == "all-reduce" else 1.0
    return times * (per_host - 1) / per_host * size, times * (hosts - 1) / hosts * size / per_host


def memory_floor(cfg: Config, batch: int, tensor: int, context: int, pipe: int, rows: int) -> int:
    """Bytes a device holds besides its state, at least: the layers' saved inputs
    (`activation_floor`) and, without a pipeline, a piece of the head's logits and their gradient
    beside them as the backward starts (bfloat16 at least, the vocabulary split over tensor, the
    tokens over context and model.token_chunks)."""
    m = cfg.model
    floor = activation_floor(cfg, batch, context, pipe, rows, tensor)
    if pipe == 1:
        floor += 2 * batch * m.seq_len // context * m.vocab_size // tensor * 2 // m.token_chunks
    return floor


def first_fsdp(
    cfg: Config, layout: Layout, devices: int, floor: int, limit: int, likely: bool = False
) -> int:
    """The fsdp width a search tries first: the narrowest of the layout's whose state can fit
    beside `floor` while the layers run, and beside the gradient at the update; else its widest.
    The state: float32 params and moments (ZeRO-1: split over data too, with the step's compute
    copy of the params), and one layer gathered whole where fsdp splits it. Each is counted low, so
    no narrower width fits either (the search widens from here when this one does not fit).
    `likely`: the width the estimate costs the layout at, with the float32 gradient and a compute
    copy of the params held while the layers run too (as compiled steps hold them: a pipeline's
    stage accumulates its gradient over its ticks)."""
    tensor, context, expert, pipe, fsdps = layout
    layer, total = params(cfg)
    act = DTYPE_BYTES.get(cfg.dtype, 4)
    shard = total / (tensor * pipe * expert)
    for f in fsdps:
        data = devices // (tensor * context * expert * pipe * f)
        split = f * (data if cfg.mesh.zero1 else 1)  # the optimizer's params, moments, gradient
        copy = shard * act / f if cfg.mesh.zero1 and data > 1 else 0
        if likely:
            copy = shard * (GRADIENT_BYTES + act) / f
        running = shard * STATE_BYTES / split + copy + (layer * act / tensor if f > 1 else 0) + floor
        update = shard * (STATE_BYTES + GRADIENT_BYTES) / split + copy
        if fits(int(max(running, update)), limit):
            return f
    return fsdps[-1]


def estimate_s(
    cfg: Config, layout: Layout, devices: int, gpus_per_host: int, target: targets.GpuTarget
) -> float:
    """A layout's step time estimated from the shape (module docstring): compute and synchronous
    transfers stretched by the bubble, plus EXPOSED of the overlappable traffic. Infinite for a
    layout whose shards do not split the batch (the search passes over it)."""
    tensor, context, expert, pipe, _ = layout
    m, limit, act = cfg.model, usable_bytes(target), DTYPE_BYTES.get(cfg.dtype, 4)
    rows, shards = rows_of(cfg), devices // (tensor * context * pipe)
    if rows % shards:
        return math.inf
    batch = first_batch(cfg, tensor, context, pipe, rows // shards, limit)
    micro = rows // shards // batch
    floor = memory_floor(cfg, batch, tensor, context, pipe, rows // shards)
    fsdp = first_fsdp(cfg, layout, devices, floor, limit, likely=True)
    layer, total = params(cfg)
    layers = -(-m.n_layer // pipe) * pipe  # a stage's padding layers compute too
    tokens = rows * m.seq_len
    # forward, recomputed forward, backward (2x): 4 forwards of the layers, 3 of the head
    flops = tokens * (
        4 * layers * (2 * layer + 2 * m.n_head * m.head_size * m.seq_len) + 6 * m.vocab_size * m.d_model
    )
    compute = flops / devices / targets.peak_flops(target, cfg.dtype)
    carried = tokens * layers * tensor / devices * 3  # layer-tokens a device passes activations for
    tensor_nv, _ = ring(2 * carried * m.d_model * act, tensor, 1, gpus_per_host, "all-reduce")
    qkvo = carried * (2 * m.n_head + 2 * m.kv_heads) * m.head_size * act / tensor * (context - 1) / context
    over_host = tensor * context > gpus_per_host
    synchronous = tensor_nv / target.nvlink_bytes_per_s + qkvo / (
        target.network_bytes_per_s if over_host else target.nvlink_bytes_per_s
    )
    bubble = (pipe - 1) / (micro + pipe - 1)
    shard = total / (tensor * pipe * expert)  # bytes below: per param of a device's shard, gathered
    gathers = ring(micro * shard * (2 * act + 4), fsdp, tensor * context, gpus_per_host, "all-gather")
    data = devices // (tensor * context * expert * pipe * fsdp)
    reduce = ring(shard / fsdp * 4, data, tensor * context * expert * fsdp, gpus_per_host, "all-reduce")
    overlapped = sum(
        nv / target.nvlink_bytes_per_s + net / target.network_bytes_per_s for nv, net in (gathers, reduce)
    )
    return (compute + synchronous) / (1 - bubble) + EXPOSED * overlapped


def ranked(
    cfg: Config, layouts: list[Layout], devices: int, gpus_per_host: int, target: targets.GpuTarget
) -> list[tuple[float, Layout]]:
    """The layouts with their estimates, fastest estimate first (ties: the order given)."""
    scored = [(estimate_s(cfg, layout, devices, gpus_per_host, target), layout) for layout in layouts]
    return sorted(scored, key=lambda s: s[0])
