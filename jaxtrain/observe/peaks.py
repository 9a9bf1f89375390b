"""Dense peak FLOP/s of the accelerators we know, each figure with its source: the denominator of
the MFU training logs (jaxtrain/observe/metrics.py) and of the plan's compute bound
(jaxtrain/plan/targets.py). Never imports jax: the planner reads it before jax starts.

Keyed by a substring of jax's device_kind, first match first ("H100 PCIe" before "H100", "L40S"
before "L4"). MFU is against the peak of the dtype that runs (`peak_flops`): bfloat16's for
bfloat16 and float16 (the same on all of these); TF32's for float32 (float32 matmuls run as TF32
under XLA's default precision); FP8's where the matmuls run in FP8 (None: no such unit). NVIDIA's
datasheets print sparse rates too, twice these. Sources:
  [H100]  NVIDIA H100 Tensor Core GPU datasheet (SXM5 and PCIe columns),
          https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
  [H200]  NVIDIA H200 Tensor Core GPU datasheet (SXM column), https://www.nvidia.com/en-us/data-center/h200/
  [A100]  NVIDIA A100 Tensor Core GPU datasheet,
          https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
  [L40S]  NVIDIA L40S datasheet, https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413
  [B200]  NVIDIA HGX B200 / DGX B200 datasheets (8-GPU totals divided by 8, sparse rates halved),
          https://www.nvidia.com/en-us/data-center/hgx/ and https://www.nvidia.com/en-us/data-center/dgx-b200/
  [L4] [A10] [V100]  NVIDIA's datasheets, https://www.nvidia.com/en-us/data-center/l4/,
          https://www.nvidia.com/en-us/data-center/products/a10-gpu/, https://www.nvidia.com/en-us/data-center/v100/
  [TPU]   Google Cloud TPU docs, the system architecture of each version (peak bfloat16 per chip),
          https://cloud.google.com/tpu/docs/system-architecture-tpu-vm
"""

from __future__ import annotations

# (device_kind substring, bfloat16, TF32, FP8) in FLOP/s
PEAK_FLOPS: tuple[tuple[str, float, float | None, float | None], ...] = (
    ("H200", 989.4e12, 494.7e12, 1978.9e12),  # [H200] the same GH100 compute as H100 SXM
    ("H100 PCIe", 756e12, 378e12, 1513e12),  # [H100]
    ("H100", 989.4e12, 494.7e12, 1978.9e12),  # [H100]
    ("A100", 312e12, 156e12, None),  # [A100] 40GB and 80GB alike; no FP8 unit
    ("L40S", 362.05e12, 183e12, 733e12),  # [L40S] 1,466 TFLOPS FP8 with sparsity
    ("L4", 121e12, 60e12, 242.5e12),  # [L4] 485 TFLOPS FP8 with sparsity
    ("A10", 125e12, 62.5e12, None),  # [A10]
    ("B200", 2.25e15, 1.125e15, 4.5e15),  # [B200] 36, 18 and 72 PFLOPS with sparsity per 8 GPUs
    ("V100", 125e12, None, None),  # [V100] its fp16 tensor cores: no bfloat16, TF32 or FP8 units
    ("TPU v6", 918e12, None, None),  # [TPU]
    ("TPU v5p", 459e12, None, None),  # [TPU]
    ("TPU v5", 197e12, None, None),  # [TPU] v5e ("TPU v5 lite")
    ("TPU v4", 275e12, None, None),  # [TPU]
)
FP8 = "float8"  # the name peak_flops takes for matmuls run in FP8 (either of e4m3 and e5m2)


def peak_flops(device_kind: str, dtype: str = "bfloat16") -> float | None:
    """A device's dense peak for the dtype its matmuls run in: TF32's for float32, FP8's for
    float8 (any `float8*` name), else bfloat16's; None when the table has none (CPUs, or no FP8
    unit)."""
    for key, bf16, tf32, fp8 in PEAK_FLOPS:
        if key in device_kind:
            return tf32 if dtype == "float32" else fp8 if dtype.startswith(FP8) else bf16
    return None
