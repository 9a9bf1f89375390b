"""Typed, frozen run configuration: YAML file, then command-line overrides; every check in one place.

    cfg = load_config(["--config", "configs/tiny.yaml", "--batch_size", "64", "--optim.lr=3e-4"])

A flag is a dotted path (`--optim.lr`) or, when unambiguous, a bare leaf name (`--lr`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jaxtrain.errors import UserError
from jaxtrain.sources import parse_spec


class ConfigError(UserError):
    """A config key, type or value that cannot be used."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    d_ff: int = 0  # 0 means 4 * d_model (gelu), or Llama's 2/3 of that rounded up to 256 (swiglu)
    pos_embedding: str = "rope"  # rope | learned
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # Unrolled layers ran the backward 1.46x faster than scan on a 2-core CPU; scan keeps
    # compile time flat in depth, which matters for deep models. Measure both (bench/).
    scan_layers: bool = False
    remat: str = "none"  # none | full | dots (save matmul outputs, recompute the rest)
    attention_impl: str = "auto"  # auto | xla | cudnn  (jax.nn.dot_product_attention)
    # The Llama family (jaxtrain/hf/ maps these to and from Hugging Face classes)
    mlp: str = "gelu"  # gelu | swiglu (silu(x W_gate) * x W_up, then W_down)
    n_kv_head: int = 0  # key/value heads, grouped-query attention (1: multi-query); 0 = n_head
    head_dim: int = 0  # 0 = d_model // n_head
    tie_embeddings: bool = True  # False: a separate output head (lm_head)
    qk_norm: bool = False  # RMSNorm of each head's q and k before rotary positions (Qwen3)
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    # Llama 3.1's rotary frequencies (rope_type llama3) when > 0: the long ones slowed by this factor
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192

    @property
    def ff_dim(self) -> int:
        if self.d_ff:
            return self.d_ff
        if self.mlp == "swiglu":  # Llama: int(2/3 * 4d) rounded up to a multiple of 256
            return 256 * math.ceil(int(8 * self.d_model / 3) / 256)
        return 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_head


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1  # matrices only
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    name: str = "adamw"  # adamw | muon (Muon for hidden matrices, AdamW at lr for the rest: optim.py)
    matrix_lr: float = 0.02  # Muon's peak lr (nanochat's matrix_lr)
    muon_momentum: float = 0.95


@dataclass(frozen=True)
class DistConfig:
    """Explicit multi-process settings; unset values fall back to env vars, then SLURM."""

    coordinator_address: str = ""  # host:port
    num_processes: int = 0  # 0 = detect
    process_id: int = -1  # -1 = detect
    local_device_ids: str = ""  # comma-separated, "" = detect
    init_timeout: int = 300  # seconds to wait for every process to join


MESH_AXES = ("data", "fsdp", "tensor")  # outer to inner


@dataclass(frozen=True)
class MeshConfig:
    """The device mesh, data x fsdp x tensor; its product is the device count.

    -1 means "the devices left over" (at most one axis). `data` is the outer axis and spans
    processes; `fsdp` and `tensor` stay inside a process (one NVLink domain) wherever they fit.
    """

    data: int = -1  # data parallel: replicas of the (fsdp x tensor)-sharded state
    fsdp: int = 1  # ZeRO-3: params, gradients and optimizer state sharded, batch split too
    tensor: int = 1  # Megatron: heads, MLP hidden and vocab split; the batch is not
    zero1: bool = False  # ZeRO-1: also shard the optimizer state over `data` (params replicated)


@dataclass(frozen=True)
class DebugConfig:
    """Faults for tests only (jaxtrain/faults.py); all off by default."""

    nan_step: int = 0  # poison the first device's gradient from this step (1-based) on...
    nan_count: int = 1  # ...for this many steps
    stall_step: int = -1  # sleep before this step...
    stall_process: int = 0  # ...on this process...
    stall_seconds: float = 3600.0  # ...this long
    kill_during_save: int = -1  # SIGKILL this process while the checkpoint of this step is written
    stall_restore: bool = False  # sleep stall_seconds inside a checkpoint restore, as a dead NFS mount does
    oom: str = ""  # compile | step: fail there as a device out of memory does


@dataclass(frozen=True)
class CompatConfig:
    """Flags of the PyTorch/DDP guides our users already type (README: "coming from torchrun/DDP").

    Each is checked against the job or mapped onto our own keys; one without effect in JAX says
    so once in the log (compat_notes).
    """

    distributed: bool = False  # distribution is detected from the launcher
    local_rank: int = -1  # -1 = not given; else must equal the launcher's local rank
    world_size: int = 0  # 0 = not given; else must equal the process count
    backend: str = "auto"  # auto | nccl | gloo: checked against the platform
    single_gpu: bool = False  # one process on one device
    skip_invalid_loss: bool = False  # what jaxtrain always does: non-finite steps are skipped
    continue_on_error: bool = False  # never stop for non-finite steps: max_bad_steps = total_steps
    find_unused_parameters: bool = False  # no effect: every parameter gets a gradient in JAX


@dataclass(frozen=True)
class Config:
    name: str = "default"
    # train | test (loss and perplexity of --resume_from) | predict (generate from --resume_from)
    task: str = "train"
    run_dir: str = ""  # "" means runs/<name> (test, predict: the checkpoint's run dir)
    overwrite: bool = False  # start fresh even if run_dir holds a different run
    # data: token files (nanoGPT raw uint16/uint32, or llm.c header): a file, a glob, a comma list
    # or a manifest.json; or a YAML list of {path, weight, name} sources (jaxtrain/sources.py);
    # "" = embedded default
    train_data_path: str = ""
    valid_data_path: str = ""
    token_dtype: str = "auto"  # auto | uint16 | uint32 (auto: header, else by vocab size)
    data_threads: int = 4  # 0: read in the training thread (torch's num_workers=0)
    prefetch: int = 4  # batches prepared ahead of the step
    # batch: batch_size is GLOBAL, in sequences, per optimizer step
    batch_size: int = 32
    total_batch_size: int = 0  # tokens per optimizer step; when set, derives accumulation
    device_batch_size: int = 0  # sequences per device per microbatch (with total_batch_size)
    gradient_accumulation_steps: int = 1
    total_steps: int = 1000
    epochs: float = 0  # > 0 replaces total_steps: epochs x windows in the training data / batch
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 | float16 (params stay float32)
    gradient_clip_val: float = 1.0  # global-norm clip; 0 disables
    max_bad_steps: int = 10  # stop after this many non-finite (skipped) steps in a row
    # fault tolerance
    watchdog_factor: float = 20.0  # a step over this many typical step times is a hang
    watchdog_timeout: float = 1800.0  # seconds any step, eval, save or restore may take; 0 disables
    preemption_check_interval: int = 10  # steps between multi-process checks for a stop signal
    lock_stale_s: float = 60.0  # a run dir lock whose heartbeat is this old (s) was left by a dead job
    seed: int = 0
    # checkpoints
    resume_from: str = ""  # a checkpoint step dir, or a run's checkpoints/ dir
    init_from: str = ""  # a new run starting from that checkpoint's params (fresh optimizer, step 0)
    # test and predict tasks (jaxtrain/tasks.py)
    test_data_path: str = ""  # "" = valid_data_path, else the checkpoint's validation data
    prompt: str = ""
    prompt_file: str = ""  # one prompt per line
    max_new_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 40  # 0 = sample from the whole vocabulary
    # nanochat's one-number model: n_layer = depth, d_model = 64 * depth, heads of 128, optim.lr
    # 0.004 * (d_model / 768) ** -0.5; keys given beside it win. 0 = off
    depth: int = 0
    checkpoint_interval: int = 500
    keep_checkpoints: int = 3
    # logging (process 0 only)
    log_interval: int = 10
    eval_interval: int = 200  # 0 disables
    eval_batches: int = 8
    use_wandb: bool = False
    wandb_project: str = "jaxtrain"
    wandb_run_name: str = ""
    wandb_mode: str = "online"  # online | offline (no network needed)
    progress_bar: bool = True
    sample_tokens: int = 0  # tokens generated from the final model; 0 disables
    sample_prompt: str = "def "
    # where the time goes (see README: Profiling, memory, goodput)
    profile_steps: str = ""  # "A:B" traces steps A..B-1 into <run_dir>/profile/ with jax.profiler
    profile_processes: str = "0"  # comma-separated process ids that trace, or "all"
    tensorboard: bool = False  # also write the training scalars as TensorBoard events (process 0)
    compile_cache_dir: str = ""  # persistent compile cache; "" = $XDG_CACHE_HOME/jaxtrain/xla; "off"
    model: ModelConfig = field(default_factory=ModelConfig)
    verbose: bool = False  # every process logs at DEBUG level, and JAX logs each compilation
    optim: OptimConfig = field(default_factory=OptimConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    compat: CompatConfig = field(default_factory=CompatConfig)

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir or f"runs/{self.name}")


_CHOICES = {
    "task": ("train", "test", "predict"),
    "optim.name": ("adamw", "muon"),
    "dtype": ("float32", "bfloat16", "float16"),
    "token_dtype": ("auto", "uint16", "uint32"),
    "wandb_mode": ("online", "offline"),
    "model.pos_embedding": ("rope", "learned"),
    "model.remat": ("none", "full", "dots"),
    "model.attention_impl": ("auto", "xla", "cudnn"),
    "model.mlp": ("gelu", "swiglu"),
    "compat.backend": ("auto", "nccl", "gloo"),
    "debug.oom": ("", "compile", "step"),
}
_SOURCE_LISTS = ("train_data_path", "valid_data_path")  # a YAML list of sources is a mixture
_POSITIVE = (
    "batch_size", "total_steps", "gradient_accumulation_steps", "log_interval",
    "checkpoint_interval", "keep_checkpoints", "eval_batches", "prefetch",
    "model.vocab_size", "model.seq_len", "model.n_layer", "model.n_head", "model.d_model",
    "optim.matrix_lr", "max_new_tokens",
    "optim.lr", "dist.init_timeout", "max_bad_steps", "preemption_check_interval", "lock_stale_s",
)  # fmt: skip
_NON_NEGATIVE = (
    "total_batch_size", "device_batch_size", "eval_interval", "gradient_clip_val", "top_k", "depth",
    "sample_tokens", "model.d_ff", "model.n_kv_head", "model.head_dim", "temperature",
    "optim.warmup_steps", "optim.weight_decay",
    "optim.min_lr_ratio", "dist.num_processes", "watchdog_factor", "watchdog_timeout",
    "debug.nan_step", "debug.nan_count", "data_threads", "epochs", "compat.world_size",
)  # fmt: skip
# Other names for our keys, as the PyTorch guides spell them (README: "coming from torchrun/DDP").
# A bare `--debug` is the guides' verbose switch; our test-only faults stay under `debug.*`.
ALIASES = {
    "max_seq_len": "model.seq_len",  # nanochat's name
    "num_workers": "data_threads",
    "grad_accumulation_steps": "gradient_accumulation_steps",
    "debug": "verbose",
}
# What the guides' flags without an effect of their own do here, said once in the log when set.
_COMPAT_NOTES = {
    "compat.distributed": "--distributed: accepted; jaxtrain detects distribution from its launcher",
    "compat.local_rank": "--local_rank {}: accepted, checked against the launcher's local rank",
    "compat.world_size": "--world_size {}: accepted, equals the process count (JAX needs no size flag)",
    "compat.backend": "--backend {}: accepted; JAX picks NCCL between GPUs and gloo between CPU processes",
    "compat.skip_invalid_loss": "--skip_invalid_loss: accepted, jaxtrain always skips non-finite steps "
    "(params unchanged) and stops after max_bad_steps in a row",
    "compat.find_unused_parameters": "--find_unused_parameters: no effect, every parameter gets a "
    "gradient in JAX",
}


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _leaf_paths(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every settable dotted path of a config class, with its type."""
    out: dict[str, Any] = {}
    for name, typ in _fields(cls).items():
        if isinstance(typ, type) and dataclasses.is_dataclass(typ):
            out.update(_leaf_paths(typ, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = typ
    return out


_PATHS = _leaf_paths(Config)


def _resolve_key(key: str) -> str:
    """Map a flag or YAML key to its dotted path: exact path, or a unique leaf name."""
    key = key.replace("-", "_")
    key = ALIASES.get(key, key)
    if key in _PATHS:
        return key
    matches = [p for p in _PATHS if p.rsplit(".", 1)[-1] == key]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise ConfigError(f"'{key}' is ambiguous: write one of {', '.join(matches)}")
    near = difflib.get_close_matches(key, list(_PATHS), n=1) or difflib.get_close_matches(
        key, [p.rsplit(".", 1)[-1] for p in _PATHS], n=1
    )
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    raise ConfigError(f"unknown config key '{key}'{hint}; see jaxtrain/config.py for all keys")


def _convert(path: str, typ: Any, value: Any) -> Any:
    """Coerce a YAML or string value to the field's type, or raise naming the key."""
    if isinstance(typ, types.UnionType):  # only `X | None` style unions are not used here
        typ = next(t for t in typing.get_args(typ) if t is not type(None))
    if typ is bool:
        if isinstance(value, bool):
            return value
        s = str(value).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                f = float(value)
                if f == int(f):
                    return int(f)
            except ValueError:
                pass
        if isinstance(value, float) and value == int(value):
            return int(value)
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif typ is str:
        if value is None:
            return ""
        if isinstance(value, list) and path in _SOURCE_LISTS:  # a mixture, kept as its YAML text
            return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=2**16).strip()
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"config key '{path}' must be {typ.__name__}, got {value!r}")


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def _read_yaml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} not found; pass an existing --config FILE.yaml")
    try:
        data = yaml.safe_load(p.read_text())  # safe: never constructs Python objects
    except yaml.constructor.ConstructorError as e:
        raise ConfigError(
            f"config file {path} uses a YAML tag that would build an object ({e.problem}); "
            "write plain values only"
        ) from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        raise ConfigError(f"config file {path} is not valid YAML{line}; fix its syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys to values")
    return _flatten(data)


def _parse_argv(argv: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Split argv into the --config file and (key, raw value) overrides, in order."""
    config_file = None
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument '{arg}'; flags look like --key value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or nxt.startswith("--"):
                value = "true"  # a bare flag switches a bool on
                if key != "config" and _PATHS.get(_resolve_key(key)) is not bool:
                    raise ConfigError(f"flag --{key} needs a value: --{key} VALUE")
            else:
                value, i = nxt, i + 1
        if key == "config":
            config_file = value
        else:
            overrides.append((key, value))
        i += 1
    return config_file, overrides


def _build(cls: type, flat: dict[str, Any], prefix: str = "") -> Any:
    kwargs = {}
    for name, typ in _fields(cls).items():
        if isinstance(typ, type) and dataclasses.is_dataclass(typ):
            kwargs[name] = _build(typ, flat, f"{prefix}{name}.")
        elif f"{prefix}{name}" in flat:
            kwargs[name] = flat[f"{prefix}{name}"]
    return cls(**kwargs)


# What --depth sets (see Config.depth).
_DEPTH_KEYS = ("model.n_layer", "model.d_model", "model.n_head", "optim.lr")


def _sized_by_depth(flat: dict[str, Any]) -> dict[str, Any]:
    """nanochat's sizing from `depth` beneath the keys given (as nanochat's base_train does it)."""
    depth = flat.get("depth", 0)
    if depth <= 0:
        return flat
    d_model = flat.get("model.d_model", 64 * depth)  # aspect ratio 64
    derived = {
        "model.n_layer": depth,
        "model.d_model": d_model,
        "model.n_head": max(1, math.ceil(d_model / 128)),  # head dim 128
        # nanochat's (unembedding) AdamW lr, scaled like 1/sqrt(width) from its 768-wide base
        "optim.lr": 0.004 * (d_model / 768) ** -0.5,
    }
    return {**derived, **flat}


def from_dict(values: dict[str, Any]) -> Config:
    """Build and check a Config from a (possibly nested) mapping of keys to values."""
    flat: dict[str, Any] = {}
    for key, value in _flatten(values).items():
        path = _resolve_key(key)
        flat[path] = _convert(path, _PATHS[path], value)
    flat = _sized_by_depth(flat)
    from jaxtrain.hf.config import with_hf_model  # here: jaxtrain.hf imports this module

    flat = with_hf_model(flat)  # --init_from hf:DIR: the model keys come from its config.json
    cfg = _build(Config, flat)
    check(cfg)
    if cfg.compat.single_gpu and not cfg.dist.local_device_ids:
        cfg = dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, local_device_ids="0"))
    return cfg


def load_config(argv: list[str]) -> Config:
    """Config from `--config FILE` plus command-line overrides (the command line wins)."""
    config_file, overrides = _parse_argv(argv)
    values = _read_yaml(config_file) if config_file else {}
    merged = {_resolve_key(k): v for k, v in values.items()}
    if any(_resolve_key(k) == "depth" for k, _ in overrides):
        # --depth resizes the file's model; keys given beside it on the command line still win.
        merged = {k: v for k, v in merged.items() if k not in _DEPTH_KEYS}
    for key, raw in overrides:
        merged[_resolve_key(key)] = raw
    return from_dict(merged)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config, for YAML and wandb."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _get(cfg: Config, path: str) -> Any:
    obj: Any = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


# ------------------------------------------------------------------------------------- checks
# Every rule about what a config may hold lives below, in three stages by what they need:
#   check(cfg)                         values alone: run at load time, on every process
#   check_processes(cfg, n_processes)  the process count: before joining, so every process
#                                      fails alike instead of dying in JAX's join abort
#   with_topology(cfg, n_devices, n_processes, platform)
#                                      the devices: resolves the batch and the mesh, once joined


def check(cfg: Config) -> None:
    """Value checks that need no devices."""
    for path in _SOURCE_LISTS:
        parse_spec(_get(cfg, path), path)
    for path, choices in _CHOICES.items():
        if _get(cfg, path) not in choices:
            raise ConfigError(
                f"config key '{path}' must be one of {'|'.join(choices)}, got {_get(cfg, path)!r}"
            )
    for path in _POSITIVE:
        if _get(cfg, path) <= 0:
            raise ConfigError(f"config key '{path}' must be > 0, got {_get(cfg, path)}")
    for path in _NON_NEGATIVE:
        if _get(cfg, path) < 0:
            raise ConfigError(f"config key '{path}' must be >= 0, got {_get(cfg, path)}")
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
    if m.pos_embedding == "rope" and m.head_size % 2:
        raise ConfigError(f"rotary positions need an even head size, got {m.head_size}")
    if cfg.batch_size % cfg.gradient_accumulation_steps:
        raise ConfigError(
            f"batch_size {cfg.batch_size} is not divisible by gradient_accumulation_steps "
            f"{cfg.gradient_accumulation_steps}"
        )
    if cfg.total_batch_size and not cfg.device_batch_size:
        raise ConfigError("total_batch_size needs device_batch_size (sequences per device per microbatch)")
    if cfg.total_batch_size and cfg.total_batch_size % m.seq_len:
        raise ConfigError(
            f"total_batch_size {cfg.total_batch_size} tokens is not a multiple of seq_len {m.seq_len}"
        )
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


def _check_task(cfg: Config) -> None:
    if cfg.task != "train" and not cfg.resume_from:
        raise ConfigError(
            f"--task {cfg.task} needs --resume_from CHECKPOINT (a step dir, or a run's checkpoints/ dir)"
        )
    if cfg.task == "predict" and cfg.prompt and cfg.prompt_file:
        raise ConfigError(
            "--task predict takes --prompt TEXT or --prompt_file FILE (one prompt a line), not both"
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


def _check_mesh_values(cfg: Config) -> None:
    sizes = {a: getattr(cfg.mesh, a) for a in MESH_AXES}
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"config key 'mesh.{axis}' must be >= 1 or -1 (the devices left), got {size}")
    if list(sizes.values()).count(-1) > 1:
        raise ConfigError(f"at most one mesh axis may be -1, got {_mesh_str(sizes)}")
    m, tp = cfg.model, cfg.mesh.tensor
    if tp > 1:
        for what, n in (
            ("model.n_head", m.n_head),
            ("model.n_kv_head", m.kv_heads),
            ("model.ff_dim", m.ff_dim),
            ("model.vocab_size", m.vocab_size),
        ):
            if n % tp:
                raise ConfigError(
                    f"{what} {n} is not divisible by mesh.tensor {tp}: tensor parallelism splits it "
                    f"evenly; use a mesh.tensor that divides {n}"
                )


def _mesh_str(sizes: dict[str, int]) -> str:
    return " x ".join(f"{a} {n}" for a, n in sizes.items())


def _global_rows(cfg: Config) -> int:
    return cfg.total_batch_size // cfg.model.seq_len if cfg.total_batch_size else cfg.batch_size


def check_processes(cfg: Config, n_processes: int, local_rank: int | None = None) -> None:
    """The global batch splits evenly between processes (each loads its own rows); the guides'
    --world_size, --local_rank and --single_gpu agree with the launcher (local_rank: its word)."""
    c = cfg.compat
    start = f"torchrun --nproc_per_node={c.world_size} scripts/train.py ..."
    if c.world_size and c.world_size != n_processes:
        raise ConfigError(
            f"--world_size {c.world_size} but this job has {n_processes} process(es); jaxtrain starts no "
            f"processes itself: {start}, or drop --world_size"
        )
    if c.single_gpu and n_processes > 1:
        raise ConfigError(f"--single_gpu but this job has {n_processes} processes; start one, or drop it")
    if local_rank is None and n_processes == 1:
        local_rank = 0
    if c.local_rank >= 0 and local_rank is not None and c.local_rank != local_rank:
        raise ConfigError(
            f"--local_rank {c.local_rank} but the launcher says this process's local rank is "
            f"{local_rank}; drop --local_rank (jaxtrain reads it from the launcher)"
        )
    check_batch_split(_global_rows(cfg), n_processes)


def check_batch_split(rows: int, n_processes: int) -> None:
    """The rule behind check_processes, for callers holding only the numbers (the data loader)."""
    if rows % n_processes:
        raise ConfigError(
            f"global batch_size {rows} is not divisible by {n_processes} processes; "
            f"use a multiple of {n_processes}"
        )


def with_data(cfg: Config, n_windows: int) -> Config:
    """--epochs: total_steps from the training data's windows; --continue_on_error: never stop."""
    if cfg.epochs:
        cfg = dataclasses.replace(
            cfg, total_steps=max(1, math.ceil(cfg.epochs * n_windows / _global_rows(cfg)))
        )
    if cfg.compat.continue_on_error:
        cfg = dataclasses.replace(cfg, max_bad_steps=cfg.total_steps)
    return cfg


def epoch_at(cfg: Config, step: int, n_windows: int) -> float:
    """How many passes over the training data's windows `step` steps have made."""
    return step * _global_rows(cfg) / n_windows


def compat_notes(cfg: Config, n_windows: int) -> list[str]:
    """What the guides' flags that were set do here: one log line each."""
    defaults = CompatConfig()
    notes = [
        note.format(_get(cfg, path))
        for path, note in _COMPAT_NOTES.items()
        if _get(cfg, path) != getattr(defaults, path.split(".")[1])
    ]
    if cfg.compat.single_gpu:
        notes.append(f"--single_gpu: one process on device {cfg.dist.local_device_ids}")
    if cfg.compat.continue_on_error:
        notes.append(
            f"--continue_on_error: max_bad_steps = total_steps {cfg.total_steps}: non-finite "
            "steps are skipped (params unchanged) and never stop the run"
        )
    if cfg.epochs:
        notes.append(
            f"--epochs {cfg.epochs:g}: {n_windows:,} windows of {cfg.model.seq_len + 1} tokens "
            f"per epoch / batch {_global_rows(cfg)} = total_steps {cfg.total_steps}"
        )
    return notes


def resolve_mesh(mesh: MeshConfig, n_devices: int) -> MeshConfig:
    """Fill in the -1 axis; the product must be the device count (the error gives one that is)."""
    sizes = {a: getattr(mesh, a) for a in MESH_AXES}
    known = math.prod(n for n in sizes.values() if n != -1)
    free = [a for a, n in sizes.items() if n == -1]
    if free and n_devices % known == 0:
        sizes[free[0]] = n_devices // known
    if math.prod(sizes.values()) != n_devices:
        inner = {a: n for a, n in sizes.items() if a != "data" and n != -1}
        fits = n_devices % math.prod(inner.values()) == 0
        hint = (
            f"--mesh.data -1 {' '.join(f'--mesh.{a} {n}' for a, n in inner.items())}"
            if fits
            else f"--mesh.data -1 --mesh.fsdp {n_devices} --mesh.tensor 1"
        )
        raise ConfigError(
            f"mesh {_mesh_str({a: getattr(mesh, a) for a in MESH_AXES})} does not multiply to the "
            f"{n_devices} devices of this job; e.g. {hint}"
        )
    return dataclasses.replace(mesh, **sizes)


def with_topology(cfg: Config, n_devices: int, n_processes: int, platform: str = "cpu") -> Config:
    """Resolve the mesh and batch settings against the devices; errors give the numbers."""
    check_processes(cfg, n_processes)
    if cfg.dtype == "float16" and platform == "cpu":
        raise ConfigError(
            "dtype float16 needs a GPU (XLA:CPU has no float16 matmul with float32 accumulation); "
            "use --dtype bfloat16 on CPU"
        )
    if cfg.compat.backend == "nccl" and platform != "gpu":
        raise ConfigError(
            f"--backend nccl needs GPUs, but this job runs on {platform}; use --backend gloo or drop "
            "--backend (JAX picks NCCL between GPUs, gloo between CPU processes)"
        )
    if cfg.compat.single_gpu and n_devices != 1:
        raise ConfigError(
            f"--single_gpu but this process sees {n_devices} {platform} devices; on CPU drop "
            "--xla_force_host_platform_device_count from XLA_FLAGS, or drop --single_gpu"
        )
    mesh = resolve_mesh(cfg.mesh, n_devices)
    if cfg.model.d_model % mesh.fsdp:
        raise ConfigError(
            f"model.d_model {cfg.model.d_model} is not divisible by mesh.fsdp {mesh.fsdp}: FSDP splits "
            "every param along d_model; use an fsdp size that divides it"
        )
    # A tensor group shares its rows: the batch is split over data x fsdp only.
    shards = mesh.data * mesh.fsdp
    where = "devices" if shards == n_devices else "batch shards (mesh.data x mesh.fsdp)"
    batch, accum = cfg.batch_size, cfg.gradient_accumulation_steps
    if cfg.total_batch_size:
        rows = _global_rows(cfg)
        per_micro = cfg.device_batch_size * shards
        if rows % per_micro:
            raise ConfigError(
                f"total_batch_size {cfg.total_batch_size} tokens = {rows} sequences is not divisible by "
                f"device_batch_size {cfg.device_batch_size} x {shards} {where} = {per_micro}; "
                "change total_batch_size or device_batch_size"
            )
        batch, accum = rows, rows // per_micro
    micro = batch // accum
    if micro % shards:
        raise ConfigError(
            f"microbatch {micro} (batch_size {batch} / gradient_accumulation_steps {accum}) is not "
            f"divisible by {shards} {where}; use a batch_size that is a multiple of {accum * shards}"
        )
    return dataclasses.replace(cfg, batch_size=batch, gradient_accumulation_steps=accum, mesh=mesh)
