"""Attention kernel choice, and cuDNN attention in the GPU program compiled for 8 x H100 without a GPU.

The compile tests need the CUDA plugin of the installed jax outside the venv (`make gpu-plugin`
puts it in .cuda-plugin/; JAXTRAIN_CUDA_PLUGIN points elsewhere) and run in a subprocess, so the
plugin never loads into the CPU suite.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain import mesh as mesh_lib
from jaxtrain import model as model_lib
from jaxtrain.config import MeshConfig, ModelConfig
from jaxtrain.model import attention_kernel

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = Path(os.environ.get("JAXTRAIN_CUDA_PLUGIN", ROOT / ".cuda-plugin"))
TEMP_TARGET = 13e9  # bytes per device, gpt2_124m on 8 x H100 (26.3e9 with XLA's attention)


def test_auto_picks_cudnn_on_gpus_where_it_runs_and_xla_elsewhere():
    gpt2 = ModelConfig(d_model=768, n_head=12)  # head dim 64
    assert attention_kernel(gpt2, "gpu", jnp.bfloat16) == "cudnn"
    assert attention_kernel(gpt2, "gpu", "float16") == "cudnn"
    assert attention_kernel(gpt2, "gpu", "float32") == "xla"  # cuDNN's fused kernel: half types only
    assert attention_kernel(gpt2, "cpu", "bfloat16") == "xla"
    assert attention_kernel(ModelConfig(d_model=768, n_head=64), "gpu", "bfloat16") == "xla"  # head dim 12
    assert attention_kernel(ModelConfig(d_model=1024, n_head=4), "gpu", "bfloat16") == "xla"  # head dim 256
    assert attention_kernel(ModelConfig(attention_impl="xla"), "gpu", "bfloat16") == "xla"
    assert attention_kernel(ModelConfig(attention_impl="cudnn"), "cpu", "float32") == "cudnn"  # as asked


def test_kernel_runs_on_each_devices_rows_and_heads_inside_the_steps_shard_map():
    """The wrapper cuDNN runs in, checked with XLA's kernel on CPU: same values and gradients."""
    mesh = mesh_lib.make_mesh(shape=MeshConfig(data=2, fsdp=2, tensor=2))
    q, k, v = jax.random.normal(jax.random.key(0), (3, 8, 16, 4, 8))  # [B, T, N, H] each
    seen = []

    def kernel(q, k, v):
        seen.append(q.shape)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    def loss(q, k, v):
        return jnp.sum(model_lib._per_device(kernel, q, k, v) ** 2)

    def local(q, k, v):  # as the step runs the model: manual over the batch axes, tensor automatic
        with nn.logical_axis_rules(mesh_lib.ACTIVATION_RULES):
            out = model_lib._per_device(kernel, q, k, v)
            return out, *jax.grad(loss, (0, 1, 2))(q, k, v)  # differentiated inside, as the step does

    batch = P(mesh_lib.BATCH_AXES)
    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=batch,
        out_specs=batch,
        axis_names=set(mesh_lib.BATCH_AXES),
        check_vma=False,
    )
    out, *grads = jax.jit(sharded)(q, k, v)
    assert set(seen) == {(2, 16, 2, 8)}  # 8 rows over data x fsdp, 4 heads over tensor
    want = lambda q, k, v: jnp.sum(kernel(q, k, v) ** 2)  # noqa: E731
    np.testing.assert_allclose(out, kernel(q, k, v), atol=1e-5)
    for g, w in zip(grads, jax.grad(want, (0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)


# Compiles configs/gpt2_124m.yaml (attention_impl auto) for each case and prints one JSON line
# each: the cuDNN attention calls, the q operand of the forward call, and the temp bytes.
_COMPILE = r"""
import json, re, sys
import jax
from jax.experimental import topologies
from jaxtrain import config, mesh as mesh_lib, state as state_lib, step as step_lib
from jaxtrain.model import GPT
from jaxtrain.optim import make_optimizer

H100 = '''gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3350000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 28 }
runtime_version { major: 12 minor: 9 }
device_description_str: "NVIDIA H100 80GB HBM3"
'''
for hosts, args in json.loads(sys.argv[1]):
    topology = topologies.get_topology_desc(platform="cuda", target_config=H100, topology=f"1x{hosts}x8")
    devices = list(topology.devices)
    cfg = config.with_topology(
        config.load_config(["--config", "configs/gpt2_124m.yaml", *args]), len(devices), hosts, "gpu"
    )
    mesh = mesh_lib.make_mesh(devices=devices, shape=cfg.mesh)
    model, tx = GPT(cfg.model, dtype=step_lib.compute_dtype(cfg)), make_optimizer(cfg)
    abstract = state_lib.abstract_state(cfg, model, tx)
    shardings = state_lib.state_sharding(mesh, abstract, cfg.mesh.zero1)
    train, _ = step_lib.jit_steps(cfg, model, tx, mesh, shardings)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    rows = (cfg.batch_size, cfg.model.seq_len + 1)
    batch = jax.ShapeDtypeStruct(rows, "int32", sharding=mesh_lib.batch_sharding(mesh))
    compiled = train.lower(state, batch).compile()
    text = compiled.as_text()
    print(json.dumps({
        "calls": sorted(set(re.findall(r'custom_call_target="(__cudnn\$fmha\w*)"', text))),
        "q": re.findall(r'"__cudnn\$fmhaSoftmax", operand_layout_constraints=\{(\w+\[[\d,]+\])', text),
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
    }), flush=True)
"""

# (hosts of 8 GPUs, flags, the q operand each device's forward call must see: [B, T, heads, head dim])
CASES = [
    (1, [], "bf16[16,1024,12,64]"),  # data 8, as configured
    (
        1,
        ["--dtype", "float16", "--mesh.data", "1", "--mesh.fsdp", "4", "--mesh.tensor", "2"],
        "f16[16,1024,6,64]",
    ),
    (2, [], "bf16[16,1024,12,64]"),  # data 16 across 2 hosts
]


@pytest.fixture(scope="module")
def compiled():
    if not (PLUGIN / "jax_plugins").is_dir():
        pytest.skip(f"no CUDA plugin in {PLUGIN}: run `make gpu-plugin` or set JAXTRAIN_CUDA_PLUGIN")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(PLUGIN), JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
    cases = json.dumps([(hosts, args) for hosts, args, _ in CASES])
    out = subprocess.run(
        [sys.executable, "-c", _COMPILE, cases],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", range(len(CASES)), ids=["data8_bf16", "fsdp4_tensor2_fp16", "2hosts_data16_bf16"]
)
def test_gpt2_compiles_to_cudnn_attention_on_h100s(compiled, case):
    result, q = compiled[case], CASES[case][2]
    assert result["calls"] == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"], result
    assert set(result["q"]) == {q}, result  # each device's own rows, heads split by tensor
    assert result["temp_bytes"] <= TEMP_TARGET, result
