"""The run configuration's schema: frozen dataclasses, one comment per key.
`scripts/train.py --help` prints this file's keys with their comments.

Loading (YAML, flags, aliases) is jaxtrain/config/load.py; the checks of values alone
jaxtrain/config/checks.py; rules that need the launch or the devices (process count, mesh, batch
split) are jaxtrain/run/job.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jaxtrain.errors import UserError


class ConfigError(UserError):
    """A config key, type or value that cannot be used."""


@dataclass(frozen=True)
class MoeConfig:
    """Mixture of experts (jaxtrain/model/moe.py): routed expert MLPs in place of the dense MLP."""

    n_experts: int = 0  # routed experts per MoE layer; 0 = a dense model
    experts_per_token: int = 2  # top-k: the experts each token is routed to (Mixtral 2, Qwen3-MoE 8)
    n_shared_experts: int = 0  # experts every token also passes through (one MLP of n x d_expert)
    d_shared: int = 0  # the shared experts' summed hidden size; 0 = n_shared_experts x d_expert
    shared_gate: bool = False  # the shared experts' output times sigmoid(x w), w [d, 1] (Qwen2-MoE)
    d_expert: int = 0  # each expert's hidden size; 0 = model.ff_dim
    every: int = 1  # layers every-1, 2*every-1, ... are MoE (1: every layer; Hugging Face's sparse step)
    first_dense: int = (
        0  # the first k layers stay dense MLPs of model.d_ff (DeepSeek's first_k_dense_replace)
    )
    dense_layers: str = ""  # comma-separated layers that stay dense, e.g. "0,5" (Qwen-MoE's mlp_only_layers)
    # softmax: top-k of the softmax (Mixtral, Qwen); sigmoid: per-expert sigmoid scores, the top-k
    # picked by score + a per-expert bias (`router_bias`: DeepSeek-V3's e_score_correction_bias)
    router: str = "softmax"
    n_group: int = 1  # experts in n_group groups; each token picks topk_group groups first (DeepSeek)
    topk_group: int = 1  # groups a token's experts come from (ranked by their top-2 scores' sum)
    renormalize: bool = True  # rescale the top-k router weights to sum to 1 (Mixtral, Qwen3-MoE)
    routed_scale: float = 1.0  # the routed experts' weights times this (DeepSeek's routed_scaling_factor)
    # Auxiliary-loss-free balancing (DeepSeek-V3, router sigmoid): after each step every expert's
    # router bias moves by this rate (gamma), down if it got more than an even share, up if less; 0 = off
    bias_update_rate: float = 0.0
    balance_coef: float = 0.01  # load-balancing loss coefficient (Switch; 1.0 when perfectly balanced)
    z_loss_coef: float = 0.0  # router z-loss coefficient (ST-MoE: mean logsumexp(logits)^2); 0 = off
    # Under mesh.expert, the copies a device receives (the rows its experts' grouped matmul runs over):
    # 0 = every peer's (dropless, mesh.expert x its own); c > 0: c x its own, the rest dropped
    capacity_factor: float = 0.0
    # auto | ragged_dot | blocks | pallas | pallas_fp8: the experts' grouped matmul (auto: blocks on
    # CPUs, the Pallas kernels on Hopper GPUs, on FP8 tiles (pallas_fp8) beside model.matmul fp8,
    # ragged_dot elsewhere; docs/moe.md, docs/fp8.md)
    grouped_matmul: str = "auto"
    # Under mesh.expert, how the copies reach their experts' devices: ragged (XLA's ragged all-to-all,
    # each peer exactly its rows: GPUs), padded (an all-to-all of each peer's rows padded to the
    # receive bound: any platform, more bytes); auto: ragged on GPUs, padded on CPUs (XLA:CPU has no
    # ragged one), and padded where the job-start preflight finds the ragged one wrong
    exchange: str = "auto"
    # The copies sent to the experts (and, in the backward, their gradient): compute = in the compute
    # dtype ("" too: run dirs written before auto); float8_e4m3fn = DeepSeek-V3's FP8 dispatch (each
    # 128 values scaled by their max): half the bytes, the experts' inputs rounded to 3 mantissa bits.
    # auto: float8_e4m3fn beside model.matmul fp8 under remat, compute otherwise (ModelConfig.dispatch).
    # Results come back in the compute dtype.
    dispatch_dtype: str = "auto"
    # Each MoE layer's tokens in this many pieces (a divisor of seq_len), each routed and exchanged
    # by itself, one after another, so one piece's exchange runs beside another's experts; under
    # capacity_factor each piece's receivers keep its share
    chunks: int = 1
    # Each MoE block runs a device's sequences in this many groups, each group through attention,
    # router, exchange and experts by itself, so one group's exchange runs beside another's compute
    # (Megatron's and DeepSeek's overlap of two microbatches, inside one step); must divide a
    # device's sequences in a microbatch; 1 = off
    overlap_groups: int = 1


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # token ids the model knows (256: bytes)
    seq_len: int = 256  # tokens per training sequence (the context)
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads
    d_model: int = 256  # width of the residual stream
    d_ff: int = 0  # 0 means 4 * d_model (gelu), or Llama's 2/3 of that rounded up to 256 (swiglu)
    pos_embedding: str = "rope"  # rope | learned
    rope_theta: float = 10000.0  # rotary base frequency
    norm_eps: float = 1e-5  # RMSNorm epsilon
    init_std: float = 0.02  # std of the initial weights (residual outputs scaled by depth)
    # Unrolled layers ran the backward 1.46x faster than scan on a 2-core CPU; scan keeps
    # compile time flat in depth, which matters for deep models. Measure both (bench/).
    scan_layers: bool = False
    remat: str = "none"  # none | full | dots (save matmul outputs, recompute the rest)
    attention_impl: str = "auto"  # auto | xla | cudnn  (jax.nn.dot_product_attention)
    # The output head with its loss, and each dense MLP, over each device's tokens in this many
    # pieces, each recomputed in the backward: whole [tokens, vocab] logits, or an MLP's hidden
    # activations for every token, never exist (model/head.py, mlp.py); 1: all at once
    token_chunks: int = 1
    # The Llama family (jaxtrain/hf/ maps these to and from Hugging Face classes)
    mlp: str = "gelu"  # gelu | swiglu (silu(x W_gate) * x W_up, then W_down)
    n_kv_head: int = 0  # key/value heads, grouped-query attention (1: multi-query); 0 = n_head
    head_dim: int = 0  # 0 = d_model // n_head
    tie_embeddings: bool = True  # False: a separate output head (lm_head)
    qk_norm: bool = False  # RMSNorm of each head's q and k before rotary positions (Qwen3)
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    # Scaled rotary frequencies when > 0 (rope_type): the long ones slowed by this factor
    rope_scaling_factor: float = 0.0
    rope_type: str = "llama3"  # llama3 (Llama 3.1's) | yarn (YaRN, DeepSeek-V3's and Qwen's long context)
    rope_low_freq_factor: float = 1.0  # Llama 3.1 rotary scaling: low-frequency factor
    rope_high_freq_factor: float = 4.0  # Llama 3.1 rotary scaling: high-frequency factor
    rope_original_context: int = 8192  # Llama 3.1 rotary scaling: the context it was trained at
    rope_beta_fast: float = 32.0  # YaRN: rotations past which a frequency is kept (extrapolated)
    rope_beta_slow: float = 1.0  # YaRN: rotations under which a frequency is divided by the factor
    # YaRN's attention factors (DeepSeek: 1 and 1; 0 = unset, as Hugging Face's): rotary parts scaled
    # by mscale(mscale) / mscale(mscale_all_dim), and latent attention's scores by mscale(all_dim)^2
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    # Multi-head latent attention (DeepSeek-V2/V3, model/mla.py) when kv_lora_rank > 0: keys and
    # values from one latent of this size (RMSNorm'd), plus a rotary key part shared by every head
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # MLA: queries through a latent of this size (RMSNorm'd); 0 = one projection
    rope_head_dim: int = 64  # MLA: the rotary part of each query and key head
    nope_head_dim: int = 128  # MLA: the part of each query and key head without positions
    v_head_dim: int = 128  # MLA: each value head's size
    rope_interleave: bool = True  # MLA: rotary pairs interleaved (x0, x1), (x2, x3) (DeepSeek's weights)
    # Packed documents (model/documents.py): attention never crosses them, positions restart in each.
    # The boundary token ids, set from the data's manifest (document_mask); -1: none
    doc_bos: int = -1  # a document starts with this token (Llama's BOS)
    doc_eos: int = -1  # a document ends with this token (GPT-2's <|endoftext|>, Qwen's)
    moe: MoeConfig = field(default_factory=MoeConfig)
    # The projections' matmuls (attention in and out, MLA's, the MLP, the shared experts): compute =
    # in the compute dtype; fp8 = e4m3 operands, e5m2 gradients, each tensor scaled by its current
    # max (needs dtype bfloat16; master weights, gradients and the optimizer stay float32; the router
    # stays in the compute dtype; the routed experts FP8 on Hopper (moe.grouped_matmul): docs/fp8.md)
    matmul: str = "compute"
    head_matmul: str = "compute"  # the output head's logits matmul: compute | fp8 (as model.matmul)

    @property
    def ff_dim(self) -> int:
        if self.d_ff:
            return self.d_ff
        if self.mlp == "swiglu":  # Llama: int(2/3 * 4d) rounded up to a multiple of 256
            return 256 * math.ceil(int(8 * self.d_model / 3) / 256)
        return 4 * self.d_model

    @property
    def expert_dim(self) -> int:
        """An expert MLP's hidden size (model.moe.d_expert, else the dense MLP's)."""
        return self.moe.d_expert or self.ff_dim

    @property
    def dispatch(self) -> str:
        """The dtype the experts' copies travel in ("": the compute dtype), moe.dispatch_dtype settled.
        auto takes FP8 where the projections already are (model.matmul fp8): the experts' inputs are
        then rounded as the projections' are, and the exchange moves half the bytes. Not without
        remat: the rounding lives in the exchange's own backward, which only remat runs."""
        named = self.moe.dispatch_dtype
        if named == "auto":
            return "float8_e4m3fn" if self.matmul == "fp8" and self.remat != "none" else ""
        return "" if named == "compute" else named

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        """Each query and key head's size."""
        if self.mla:
            return self.nope_head_dim + self.rope_head_dim
        return self.head_dim or self.d_model // self.n_head

    @property
    def v_size(self) -> int:
        """Each value head's size (MLA's apart from the query's)."""
        return self.v_head_dim if self.mla else self.head_size

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek's) in place of multi-head or grouped-query attention."""
        return self.kv_lora_rank > 0


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 6e-4  # peak learning rate (after warmup, then cosine)
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100  # linear warmup from 0 to lr
    weight_decay: float = 0.1  # matrices only
    b1: float = 0.9  # Adam beta1
    b2: float = 0.95  # Adam beta2
    eps: float = 1e-8  # Adam epsilon
    name: str = "adamw"  # adamw | muon (Muon for hidden matrices, AdamW at lr for the rest: optim.py)
    matrix_lr: float = 0.02  # Muon's peak lr (nanochat's matrix_lr)
    muon_momentum: float = 0.95  # Muon's momentum


@dataclass(frozen=True)
class DistConfig:
    """Explicit multi-process settings; unset values fall back to env vars, then SLURM."""

    coordinator_address: str = ""  # host:port
    num_processes: int = 0  # 0 = detect
    process_id: int = -1  # -1 = detect
    local_device_ids: str = ""  # comma-separated, "" = detect
    init_timeout: int = 300  # seconds to wait for every process to join


MESH_AXES = ("pipeline", "data", "expert", "fsdp", "context", "tensor")  # outer to inner


@dataclass(frozen=True)
class MeshConfig:
    """The device mesh, pipeline x data x expert x fsdp x context x tensor; its product is the device count.

    -1 means "the devices left over" (at most one axis). `data` is the outer axis and spans
    processes; `fsdp`, `context` and `tensor` stay inside a process (one NVLink domain) wherever they fit.
    """

    # pipeline parallel: the scanned layers split into this many stages of consecutive layers, the
    # outer axis (across hosts); the microbatches (gradient_accumulation_steps) flow through them
    pipeline: int = 1
    data: int = -1  # data parallel: replicas of the (fsdp x tensor)-sharded state
    # expert parallel (MoE): each device holds n_experts / expert of them, tokens sent by all-to-all;
    # the batch is split over it too, so for everything else it is one more data axis
    expert: int = 1
    fsdp: int = 1  # ZeRO-3: params, gradients and optimizer state sharded, batch split too
    # context parallel: each sequence split along its length (long windows), keys and values
    # all-gathered for attention; the batch is not split over it (like tensor)
    context: int = 1
    tensor: int = 1  # Megatron: heads, MLP hidden and vocab split; the batch is not
    zero1: bool = False  # ZeRO-1: also split the params and optimizer state over `data`
    # Lay the expert axis inside fsdp: each expert group on consecutive devices (one host, where it
    # fits), each fsdp group across them (hosts). The token all-to-all of every MoE layer stays on
    # NVLink and fsdp's per-layer gathers and reduce-scatters cross the network instead.
    expert_inner: bool = False
    # The expert exchange in two hops: the expert axis's devices in nodes of this many consecutive
    # ones (a host's, with expert_inner), a token sent once to each node holding one of its experts
    # (DeepSeek-V3's node-limited routing: at most topk_group), then inside the node to its experts;
    # each node's results summed before the way back. 0: one all-to-all over the whole axis.
    expert_node: int = 0
    # fsdp gathers params in the compute dtype (dtype) and reduce-scatters their gradients in this
    # one: float32 (torchtitan's reduce_dtype default) or compute (half the bytes, bf16 sums)
    reduce_dtype: str = "float32"


@dataclass(frozen=True)
class CompatConfig:
    """Flags of the PyTorch/DDP guides our users already type (docs/launching.md).

    Each is checked against the job or mapped onto our own keys; one without effect in JAX says
    so once in the log (compat_notes).
    """

    distributed: bool = False  # distribution is detected from the launcher
    local_rank: int = -1  # -1 = not given; else must equal the launcher's local rank
    world_size: int = 0  # 0 = not given; else the process count, or in one process its devices
    backend: str = "auto"  # auto | nccl | gloo: checked against the platform
    single_gpu: bool = False  # one process on one device
    skip_invalid_loss: bool = False  # what jaxtrain always does: non-finite steps are skipped
    continue_on_error: bool = False  # never stop for non-finite steps: max_bad_steps = total_steps
    find_unused_parameters: bool = False  # no effect: every parameter gets a gradient in JAX


@dataclass(frozen=True)
class DdpConfig:
    """The `ddp:` section of the PyTorch guides' YAML files."""

    enabled: bool = True  # as --distributed: distribution is detected; false refuses a multi-process job
    log_level: str = ""  # DEBUG | INFO | WARNING | ERROR on every process; "" = INFO on 0, WARNING elsewhere


@dataclass(frozen=True)
class Config:
    name: str = "default"  # the run's name: its run dir (runs/<name>) and wandb name
    # train | test (loss and perplexity of --resume_from) | predict (generate from --resume_from) |
    # chat (answer --prompt, or standard input, as a user turn of the tokenizer's chat template)
    task: str = "train"
    run_dir: str = ""  # "" means runs/<name> (test, predict: the checkpoint's run dir)
    overwrite: bool = False  # start fresh even if run_dir holds a different run
    # data: token files (nanoGPT raw uint16/uint32, or llm.c header): a file, a glob, a comma list
    # or a manifest.json; or a YAML list of {path, weight, name} sources (jaxtrain/data/sources.py);
    # "" = embedded default
    train_data_path: str = ""
    valid_data_path: str = ""  # validation tokens, same forms; "" = the training path's val shards
    token_dtype: str = "auto"  # auto | uint16 | uint32 (auto: header, else by vocab size)
    # auto: where the data's documents are framed by boundary tokens, attention never crosses them
    # (model.doc_bos / doc_eos are set from its manifest); off: packed windows attend across them
    document_mask: str = "auto"
    # Set from the data: its manifest holds loss masks (prepare_data.py --chat). The loss is then the
    # mean over the targets that take loss of the whole global batch (not a mean of row means)
    loss_mask: bool = False
    data_threads: int = 4  # 0: read in the training thread (torch's num_workers=0)
    prefetch: int = 4  # batches prepared ahead of the step
    # batch: batch_size is GLOBAL, in sequences, per optimizer step
    batch_size: int = 32
    total_batch_size: int = 0  # tokens per optimizer step; when set, derives accumulation
    device_batch_size: int = 0  # sequences per device per microbatch (with total_batch_size)
    gradient_accumulation_steps: int = 1  # microbatches per optimizer step (one gradient reduction)
    total_steps: int = 1000  # optimizer steps of the whole run
    epochs: float = 0  # > 0 replaces total_steps: epochs x windows in the training data / batch
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 | float16 (params stay float32)
    gradient_clip_val: float = 1.0  # global-norm clip; 0 disables
    max_bad_steps: int = 10  # stop after this many non-finite (skipped) steps in a row
    # fault tolerance
    watchdog_factor: float = 20.0  # a step over this many typical step times is a hang
    watchdog_timeout: float = 1800.0  # seconds any step, eval, save or restore may take; 0 disables
    preemption_check_interval: int = 10  # steps between multi-process checks for a stop signal
    lock_stale_s: float = 60.0  # a run dir lock whose heartbeat is this old (s) was left by a dead job
    seed: int = 0  # init and data order; the batch at a step depends only on data, seed, step
    # checkpoints
    resume_from: str = ""  # a checkpoint step dir, or a run's checkpoints/ dir
    init_from: str = ""  # a new run starting from that checkpoint's params (fresh optimizer, step 0)
    # test and predict tasks (jaxtrain/run/tasks.py)
    test_data_path: str = ""  # "" = valid_data_path, else the checkpoint's validation data
    prompt: str = ""  # --task predict: text to continue; --task chat: the user turn
    prompt_file: str = ""  # one prompt per line
    system: str = ""  # --task chat: a system turn before the user turn ("" = none)
    max_new_tokens: int = 256  # tokens --task predict or chat generates per prompt, at most
    temperature: float = 0.8  # sampling temperature (predict, chat, the end-of-run sample); 0 = greedy
    top_k: int = 40  # 0 = sample from the whole vocabulary
    # nanochat's one-number model: n_layer = depth, d_model = 64 * depth, heads of 128, optim.lr
    # 0.004 * (d_model / 768) ** -0.5; keys given beside it win. 0 = off
    depth: int = 0
    checkpoint_interval: int = 500  # steps between checkpoints (and one at the end)
    keep_checkpoints: int = 3  # newest checkpoints kept; older ones are deleted
    # logging (process 0 only)
    log_interval: int = 10  # steps between metric lines (process 0 logs, every process can warn)
    eval_interval: int = 200  # 0 disables
    eval_batches: int = 8  # validation batches per evaluation (the same ones every time)
    use_wandb: bool = False  # log metrics to Weights & Biases (process 0)
    wandb_project: str = "jaxtrain"  # wandb project
    wandb_run_name: str = ""  # wandb run name; "" = name
    wandb_mode: str = "online"  # online | offline (no network needed)
    progress_bar: bool = True  # a tqdm bar on process 0
    sample_tokens: int = 0  # tokens generated from the final model; 0 disables
    sample_prompt: str = "def "  # prompt of the end-of-run sample
    # where the time goes (docs/observability.md)
    profile_steps: str = ""  # "A:B" traces steps A..B-1 into <run_dir>/profile/ with jax.profiler
    profile_processes: str = "0"  # comma-separated process ids that trace, or "all"
    tensorboard: bool = False  # also write the training scalars as TensorBoard events (process 0)
    # Before the first compile, the kernels the job resolved to, run at its shapes on every local
    # device against the CPU-proven ones (docs/gpu_check.md; verdicts cached): auto checks the GPU-only
    # ones (cuDNN attention, the Pallas grouped matmul, the ragged exchange), on every kernel, off none
    preflight: str = "auto"
    compile_cache_dir: str = ""  # persistent compile cache; "" = $XDG_CACHE_HOME/jaxtrain/xla; "off"
    model: ModelConfig = field(default_factory=ModelConfig)
    verbose: bool = False  # every process logs at DEBUG level, and JAX logs each compilation
    optim: OptimConfig = field(default_factory=OptimConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    compat: CompatConfig = field(default_factory=CompatConfig)
    ddp: DdpConfig = field(default_factory=DdpConfig)

    @property
    def resolved_run_dir(self) -> Path:
        """The run dir on this host: the folder given, or for a bucket (gs://, s3://) this process's
        local folder of its records, which jaxtrain/disk/mirror.py copies up."""
        run_dir = self.run_dir or f"runs/{self.name}"
        if run_dir.startswith(BUCKET_SCHEMES):
            return Path(tempfile.gettempdir(), "jaxtrain-runs", str(os.getpid()), run_dir.replace("://", "/"))
        return Path(run_dir)

    @property
    def run_url(self) -> str | None:
        """The run dir's bucket URL (gs://, s3://), or None for a folder."""
        return self.run_dir.rstrip("/") if self.run_dir.startswith(BUCKET_SCHEMES) else None

    @property
    def checkpoint_dir(self) -> str:
        """Where the checkpoints are: in the bucket itself for a bucket run dir."""
        return f"{self.run_url}/checkpoints" if self.run_url else str(self.resolved_run_dir / "checkpoints")


SOURCE_LISTS = ("train_data_path", "valid_data_path")  # a YAML list of sources is a mixture
BUCKET_SCHEMES = ("gs://", "s3://")
# The path keys that may name a bucket (docs/object_storage.md); any other URL is refused at load.
BUCKET_KEYS = ("run_dir", "resume_from", "init_from", *SOURCE_LISTS)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config, for YAML and wandb."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def get(cfg: Config, path: str) -> Any:
    obj: Any = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def global_rows(cfg: Config) -> int:
    """Sequences per optimizer step, as the user gave them (total_batch_size wins)."""
    return cfg.total_batch_size // cfg.model.seq_len if cfg.total_batch_size else cfg.batch_size


def epoch_at(cfg: Config, step: int, n_windows: int) -> float:
    """How many passes over the training data's windows `step` steps have made."""
    return step * global_rows(cfg) / n_windows
