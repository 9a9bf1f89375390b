"""Dense peak FLOP/s of the accelerators we know, each figure with its source: the denominator of
the MFU training logs (jaxtrain/observe/metrics.py) and of the plan's compute bound
(jaxtrain/plan/targets.py). Never imports jax: the planner reads it before jax starts.

Keyed by a substring of jax's device_kind, first match first ("H100 PCIe" before "H100", "L40S"
before "L4"). bfloat16: fp16 is the same on all of these, and MFU is logged against it; TF32:
float32 matmuls run as TF32 under XLA's default precision (None: the device has no such unit).
NVIDIA's datasheets print sparse rates too, twice these. Sources:
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

# (device_kind substring, bfloat16, TF32) in FLOP/s
PEAK_FLOPS: tuple[tuple[str, float, float | None], ...] = (
    ("H200", 989.4e12, 494.7e12),  # [H200] the same GH100 compute as H100 SXM
    ("H100 PCIe", 756e12, 378e12),  # [H100]
    ("H100", 989.4e12, 494.7e12),  # [H100]
    ("A100", 312e12, 156e12),  # [A100] 40GB and 80GB alike
    ("L40S", 362.05e12, 183e12),  # [L40S]
    ("L4", 121e12, 60e12),  # [L4]
    ("A10", 125e12, 62.5e12),  # [A10]
    ("B200", 2.25e15, 1.125e15),  # [B200] 36 and 18 PFLOPS with sparsity per 8 GPUs
    ("V100", 125e12, None),  # [V100] its fp16 tensor cores: no bfloat16 or TF32 units
    ("TPU v6", 918e12, None),  # [TPU]
    ("TPU v5p", 459e12, None),  # [TPU]
    ("TPU v5", 197e12, None),  # [TPU] v5e ("TPU v5 lite")
    ("TPU v4", 275e12, None),  # [TPU]
)


def peak_flops(device_kind: str, dtype: str = "bfloat16") -> float | None:
    """A device's dense peak for a step's compute dtype: TF32's for float32, else bfloat16's; None
    when the table has none (CPUs)."""
    for key, bf16, tf32 in PEAK_FLOPS:
        if key in device_kind:
            return tf32 if dtype == "float32" else bf16
    return None
