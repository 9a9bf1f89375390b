"""A run built once, from a job, before anything runs: model, optimizer, the state's shapes and
shardings, the jitted steps.

    run = build(job)                 # shapes only: no memory allocated (a joined job's preflight aside)
    train_step = run.compile_train()     # compiled for the job's devices
    state = run.init_state()             # or start.start_state(run, found)

Training (loop.py), `--task test|predict` (tasks.py) and the GPU planner (scripts/plan.py, whose
job's devices are a described GPU cluster, not this machine's) all start from the same `build`.
A joined job's kernels are checked on its devices first (the preflight, run/verdicts.py): the one
place a job meets its devices before its first compile, so training and every task get it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxtrain import faults as faults_lib
from jaxtrain import xla_env
from jaxtrain.config import Config, ConfigError
from jaxtrain.faults import FaultPlan, Faults
from jaxtrain.model.moe import active_params
from jaxtrain.model.params import param_count
from jaxtrain.model.transformer import GPT, flops_per_token
from jaxtrain.observe import gemms, links, peaks
from jaxtrain.observe import memory as memory_lib
from jaxtrain.parallel import expert
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.run import kernels, verdicts
from jaxtrain.run.job import Job
from jaxtrain.run.optim import make_optimizer
from jaxtrain.run.state import TrainState, abstract_state, init_state, state_sharding
from jaxtrain.run.step import compute_dtype, jit_steps
from jaxtrain.run.verdicts import Cleared


@dataclass(frozen=True)
class Run:
    job: Job
    mesh: Mesh
    model: GPT
    tx: optax.GradientTransformation
    abstract: TrainState  # shapes and dtypes of the state, no memory
    shardings: Any  # a NamedSharding for each leaf of the state
    train_step: jax.stages.Wrapped  # jitted, not yet compiled
    eval_step: jax.stages.Wrapped
    faults: FaultPlan  # the test-only faults of $JAXTRAIN_FAULTS, for the steps
    host_faults: Faults | None  # ...and this process's own (None: no faults, nothing to call)
    preflight: Cleared  # what the preflight at job start decided (run/verdicts.py)

    @property
    def cfg(self) -> Config:
        return self.job.cfg

    @property
    def target(self) -> Any:
        """The state as abstract arrays with their shardings: what restore and compile are given."""
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self.abstract, self.shardings
        )

    @property
    def batch_shape(self) -> jax.ShapeDtypeStruct:
        """One global batch: [global batch, seq_len + 1] int32, rows split over the batch axes."""
        rows, tokens = self.cfg.batch_size, self.cfg.model.seq_len + 1
        return jax.ShapeDtypeStruct((rows, tokens), jnp.int32, sharding=mesh_lib.batch_sharding(self.mesh))

    @property
    def attention(self) -> str:
        """The attention kernel the steps compile to on the job's devices: cudnn or xla."""
        return self.model.cfg.attention_impl

    @property
    def n_params(self) -> int:
        return param_count(self.abstract.params)

    @property
    def n_active_params(self) -> int:
        """Params each token computes with (a mixture of experts': only its routed experts')."""
        return active_params(self.cfg.model, self.n_params)

    @property
    def flops_per_token(self) -> float:
        return flops_per_token(self.cfg.model, self.n_active_params)

    @property
    def mfu_dtype(self) -> str:
        """Whose peak MFU is against: FP8's where the projections run in FP8 (model.matmul fp8: most
        of the FLOPs), else the compute dtype's (the planner's rule from the compiled GEMMs:
        plan/compiled.py `mfu_dtype`)."""
        return peaks.FP8 if self.cfg.model.matmul == "fp8" else self.cfg.dtype

    @property
    def state_bytes_per_device(self) -> int:
        specs = jax.tree.map(lambda s: s.spec, self.shardings)
        return mesh_lib.bytes_per_device(self.abstract, specs, self.mesh)

    def compile_train(self) -> jax.stages.Compiled:
        """The train step compiled ahead of time (no stall in step 1); out of memory is one line; an
        FP8 step whose FP8 products are not FP8 GEMMs is refused (`check_gemms`)."""
        try:
            if self.host_faults:
                self.host_faults.out_of_memory("compile")
            compiled = self.train_step.lower(self.target, self.batch_shape).compile(self.compiler_options)
        except jax.errors.JaxRuntimeError as e:
            if not memory_lib.is_out_of_memory(e):
                raise
            raise self.out_of_memory(e, "compiling the step", 0) from None
        self.check_gemms(compiled)
        return compiled

    def check_gemms(self, compiled: jax.stages.Compiled) -> None:
        """A ConfigError in one line where an FP8 job's step (model.matmul or head_matmul fp8),
        compiled for GPUs, multiplies some of its FP8-rounded products in other GEMMs: at bf16's
        speed (observe/gemms.py; a CPU's dots are the emulation, never refused)."""
        if "fp8" not in (self.cfg.model.matmul, self.cfg.model.head_matmul):
            return
        found, platform = gemms.census(compiled.as_text() or ""), self.mesh.devices.flat[0].platform
        why = gemms.refusal(found, platform)
        if why:
            raise ConfigError(why)
        if self.job.launch is not None and self.job.is_main:  # a joined job's log says what it checked
            logging.getLogger("jaxtrain").info(
                f"train step GEMMs: {gemms.summary(gemms.counts(found), platform)}"
            )

    def compile_eval(self) -> jax.stages.Compiled:
        return self.eval_step.lower(self.target.params, self.batch_shape).compile(self.compiler_options)

    @property
    def compiler_options(self) -> dict[str, str | bool] | None:
        fsdp_across_hosts = mesh_lib.spans_hosts(self.mesh, mesh_lib.FSDP_AXIS)
        return xla_env.compiler_options(self.cfg, self.mesh.devices.flat[0].platform, fsdp_across_hosts)

    def out_of_memory(self, error: BaseException, where: str, peak_bytes: int) -> memory_lib.OutOfMemory:
        """One line for a device out of memory at `where`, with the settings that lower the peak."""
        device = self.job.local_devices[0]
        exchange = self.model.cfg.moe.exchange  # as settled on these devices
        return memory_lib.out_of_memory(
            error, where, self.cfg, peak_bytes, device, len(self.job.local_devices), exchange
        )

    def init_state(self) -> TrainState:
        """A fresh state, initialised directly into its shardings: full params never sit on one device."""
        cfg, model, tx = self.cfg, self.model, self.tx
        init = jax.jit(lambda rng: init_state(cfg, model, tx, rng), out_shardings=self.shardings)
        return init(jax.random.key(cfg.seed))


def build(job: Job, faults: FaultPlan | None = None) -> Run:
    """Everything of a run that depends only on its config and devices; `faults`: $JAXTRAIN_FAULTS."""
    cfg = job.cfg
    mesh = mesh_lib.make_mesh(list(job.devices), cfg.mesh)
    mesh_lib.check_mesh(mesh)
    # The kernels settled once, for the job's devices (run/kernels.py): the model runs what it names.
    device, dtype = job.devices[0], compute_dtype(cfg)
    capability = getattr(device, "compute_capability", "")  # GPUs: "9.0"...
    seconds = None
    if cfg.model.moe.n_experts and mesh.shape[mesh_lib.EXPERT_AXIS] > 1:
        # One of its expert exchanges costed both ways, by the forecast's figures (observe/links.py):
        # auto's exchange on GPUs, the one the plan says is faster too.
        itemsize = jnp.dtype(cfg.model.dispatch or dtype).itemsize
        xfer = expert.one_exchange(cfg, mesh, itemsize)
        moe = cfg.model.moe
        wide = links.widen(moe.capacity_factor, mesh.shape[mesh_lib.EXPERT_AXIS])
        seconds = links.exchange_seconds(
            xfer, links.expert_load(moe.capacity_factor, moe.n_experts), wide=wide
        )
    settled = kernels.settle(cfg.model, device.platform, dtype, capability, cfg.mesh.tensor, seconds)
    faults = faults_lib.planned() if faults is None else faults
    host_faults = Faults.of(faults, job.process_index)
    # A joined job runs on these devices: its kernels are checked on them first (run/verdicts.py).
    # A described cluster (the planner, Job.of_devices) has nothing to run them on.
    cleared = Cleared(settled)
    if job.launch is not None and cfg.preflight != "off":
        cleared = verdicts.clear(job, settled, dtype, host_faults)
    model, tx = GPT(cleared.model, dtype=dtype), make_optimizer(cfg)
    abstract = abstract_state(cfg, model, tx)
    shardings = state_sharding(mesh, abstract, cfg.mesh.zero1)
    train_step, eval_step = jit_steps(cfg, model, tx, mesh, shardings, faults)
    return Run(job, mesh, model, tx, abstract, shardings, train_step, eval_step, faults, host_faults, cleared)
