"""The kernels a job runs, settled once where it meets its devices: attention (cuDNN's fused kernel
or XLA's) and a mixture of experts' grouped matmul (model/grouped.py's Pallas kernels on Hopper,
XLA's `ragged_dot`, or padded `blocks`), with the one rule for each limit that depends on the GPU.

`settle` turns `auto` into a kernel and refuses an explicit choice the devices cannot run, in one
line, before anything is traced; the model then runs what its config names (model/attention.py,
model/moe.py). `build` settles the model it compiles (run/build.py), so training, the planner and
the tasks run the same kernels for the same devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxtrain.config import ConfigError, ModelConfig
from jaxtrain.model import grouped

# cuDNN's fused (flash) attention: half or bfloat16 inputs, head dim a multiple of 8 up to 128, or
# 256 on Hopper and later (compute capability 9.0: DeepSeek-V3's 192). jax's own checks, in
# jax/_src/cudnn/fused_attention_stablehlo.py (check_layout, check_is_flash_attention).
_CUDNN_DTYPES = ("bfloat16", "float16")


def cudnn_max_head_dim(capability: str) -> int:
    """The largest head cuDNN's fused attention takes on GPUs of this compute capability ("9.0")."""
    major = int(capability.split(".")[0]) if capability else 0
    return 256 if major >= 9 else 128


def attention(cfg: ModelConfig, platform: str, dtype: Any, capability: str = "") -> str:
    """The causal attention kernel a run compiles to, "cudnn" or "xla" (attention_impl settled).

    `platform` is the devices' ("gpu", "cpu", ...: jax's Device.platform), `dtype` the compute
    dtype, `capability` a GPU's compute capability ("9.0"). auto picks cuDNN on GPUs wherever it
    supports the dtype and head dim, XLA elsewhere (jax's own `implementation=None` always takes
    XLA's path, which materialises T x T scores: 25 GB of DeepSeek-V3's temporaries, planned).
    An explicit cudnn the devices cannot run is refused in one line.
    """
    most = cudnn_max_head_dim(capability)
    if cfg.attention_impl == "cudnn":
        if platform != "gpu":
            raise ConfigError(
                f"model.attention_impl cudnn needs NVIDIA GPUs, and this job runs on {platform}; "
                "use model.attention_impl auto"
            )
        if cfg.head_size > most:
            raise ConfigError(
                f"model.attention_impl cudnn takes heads of at most {most} on GPUs of compute "
                f"capability {capability or 'unknown'}, and this model's are {cfg.head_size}; use "
                "model.attention_impl auto (XLA's kernel)"
            )
    if cfg.attention_impl != "auto":
        return cfg.attention_impl
    fits = jnp.dtype(dtype).name in _CUDNN_DTYPES and cfg.head_size % 8 == 0 and cfg.head_size <= most
    return "cudnn" if platform == "gpu" and fits else "xla"


def grouped_matmul(
    cfg: ModelConfig, platform: str, capability: str = "", tensor: int = 1, dtype: Any = "bfloat16"
) -> str:
    """The experts' grouped matmul on these devices (moe.grouped_matmul settled): `blocks` on CPUs,
    the Pallas kernels on Hopper where their tiles take the widths (each expert's hidden dim split
    over `tensor`) and the compute `dtype`, XLA's `ragged_dot` on other GPUs. An explicit pallas they
    cannot run is refused. `pallas_fp8` (the same kernels on FP8 tiles, model/grouped_fp8.py) is
    auto's pick on Hopper beside model.matmul fp8 (Qwen3-30B-A3B on 4 x 8 plans 1.19x the bf16
    tiles there, docs/fp8.md), and only there: named without FP8 projections it is refused.
    Never run on a GPU when it shipped: the job-start preflight checks it, and a failing one falls
    back to the bf16 tiles (`fallen_back`)."""
    why = grouped.refusal(platform, capability, cfg.d_model, cfg.expert_dim // tensor)
    if not why and jnp.dtype(dtype).itemsize > 2:
        # The tiles fill 160 KB of H100's 227 KB of shared memory at two bytes a value (grouped.py):
        # four-byte values need twice that, and Mosaic refuses them when it compiles.
        why = (
            f"model.moe.grouped_matmul pallas takes bfloat16 or float16, not {jnp.dtype(dtype).name} (its "
            "tiles would need twice H100's shared memory); use --dtype bfloat16 or grouped_matmul auto"
        )
    named = cfg.moe.grouped_matmul
    if named in ("pallas", "pallas_fp8") and why:
        raise ConfigError(why)
    if named == "pallas_fp8" and cfg.matmul != "fp8":
        raise ConfigError(
            "model.moe.grouped_matmul pallas_fp8 multiplies the experts in FP8 beside FP8 projections; "
            "add --model.matmul fp8 --dtype bfloat16, or use grouped_matmul pallas (bf16 tiles)"
        )
    if named != "auto":
        return named
    if platform == "cpu":
        return "blocks"
    if capability != grouped.HOPPER or why:
        return "ragged_dot"
    return "pallas_fp8" if cfg.matmul == "fp8" else "pallas"


def exchange(cfg: ModelConfig, platform: str) -> str:
    """How the experts' copies cross the expert axis on these devices (moe.exchange settled): XLA's
    ragged all-to-all on GPUs, the padded all-to-all on CPUs (XLA:CPU has none ragged). An explicit
    ragged off GPUs is refused."""
    if cfg.moe.exchange == "ragged" and platform != "gpu":
        raise ConfigError(
            f"model.moe.exchange ragged needs GPUs (XLA:{platform.upper()} has no ragged all-to-all); "
            "use model.moe.exchange auto"
        )
    if cfg.moe.exchange != "auto":
        return cfg.moe.exchange
    return "ragged" if platform == "gpu" else "padded"


def settle(cfg: ModelConfig, platform: str, dtype: Any, capability: str = "", tensor: int = 1) -> ModelConfig:
    """`cfg` with its kernels settled for devices of `platform` and `capability`, compute `dtype` and
    a tensor axis of `tensor` devices; ConfigError for a kernel they cannot run."""
    moe = cfg.moe
    if moe.n_experts:
        moe = dataclasses.replace(
            moe,
            grouped_matmul=grouped_matmul(cfg, platform, capability, tensor, dtype),
            exchange=exchange(cfg, platform),
        )
    return dataclasses.replace(cfg, attention_impl=attention(cfg, platform, dtype, capability), moe=moe)


def fallen_back(cfg: ModelConfig, kind: str) -> ModelConfig | None:
    """`cfg` with the kernel of `kind` (attention, grouped_matmul, exchange) set to the one proven on
    CPU (for the FP8 grouped matmul, its bf16 kernels), what auto runs when the preflight finds its
    choice wrong on these devices (run/verdicts.py); None where there is none to fall back to (it is
    the one that failed, or `kind` has no other)."""
    if kind == "attention" and cfg.attention_impl != "xla":
        return dataclasses.replace(cfg, attention_impl="xla")
    if kind == "grouped_matmul" and cfg.moe.grouped_matmul != "ragged_dot":
        # The FP8 kernels fall back to the same kernels on bf16 tiles (an H200 ran those: docs/moe.md)
        bf16 = "pallas" if cfg.moe.grouped_matmul == "pallas_fp8" else "ragged_dot"
        return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, grouped_matmul=bf16))
    if kind == "exchange" and cfg.moe.exchange != "padded":
        return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, exchange="padded"))
    return None
