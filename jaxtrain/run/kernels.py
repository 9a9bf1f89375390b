"""The kernels a job runs, settled once where it meets its devices: attention (cuDNN's fused kernel
or XLA's) and a mixture of experts' grouped matmul (model/grouped.py's Pallas kernels on Hopper,
XLA's `ragged_dot`, or padded `blocks`) and the experts' exchange, by each one's `auto` rule
(model/auto.py, the one place it is written: the health check reads it too).

`settle` turns `auto` into a kernel and refuses an explicit choice the devices cannot run, in one
line, before anything is traced; the model then runs what its config names (model/attention.py,
model/moe.py). `build` settles the model it compiles (run/build.py), so training, the planner and
the tasks run the same kernels for the same devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxtrain.config import ConfigError, ModelConfig
from jaxtrain.model import auto


def attention(cfg: ModelConfig, platform: str, dtype: Any, capability: str = "") -> str:
    """The causal attention kernel a run compiles to, "cudnn" or "xla" (attention_impl settled).

    `platform` is the devices' ("gpu", "cpu", ...: jax's Device.platform), `dtype` the compute
    dtype, `capability` a GPU's compute capability ("9.0"). auto: model/auto.py's rule (cuDNN on
    GPUs wherever it takes the dtype and head size, XLA elsewhere). An explicit cudnn the devices
    cannot run is refused in one line.
    """
    most = auto.cudnn_max_head_dim(capability)
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
    return auto.attention(platform, dtype, cfg.head_size, capability)


def grouped_matmul(
    cfg: ModelConfig, platform: str, capability: str = "", tensor: int = 1, dtype: Any = "bfloat16"
) -> str:
    """The experts' grouped matmul on these devices (moe.grouped_matmul settled): auto by
    model/auto.py's rule (`blocks` on CPUs, the Pallas kernels on Hopper where their tiles take the
    widths, each expert's hidden dim split over `tensor`, and the compute `dtype`; on FP8 tiles,
    `pallas_fp8` (model/grouped_fp8.py), beside model.matmul fp8; XLA's `ragged_dot` on other
    GPUs). An explicit pallas they cannot run is refused, and pallas_fp8 named without FP8
    projections. The job-start preflight checks the Pallas kernels; a failing one falls back
    (`fallen_back`)."""
    why = auto.pallas_refusal(platform, capability, cfg.d_model, cfg.expert_dim // tensor, dtype)
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
    return auto.grouped_matmul(
        platform, capability, cfg.d_model, cfg.expert_dim // tensor, dtype, cfg.matmul == "fp8"
    )


def exchange(cfg: ModelConfig, platform: str, seconds: dict[str, float] | None = None) -> str:
    """How the experts' copies cross the expert axis on these devices (moe.exchange settled): auto
    by model/auto.py's rule (on GPUs the faster by `seconds`, one of the job's exchanges costed both
    ways; the padded all-to-all on CPUs). An explicit ragged off GPUs is refused."""
    if cfg.moe.exchange == "ragged" and platform != "gpu":
        raise ConfigError(
            f"model.moe.exchange ragged needs GPUs (XLA:{platform.upper()} has no ragged all-to-all); "
            "use model.moe.exchange auto"
        )
    if cfg.moe.exchange != "auto":
        return cfg.moe.exchange
    return auto.exchange(platform, seconds)


def settle(
    cfg: ModelConfig,
    platform: str,
    dtype: Any,
    capability: str = "",
    tensor: int = 1,
    exchange_seconds: dict[str, float] | None = None,
) -> ModelConfig:
    """`cfg` with its kernels settled for devices of `platform` and `capability`, compute `dtype`, a
    tensor axis of `tensor` devices and one expert exchange costed both ways (`exchange_seconds`);
    ConfigError for a kernel they cannot run."""
    moe = cfg.moe
    if moe.n_experts:
        moe = dataclasses.replace(
            moe,
            grouped_matmul=grouped_matmul(cfg, platform, capability, tensor, dtype),
            exchange=exchange(cfg, platform, exchange_seconds),
        )
    return dataclasses.replace(cfg, attention_impl=attention(cfg, platform, dtype, capability), moe=moe)


def kernel(cfg: ModelConfig, kind: str) -> str:
    """The kernel of `kind` (attention, grouped_matmul, exchange) `cfg` names."""
    return {"attention": cfg.attention_impl, "grouped_matmul": cfg.moe.grouped_matmul,
            "exchange": cfg.moe.exchange}[kind]  # fmt: skip


def with_kernel(cfg: ModelConfig, kind: str, impl: str) -> ModelConfig:
    """`cfg` running `impl` for the kernel of `kind`."""
    if kind == "attention":
        return dataclasses.replace(cfg, attention_impl=impl)
    if kind == "grouped_matmul":
        return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, grouped_matmul=impl))
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, exchange=impl))


def fallen_back(cfg: ModelConfig, kind: str) -> ModelConfig | None:
    """`cfg` with the kernel of `kind` (attention, grouped_matmul, exchange) set to the next of its
    fallback chain (model/auto.py FALLBACK: the FP8 tiles to the bf16 tiles, those and `blocks` to
    ragged_dot, cuDNN's attention to XLA's, the ragged exchange to the padded one), what auto runs
    when the preflight finds its choice wrong on these devices (run/verdicts.py, which proves a
    GPU-only next kernel there before it runs it, else goes on down the chain to the one proven on
    CPU); None where there is none to fall back to (the CPU-proven one failed)."""
    after = auto.FALLBACK.get(kernel(cfg, kind))
    return with_kernel(cfg, kind, after) if after else None


def proven_on_cpu(cfg: ModelConfig, kind: str) -> bool:
    """Whether `cfg`'s kernel of `kind` is proven on CPU (model/auto.py PROVEN): a fallback's end."""
    return kernel(cfg, kind) == auto.PROVEN[kind]
