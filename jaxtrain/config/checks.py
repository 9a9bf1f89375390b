"""The checks of a config's values alone (no launch, no devices), at load time on every process.

What needs the launch or the devices (process count, mesh against them, batch split) is
jaxtrain/run/job.py's; what needs the data or a checkpoint, jaxtrain/run/resolve.py's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from jaxtrain.config.data import TOKEN_DTYPES, parse_spec
from jaxtrain.config.schema import (
    BUCKET_KEYS,
    BUCKET_SCHEMES,
    MESH_AXES,
    SOURCE_LISTS,
    Config,
    ConfigError,
    ModelConfig,
    get,
)

_CHOICES = {
    "task": ("train", "test", "predict", "chat"),
    "optim.name": ("adamw", "muon"),
    "dtype": ("float32", "bfloat16", "float16"),
    "token_dtype": TOKEN_DTYPES,
    "document_mask": ("auto", "off"),
    "preflight": ("auto", "on", "off"),
    "wandb_mode": ("online", "offline"),
    "model.pos_embedding": ("rope", "learned"),
    "model.remat": ("none", "full", "dots"),
    "model.attention_impl": ("auto", "xla", "cudnn"),
    "model.mlp": ("gelu", "swiglu"),
    "model.moe.grouped_matmul": ("auto", "ragged_dot", "blocks", "pallas", "pallas_fp8"),
    "model.moe.exchange": ("auto", "ragged", "padded"),
    "model.moe.router": ("softmax", "sigmoid"),
    "model.moe.dispatch_dtype": ("auto", "compute", "float8_e4m3fn", ""),
    "model.rope_type": ("llama3", "yarn"),
    "model.matmul": ("compute", "fp8"),
    "model.head_matmul": ("compute", "fp8"),
    "mesh.reduce_dtype": ("float32", "compute"),
    "compat.backend": ("auto", "nccl", "gloo"),
    "ddp.log_level": ("", "DEBUG", "INFO", "WARNING", "ERROR"),
}
_POSITIVE = (
    "batch_size", "total_steps", "gradient_accumulation_steps", "log_interval",
    "checkpoint_interval", "keep_checkpoints", "eval_batches", "prefetch",
    "model.vocab_size", "model.seq_len", "model.n_layer", "model.n_head", "model.d_model",
    "optim.matrix_lr", "max_new_tokens", "model.moe.experts_per_token", "model.moe.every",
    "model.moe.n_group", "model.moe.topk_group", "model.moe.routed_scale", "model.moe.chunks",
    "model.moe.overlap_groups", "optim.lr", "dist.init_timeout", "max_bad_steps",
    "preemption_check_interval", "lock_stale_s",
)  # fmt: skip
_NON_NEGATIVE = (
    "total_batch_size", "device_batch_size", "eval_interval", "gradient_clip_val", "top_k", "depth",
    "sample_tokens", "model.d_ff", "model.n_kv_head", "model.head_dim", "temperature",
    "optim.warmup_steps", "optim.weight_decay",
    "optim.min_lr_ratio", "dist.num_processes", "watchdog_factor", "watchdog_timeout",
    "model.moe.n_experts", "model.moe.n_shared_experts", "model.moe.d_expert", "model.moe.balance_coef",
    "model.moe.z_loss_coef", "model.moe.capacity_factor", "model.moe.d_shared", "model.moe.first_dense",
    "model.moe.bias_update_rate", "model.kv_lora_rank", "model.q_lora_rank",
    "data_threads", "epochs", "compat.world_size",
)  # fmt: skip


def check(cfg: Config) -> None:
    """Value checks that need no devices."""
    _check_keys(cfg)
    _check_model(cfg)
    _check_batch(cfg)
    if cfg.eval_interval and not cfg.eval_batches:
        raise ConfigError("eval_interval is set but eval_batches is 0")
    if cfg.compat.local_rank < -1:
        raise ConfigError(f"--local_rank must be >= 0, got {cfg.compat.local_rank}")
    _check_task(cfg)
    if not 0 <= cfg.optim.muon_momentum < 1:
        raise ConfigError(f"optim.muon_momentum must be in [0, 1), got {cfg.optim.muon_momentum}")
    if cfg.optim.min_lr_ratio > 1:
        raise ConfigError(f"optim.min_lr_ratio must be <= 1, got {cfg.optim.min_lr_ratio}")
    profile_range(cfg.profile_steps)
    profile_processes(cfg.profile_processes)
    _check_mesh_values(cfg)


# A path key is one whose name ends so: run_dir, train_data_path, resume_from, prompt_file, ...
_PATH_KEYS = ("_path", "_dir", "_from", "_file")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s,'\"\]}]*")


def refuse_urls(flat: Mapping[str, Any]) -> None:
    """No path key (dotted keys to values) names a URL it cannot read: gs://, s3://, https://, ...
    read as a local path made a folder `gs:/bucket` and failed at the first save. A bucket (gs://,
    s3://) is read where BUCKET_KEYS allow one, and must name its bucket. Anywhere in the value (a
    comma list, a YAML list of sources, hf:DIR), before anything reads it."""
    for key, value in flat.items():
        if not (isinstance(value, str) and key.endswith(_PATH_KEYS)):
            continue
        for url in _URL.finditer(value):
            if key in BUCKET_KEYS and url.group().startswith(BUCKET_SCHEMES):
                if not url.group().partition("://")[2].partition("/")[0]:
                    scheme = url.group().partition("://")[0]
                    raise ConfigError(f"{key} {url.group()} names no bucket; write {scheme}://BUCKET/PATH")
                continue
            if key in BUCKET_KEYS:
                raise ConfigError(
                    f"{key} names a URL ({url.group()}): {key} reads a path or a gs:// or s3:// bucket only; "
                    "copy the files there first"
                )
            raise ConfigError(
                f"{key} names a URL ({url.group()}): {key} reads local or shared filesystem paths only "
                f"(a gs:// or s3:// bucket is read by {', '.join(BUCKET_KEYS)}); copy the files there first"
            )


def _check_keys(cfg: Config) -> None:
    """The rules of whole lists of keys: data sources, choices, positive and non-negative numbers."""
    for path in SOURCE_LISTS:
        parse_spec(get(cfg, path), path)
    for path, choices in _CHOICES.items():
        if get(cfg, path) not in choices:
            offered = "|".join(c for c in choices if c)  # "" still read (older run dirs), never offered
            raise ConfigError(f"config key '{path}' must be one of {offered}, got {get(cfg, path)!r}")
    for path in _POSITIVE:
        if get(cfg, path) <= 0:
            raise ConfigError(f"config key '{path}' must be > 0, got {get(cfg, path)}")
    for path in _NON_NEGATIVE:
        if get(cfg, path) < 0:
            raise ConfigError(f"config key '{path}' must be >= 0, got {get(cfg, path)}")


def _check_model(cfg: Config) -> None:
    """The model's shape: heads, document tokens, rotary positions, MLA."""
    m = cfg.model
    if cfg.depth and m.d_model % m.n_head:
        raise ConfigError(
            f"--depth {cfg.depth} gives d_model {m.d_model}, which {m.n_head} heads of ~128 do not divide; "
            "use an even depth or set --model.n_head"
        )
    if m.d_model % m.n_head and not m.head_dim:
        raise ConfigError(f"model.d_model {m.d_model} is not divisible by model.n_head {m.n_head}")
    if m.n_head % m.kv_heads:
        raise ConfigError(
            f"model.n_head {m.n_head} is not a multiple of model.n_kv_head {m.n_kv_head}: each key/value "
            "head serves a whole group of query heads"
        )
    for key in ("doc_bos", "doc_eos"):
        token = getattr(m, key)
        if not -1 <= token < m.vocab_size:
            raise ConfigError(
                f"model.{key} {token} is not a token of the {m.vocab_size}-token vocabulary; give an id "
                f"in 0..{m.vocab_size - 1}, or -1 for none"
            )
    if cfg.task == "train" and cfg.document_mask == "off" and (m.doc_bos >= 0 or m.doc_eos >= 0):
        raise ConfigError(
            f"document_mask off but model.doc_bos {m.doc_bos} / doc_eos {m.doc_eos} ask for a document "
            "mask; drop --model.doc_bos/--model.doc_eos, or --document_mask off"
        )
    if m.pos_embedding == "rope" and m.head_size % 2 and not m.mla:  # MLA's: _check_mla
        raise ConfigError(f"rotary positions need an even head size, got {m.head_size}")
    _check_mla(m)
    _check_fp8(cfg)


def _check_fp8(cfg: Config) -> None:
    """FP8 matmuls dequantize into bfloat16, the dtype XLA's GPU compiler folds into an FP8 GEMM."""
    for key in ("matmul", "head_matmul"):
        if getattr(cfg.model, key) == "fp8" and cfg.dtype != "bfloat16":
            raise ConfigError(
                f"model.{key} fp8 runs its matmuls from bfloat16 operands, but dtype is {cfg.dtype}; "
                "add --dtype bfloat16 (or drop the fp8)"
            )


def _check_batch(cfg: Config) -> None:
    """The batch: its split into microbatches, its size in tokens."""
    if cfg.batch_size % cfg.gradient_accumulation_steps:
        raise ConfigError(
            f"batch_size {cfg.batch_size} is not divisible by gradient_accumulation_steps "
            f"{cfg.gradient_accumulation_steps}"
        )
    if cfg.total_batch_size and not cfg.device_batch_size:
        raise ConfigError("total_batch_size needs device_batch_size (sequences per device per microbatch)")
    if cfg.total_batch_size and cfg.total_batch_size % cfg.model.seq_len:
        raise ConfigError(
            f"total_batch_size {cfg.total_batch_size} tokens is not a multiple of seq_len {cfg.model.seq_len}"
        )


def _check_task(cfg: Config) -> None:
    if cfg.task != "train" and not cfg.resume_from:
        raise ConfigError(
            f"--task {cfg.task} needs --resume_from CHECKPOINT (a step dir, or a run's checkpoints/ dir)"
        )
    if cfg.task in ("predict", "chat") and cfg.prompt and cfg.prompt_file:
        raise ConfigError(
            f"--task {cfg.task} takes --prompt TEXT or --prompt_file FILE (one prompt a line), not both"
        )
    if cfg.init_from and (cfg.task != "train" or cfg.resume_from):
        raise ConfigError(
            "--init_from starts a new training run from a checkpoint's params; it goes with --task train "
            "and without --resume_from"
        )


def profile_range(text: str) -> tuple[int, int] | None:
    """--profile_steps A:B as (A, B), 0 <= A < B; None when unset."""
    if not text:
        return None
    start, colon, stop = text.partition(":")
    if colon and start.strip().isdigit() and stop.strip().isdigit() and int(start) < int(stop):
        return int(start), int(stop)
    raise ConfigError(f"config key 'profile_steps' must be A:B with 0 <= A < B (steps A..B-1), got {text!r}")


def profile_processes(text: str) -> set[int] | None:
    """--profile_processes as a set of process ids; None means all."""
    if text.strip() == "all":
        return None
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ConfigError(
            f"config key 'profile_processes' must be comma-separated process ids or 'all', got {text!r}"
        )
    return {int(p) for p in parts}


def mesh_str(sizes: dict[str, int]) -> str:
    """{"data": 2, "fsdp": 4} -> "data 2 x fsdp 4" (pipeline, expert and context axes of 1 unsaid)."""
    return " x ".join(
        f"{a} {n}" for a, n in sizes.items() if a not in ("pipeline", "expert", "context") or n != 1
    )


def _check_mesh_values(cfg: Config) -> None:
    sizes = {a: getattr(cfg.mesh, a) for a in MESH_AXES}
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"config key 'mesh.{axis}' must be >= 1 or -1 (the devices left), got {size}")
    if list(sizes.values()).count(-1) > 1:
        raise ConfigError(f"at most one mesh axis may be -1, got {mesh_str(sizes)}")
    m, tp, cp = cfg.model, cfg.mesh.tensor, cfg.mesh.context
    _check_moe(m, cfg.mesh.expert, max(cfg.mesh.context, 1))
    _check_expert_node(cfg.mesh.expert, cfg.mesh.expert_node)
    _check_pipeline(m, cfg.mesh.pipeline)
    if cfg.mesh.pipeline > 1 and cp > 1 and tp > 1:
        # Measured: tiny on 8 CPU devices (pipeline 2 x context 2 x tensor 2), and the GPU compiler
        # for Llama 3 405B (pipeline 8 x context 2 x tensor 4): 'Check failed' in
        # spmd_partitioner_util.cc, the process aborted (jax 0.10.2).
        # The nearest layout that compiles: the same devices, the context ones split the batch
        # instead (fsdp), so pipeline and tensor stay as asked.
        fsdp = sizes["fsdp"]
        nearest = "--mesh.context 1" + (
            f" --mesh.fsdp {fsdp * cp}" if fsdp != -1 else " (fsdp -1 takes its devices)"
        )
        raise ConfigError(
            f"mesh.pipeline {cfg.mesh.pipeline} with both mesh.context {cp} and mesh.tensor {tp}: XLA's "
            "SPMD partitioner aborts on that program (jax 0.10.2); with pipeline use context or tensor, "
            f"not both: e.g. {nearest}"
        )
    if cp > 1 and m.seq_len % cp:
        raise ConfigError(
            f"model.seq_len {m.seq_len} is not divisible by mesh.context {cp}: context parallelism splits "
            f"each window into equal parts; use a mesh.context that divides {m.seq_len}"
        )
    if m.token_chunks < 1 or m.seq_len % (max(cp, 1) * m.token_chunks):
        raise ConfigError(
            f"model.seq_len {m.seq_len} is not divisible by mesh.context x model.token_chunks = "
            f"{max(cp, 1)} x {m.token_chunks}: each device's tokens are cut into equal pieces for the "
            f"head and MLPs; use a model.token_chunks >= 1 that divides {m.seq_len // max(cp, 1)}"
        )
    if cp > 1 and m.n_head % (cp * tp):
        raise ConfigError(
            f"model.n_head {m.n_head} is not divisible by mesh.context x mesh.tensor = {cp * tp}: "
            "attention splits whole sequences by heads over both; use sizes whose product divides "
            f"{m.n_head}"
        )
    if tp > 1:
        for what, n in (
            ("model.n_head", m.n_head),
            ("model.n_kv_head", m.kv_heads),
            ("model.ff_dim", m.ff_dim),
            *((("model.moe.d_expert", m.moe.d_expert or m.ff_dim),) if m.moe.n_experts else ()),
            ("model.vocab_size", m.vocab_size),
        ):
            if n % tp:
                raise ConfigError(
                    f"{what} {n} is not divisible by mesh.tensor {tp}: tensor parallelism splits it "
                    f"evenly; use a mesh.tensor that divides {n}"
                )


def _check_pipeline(m: ModelConfig, pp: int) -> None:
    """Stages of consecutive layers of the scanned stack (parallel/pipeline.py); a mixture of
    experts' dense first layers run by the first stage, before its own."""
    if pp == 1:
        return
    if not m.scan_layers:
        raise ConfigError(
            f"mesh.pipeline {pp} splits the scanned layer stack into stages; set model.scan_layers true "
            "or drop mesh.pipeline"
        )
    # A mixture of experts' dense first layers run before the stages (parallel/pipeline.py)
    dense = min(m.moe.first_dense, m.n_layer) if m.moe.n_experts else 0
    if pp > m.n_layer - dense:
        what = f"model.n_layer {m.n_layer}" + (f" less moe.first_dense {dense}" if dense else "")
        raise ConfigError(
            f"mesh.pipeline {pp} is more stages than {what} (each stage runs at "
            f"least one layer); use a mesh.pipeline of at most {m.n_layer - dense}"
        )


def _check_mla(m: ModelConfig) -> None:
    """Multi-head latent attention: its head sizes, and the options of other attentions it has not."""
    if not m.mla:
        return
    for key in ("rope_head_dim", "nope_head_dim", "v_head_dim"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"model.{key} must be > 0 with model.kv_lora_rank, got {getattr(m, key)}")
    if m.rope_head_dim % 2 or m.pos_embedding != "rope":
        raise ConfigError(
            f"multi-head latent attention rotates an even model.rope_head_dim (got {m.rope_head_dim}) "
            "with --model.pos_embedding rope"
        )
    if m.kv_heads != m.n_head or m.qk_norm or m.qkv_bias or m.head_dim:
        raise ConfigError(
            "multi-head latent attention (model.kv_lora_rank) has one latent for every head and sizes its "
            "heads by rope/nope/v_head_dim: drop model.n_kv_head, head_dim, qk_norm and qkv_bias"
        )


def _check_expert_node(ep: int, node: int) -> None:
    """mesh.expert_node: 0, or nodes of more than one device that split the expert axis in two or more."""
    if node == 0 or (ep > 1 and 1 < node < ep and ep % node == 0):
        return
    if ep == -1 and node > 1:
        return  # settled with the devices (the axis's size is not known yet)
    raise ConfigError(
        f"mesh.expert_node {node} must split mesh.expert {ep} into nodes of more than one device "
        f"(a divisor of it between 2 and {max(ep // 2, 2)}); drop mesh.expert_node for the one-hop exchange"
    )


def _check_moe(m: ModelConfig, ep: int, cp: int) -> None:
    moe = m.moe
    if not moe.n_experts:
        if ep > 1:
            raise ConfigError(
                f"mesh.expert {ep} needs a mixture of experts; set model.moe.n_experts (a multiple of "
                f"{ep}) or drop mesh.expert"
            )
        return
    if moe.experts_per_token > moe.n_experts:
        raise ConfigError(
            f"model.moe.experts_per_token {moe.experts_per_token} exceeds model.moe.n_experts "
            f"{moe.n_experts}; route each token to at most {moe.n_experts} experts"
        )
    if ep > 1 and moe.n_experts % ep:
        raise ConfigError(
            f"model.moe.n_experts {moe.n_experts} is not divisible by mesh.expert {ep}: each device holds "
            f"n_experts / mesh.expert of them; use a mesh.expert that divides {moe.n_experts}"
        )
    if (moe.every > 1 or moe.dense_layers) and m.scan_layers:
        raise ConfigError(
            "model.moe.every or dense_layers mix MoE and dense layers, but model.scan_layers compiles one "
            "layer for each stack (the first_dense ones, then the rest); drop them or model.scan_layers"
        )
    # (a window mesh.context does not split is named by the context check)
    if m.seq_len % cp == 0 and (m.seq_len // cp) % moe.chunks:
        where = f"model.seq_len {m.seq_len}" + (f" / mesh.context {cp}" if cp > 1 else "")
        raise ConfigError(
            f"model.moe.chunks {moe.chunks} must divide {where}: each MoE layer's tokens (a device's "
            "part of each window) go in that many equal pieces"
        )
    _check_routing(m)


def _check_routing(m: ModelConfig) -> None:
    moe = m.moe
    parts = [x.strip() for x in moe.dense_layers.split(",") if x.strip()]
    if not all(x.isdigit() and int(x) < m.n_layer for x in parts):
        raise ConfigError(
            f"model.moe.dense_layers {moe.dense_layers!r} must be comma-separated layer indices below "
            f"model.n_layer {m.n_layer}"
        )
    group = moe.n_experts // moe.n_group
    if moe.n_experts % moe.n_group or (moe.n_group > 1 and group < 2):
        raise ConfigError(
            f"model.moe.n_group {moe.n_group} must split model.moe.n_experts {moe.n_experts} into equal "
            "groups of at least 2 (a group ranks by its top-2 scores)"
        )
    if moe.topk_group > moe.n_group or moe.experts_per_token > moe.topk_group * group:
        raise ConfigError(
            f"model.moe.topk_group {moe.topk_group} groups of {group} experts cannot hold "
            f"experts_per_token {moe.experts_per_token} (and at most n_group {moe.n_group}); raise topk_group"
        )
    if moe.dispatch_dtype == "float8_e4m3fn" and m.remat == "none":
        raise ConfigError(
            f"model.moe.dispatch_dtype {moe.dispatch_dtype} rounds the copies in the experts' own backward, "
            "which runs under remat; set model.remat full (or dots)"
        )
    if moe.bias_update_rate and moe.router != "sigmoid":
        raise ConfigError(
            "model.moe.bias_update_rate (auxiliary-loss-free balancing) moves the sigmoid router's bias; "
            "set model.moe.router sigmoid"
        )
    if moe.shared_gate and not moe.n_shared_experts:
        raise ConfigError("model.moe.shared_gate gates the shared experts: set model.moe.n_shared_experts")
