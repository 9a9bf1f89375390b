"""What `auto` means for each kernel, written once: the attention, grouped matmul and expert exchange
a model runs on devices of a platform ("gpu", "cpu"), compute capability ("9.0") and compute dtype,
and the kernels proven on CPU (`PROVEN`): what a model applied outside a job runs for auto (no
devices known: model/attention.py, model/moe.py, parallel/expert.py) and where every fallback ends
(`FALLBACK`).

run/kernels.py settles a job's config by these rules (and refuses a named kernel its devices cannot
run); the health check (health/numerics.py) and the GPU check ask them which GPU-only kernels a
device runs. Plain functions of their arguments: nothing here asks where it runs.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxtrain.model import grouped

# The kernels proven on CPU, the references every GPU-only kernel is checked against (run/preflight.py)
PROVEN = {"attention": "xla", "grouped_matmul": "ragged_dot", "exchange": "padded"}
# Each kernel's next where the preflight finds it wrong on a job's devices, down to PROVEN's: the FP8
# tiles to the bf16 tiles (run only where a preflight proves them there: run/verdicts.py), those to
# XLA's ragged_dot.
FALLBACK = {"cudnn": "xla", "pallas_fp8": "pallas", "pallas": "ragged_dot", "blocks": "ragged_dot",
            "ragged": "padded"}  # fmt: skip
# cuDNN's fused (flash) attention: half or bfloat16 inputs, head dim a multiple of 8 up to 128, or
# 256 on Hopper and later (compute capability 9.0: DeepSeek-V3's 192). jax's own checks, in
# jax/_src/cudnn/fused_attention_stablehlo.py (check_layout, check_is_flash_attention).
_CUDNN_DTYPES = ("bfloat16", "float16")


def outside_a_job(kind: str, named: str) -> str:
    """The kernel a model runs for `named` where no job settled it (tests, a model applied alone):
    the one proven on CPU for auto, else the one named."""
    return PROVEN[kind] if named == "auto" else named


def cudnn_max_head_dim(capability: str) -> int:
    """The largest head cuDNN's fused attention takes on GPUs of this compute capability ("9.0")."""
    major = int(capability.split(".")[0]) if capability else 0
    return 256 if major >= 9 else 128


def attention(platform: str, dtype: Any, head_size: int, capability: str = "") -> str:
    """auto's attention: cuDNN's on GPUs wherever it takes the dtype and head size, XLA's elsewhere
    (jax's own `implementation=None` always takes XLA's path, which materialises T x T scores: 25 GB
    of DeepSeek-V3's temporaries, planned)."""
    fits = (
        jnp.dtype(dtype).name in _CUDNN_DTYPES
        and head_size % 8 == 0
        and head_size <= cudnn_max_head_dim(capability)
    )
    return "cudnn" if platform == "gpu" and fits else "xla"


def pallas_refusal(platform: str, capability: str, d_model: int, expert_dim: int, dtype: Any) -> str | None:
    """Why the Pallas grouped matmul cannot run here (model/grouped.py `refusal`: Hopper, tiles that
    take the widths; each expert's hidden dim `expert_dim` as one device holds it), or None."""
    why = grouped.refusal(platform, capability, d_model, expert_dim)
    if not why and jnp.dtype(dtype).itemsize > 2:
        # The tiles fill 160 KB of H100's 227 KB of shared memory at two bytes a value (grouped.py):
        # four-byte values need twice that, and Mosaic refuses them when it compiles.
        why = (
            f"model.moe.grouped_matmul pallas takes bfloat16 or float16, not {jnp.dtype(dtype).name} (its "
            "tiles would need twice H100's shared memory); use --dtype bfloat16 or grouped_matmul auto"
        )
    return why


def grouped_matmul(
    platform: str, capability: str, d_model: int, expert_dim: int, dtype: Any, fp8: bool = False
) -> str:
    """auto's grouped matmul: `blocks` on CPUs, the Pallas kernels on Hopper where they can run
    (`pallas_refusal`), on FP8 tiles beside FP8 projections (`fp8`: Qwen3-30B-A3B on 4 x 8 plans
    1.19x the bf16 tiles there, docs/fp8.md), XLA's `ragged_dot` on other GPUs."""
    if platform == "cpu":
        return "blocks"
    if capability != grouped.HOPPER or pallas_refusal(platform, capability, d_model, expert_dim, dtype):
        return "ragged_dot"
    return "pallas_fp8" if fp8 else "pallas"


def exchange(platform: str | None, seconds: dict[str, float] | None = None) -> str:
    """auto's expert exchange: on GPUs the faster of XLA's ragged all-to-all and the padded one by
    `seconds`, one exchange of the job costed both ways (observe/links.py exchange_seconds: inside a
    host XLA's one-shot kernel is the slower, across hosts its per-slot sends against the padded
    one's peers x bytes), the ragged one without them; the padded all-to-all elsewhere (XLA:CPU has
    none ragged; None: no devices known)."""
    if platform != "gpu":
        return "padded"
    return "padded" if seconds and seconds["padded"] < seconds["ragged"] else "ragged"
