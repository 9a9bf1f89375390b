"""The training run, start to end: join, build, restore or init, then a plain loop over the step.

    train(cfg, launch)    # scripts/train.py --task train; `launch` from cluster.detect

`train` does the checks every process can make alone, joins the job (job.py), builds the run
(build.py) and hands it to `_train`, which reads top to bottom in titled sections: start, step, log,
eval, save, end. Its collaborators each own one concern: `metrics.StepTracker` per-step
bookkeeping and logging, `_Evaluator` the validation loss, `_Saver` checkpoints and their goodput time; the
watchdog, the profiler and the stop request are asked at fixed places.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxtrain import config as config_lib
from jaxtrain import versions
from jaxtrain.cluster.detect import LaunchSpec
from jaxtrain.cluster.watchdog import Watchdog
from jaxtrain.config import Config
from jaxtrain.data import loader, sources
from jaxtrain.data.default import run_tokenizer
from jaxtrain.disk import bucket, rundir, runlock, storage
from jaxtrain.disk import checkpoint as ckpt_lib
from jaxtrain.disk.mirror import open_mirror
from jaxtrain.errors import NonFiniteError, StorageError
from jaxtrain.faults import Faults
from jaxtrain.model.generate import generate
from jaxtrain.model.params import param_summary
from jaxtrain.observe import memory as memory_lib
from jaxtrain.observe import metrics
from jaxtrain.observe.goodput import Timeline, end_reason
from jaxtrain.observe.profiling import Profiler
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.run import evaluate, start
from jaxtrain.run.background import Background
from jaxtrain.run.build import Run, build
from jaxtrain.run.job import Job, check_launch
from jaxtrain.run.preemption import StopRequest
from jaxtrain.run.resolve import Resolved, resolve
from jaxtrain.xla_env import DROPPED, compile_cache_dir

log = logging.getLogger("jaxtrain")


@dataclasses.dataclass
class RunResult:
    final_step: int
    last_loss: float | None
    val_loss: float | None
    run_dir: Path


def train(cfg: Config, launch: LaunchSpec, launch_time: float | None = None) -> RunResult:
    """Run (or resume) the training job described by cfg on every device of every process.

    launch_time: when this launch's process started (unix s), for goodput; default now.
    """
    launch_time = time.time() if launch_time is None else launch_time
    # Every process checks what it can alone before any connection: the same error everywhere.
    # (A process that fails after joining leaves while its peers may still be starting their
    # backends, and they die in JAX's own abort instead of saying the same line.)
    rundir.restrict_umask()  # nothing it writes into the run dir is world-writable
    check_launch(cfg, launch)
    metrics.check_wandb(cfg)
    data = resolve(cfg)
    # A run dir in a bucket: checked (bucket, credentials, writable), its records pulled into this
    # process's local folder before anything reads them.
    mirror = open_mirror(cfg.run_url, cfg.resolved_run_dir, launch.process_id) if cfg.run_url else None
    # Against the resolved config, as it was saved: what the data's manifests set (the vocabulary,
    # the documents' boundary tokens) is in both.
    rundir.check(data.cfg)
    sources.check_run_data(cfg.resolved_run_dir, cfg.overwrite, data.train + data.val)
    cfg = data.cfg
    lock = runlock.RunLock(cfg.run_url or cfg.resolved_run_dir, cfg.lock_stale_s)
    # Process 0 locks the run dir before anything is written into it, and holds it to the end.
    with lock.held(launch.process_id == 0), mirror.running() if mirror else contextlib.nullcontext():
        job = Job.join(cfg, launch)
        done = start.finished_step(cfg, job)
        if done is not None:  # relaunched after its last step: one line, nothing written
            if job.is_main:
                print(start.complete_line(cfg, done), flush=True)
            return RunResult(done, None, None, cfg.resolved_run_dir)
        log_path = metrics.process_log_path(cfg.resolved_run_dir, job.process_index)
        # From here on barriers, restore and compile get the absolute limit, steps a tighter one.
        watchdog = Watchdog(cfg.watchdog_factor, cfg.watchdog_timeout, log_path)
        stop = StopRequest(job.is_main, job.gather)
        timeline = Timeline()
        try:
            with watchdog.phase("build: the kernels checked at job start"):  # a hung kernel is named
                run = build(job)
            result = _train(run, data, watchdog, stop, timeline, launch_time)
        except BaseException as e:
            with contextlib.suppress(OSError):  # a full disk must not hide the error that ended the run
                timeline.event("end", reason=end_reason(e))
            if isinstance(e, OSError) and storage.failure_reason(e):  # a metrics or log write refused
                raise StorageError(
                    f"writing {e.filename or cfg.resolved_run_dir} failed: {storage.failure_reason(e)}; "
                    "make room (or fix the filesystem), then relaunch the same command to resume from "
                    "the last checkpoint"
                ) from None
            raise
        finally:
            watchdog.stop()
            stop.restore()
        timeline.event("end", step=result.final_step, reason=end_reason(None))
        return result


def _train(
    run: Run, data: Resolved, watchdog: Watchdog, stop: StopRequest, timeline: Timeline, launch_time: float
) -> RunResult:
    cfg, job, run_dir = run.cfg, run.job, run.cfg.resolved_run_dir
    # ------------------------------------------------------------------------------- start
    _make_run_dir(run)
    _say_what_runs(run, data)
    ckpt = _checkpointer(run, watchdog)
    state, step, train_step, compile_s, waited_s = _restore_and_compile(
        run, data, watchdog, timeline, launch_time, ckpt
    )
    reporter, peak_bytes = _reporter(run, step, train_step, compile_s, waited_s)
    batches = _Batches(run, data.train, step)
    evaluator = _Evaluator(run, data.val)
    saver = _Saver(run, ckpt, watchdog, timeline, step)
    tracker = metrics.StepTracker(cfg, reporter, watchdog, job.local_devices[0], step)
    profiler = Profiler(cfg, run_dir, job.process_index)
    faults = run.host_faults
    val_loss, stopped = None, False
    try:
        while step < cfg.total_steps and not stopped:
            # -------------------------------------------------------------------- step
            if faults:
                faults.before_step(step)
                faults.out_of_memory("step")
            with profiler.step(step):
                state, m = train_step(state, batches.next(tracker))
            step += 1
            # -------------------------------------------------------------------- log
            tracker.finish_pending()  # one step in flight: the previous step's metrics, now
            tracker.pending = (step, m)
            profiler.after_step(step, m)
            batches.prefetch(step, tracker)  # on the devices before this step ends
            # -------------------------------------------------------------------- eval
            if evaluator.due(step):
                tracker.finish_pending()
                val_loss = evaluator.measure(state.params, step, watchdog, reporter, timeline)
                tracker.restart_clock(step)
            # -------------------------------------------------------------------- save
            if step % cfg.checkpoint_interval == 0:
                saver.save(step, state, faults)
            saver.poll()
            stopped = (job.process_count == 1 or step % cfg.preemption_check_interval == 0) and stop.agreed()
        tracker.finish_pending()
        profiler.stop(state)
    except jax.errors.JaxRuntimeError as e:
        if not memory_lib.is_out_of_memory(e):
            raise
        raise run.out_of_memory(e, f"running step {step + 1}", peak_bytes) from None
    except NonFiniteError as e:
        # Params never take a non-finite update, so every saved checkpoint is a good one.
        raise NonFiniteError(
            f"{e}; last good checkpoint: {saver.finish()}; lower the lr or check the data, then relaunch"
        ) from None
    # --------------------------------------------------------------------------------- end
    _end(run, watchdog, stop, stopped, step, state, saver, reporter)
    log.info(f"done: step {step}, run dir {cfg.run_url or run_dir}")
    return RunResult(step, tracker.last_loss, val_loss, run_dir)


def _end(
    run: Run,
    watchdog: Watchdog,
    stop: StopRequest,
    stopped: bool,
    step: int,
    state: Any,
    saver: _Saver,
    reporter: metrics.Reporter,
) -> None:
    """The last save, then the stop's error where a stop signal ended the run, else the
    end-of-run sample."""
    if stopped:
        log.warning(f"stop signal ({stop.signal_name or 'on another process'}): saving step {step}")
    saver.save_last(step, state, run.host_faults)
    reporter.close()
    if stopped:
        # Preempted, or Interrupted by Ctrl-C
        raise stop.error(bucket.join(run.cfg.checkpoint_dir, str(step)))
    if run.cfg.sample_tokens:  # compiles generate: bounded as a phase, not as a step
        with watchdog.phase("end-of-run sample"):
            _sample(run, state.params)


# ----------------------------------------------------------------------------------- start


def _checkpointer(run: Run, watchdog: Watchdog) -> ckpt_lib.Checkpointer:
    """The run's checkpoints, their disk checked first and their background writes watched."""
    cfg, job = run.cfg, run.job
    ckpt = ckpt_lib.Checkpointer(cfg.checkpoint_dir, cfg.keep_checkpoints, primary=job.is_main)
    if job.is_main and not cfg.run_url:  # a bucket has no free space to tell
        _warn_if_disk_short(cfg, ckpt, sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(run.abstract)))
    watchdog.watch_beside(lambda: ckpt.in_flight)  # a background write hung on storage
    return ckpt


def _restore_and_compile(
    run: Run,
    data: Resolved,
    watchdog: Watchdog,
    timeline: Timeline,
    launch_time: float,
    ckpt: ckpt_lib.Checkpointer,
) -> tuple[Any, int, Any, float, float]:
    """(state, step, train step, compile seconds, seconds waited for the compile): the state
    restored or initialised while the step compiles."""
    t_restore = time.perf_counter()
    with watchdog.phase("checkpoint restore"):
        found = start.find_start(run, ckpt)  # a wrong checkpoint is refused before compiling
    # The step compiles from shapes alone, so it compiles (or is read from the compile cache) in a
    # thread while the state is restored or initialised: a relaunch waits for the longer of the two.
    compiling = Background(run.compile_train)
    with compiling.joined_on_error(), watchdog.phase("checkpoint restore"):
        state, step = start.start_state(run, found)
        _record_start(run, data, timeline, step, launch_time, time.perf_counter() - t_restore)
    with watchdog.phase("compile"):
        train_step, compile_s, waited_s = compiling.result()
    return state, step, train_step, compile_s, waited_s


def _make_run_dir(run: Run) -> None:
    """Make the run dir (process 0; --init_from's shapes checked first), then log into it."""
    cfg, job, run_dir = run.cfg, run.job, run.cfg.resolved_run_dir
    if cfg.init_from and not bucket.path(cfg.checkpoint_dir).exists():
        # Refuse other shapes before the run dir is made (a relaunch resumes its own checkpoints).
        start.check_init_from(run)
    if job.is_main:
        rundir.prepare(cfg)
    job.barrier("run_dir")
    metrics.setup_logging(run_dir, job.process_index, cfg.ddp.log_level, cfg.verbose)


def _say_what_runs(run: Run, data: Resolved) -> None:
    """The start of the log: the chosen config, the job, the model, the mesh and its memory."""
    cfg, job, run_dir = run.cfg, run.job, run.cfg.resolved_run_dir
    chosen = "".join(f"\n  {k}: {v!r}" for k, v in config_lib.differences(cfg).items())
    log.info(f"config, where it differs from the defaults (all of it: {run_dir / 'config.yaml'}):{chosen}")
    log.info(f"compile cache: {compile_cache_dir() or 'off'}")
    untested = versions.warning()
    if untested:
        log.warning(untested)
    if DROPPED:  # xla_env.set_flags: flags of jax 0.10.2's XLA this one does not know
        log.warning(f"this XLA does not know jaxtrain's {' '.join(DROPPED)}: running without them")
    run.preflight.say(log)  # the kernels checked at job start (run/verdicts.py)
    notes = config_lib.compat_notes(
        cfg, loader.epoch_windows(data.train), job.process_count, len(job.devices)
    )
    for note in notes:
        log.info(note)
    log.info(
        f"{job.describe()}; global batch {cfg.batch_size} x {cfg.model.seq_len} tokens, "
        f"{cfg.gradient_accumulation_steps} microbatch(es), "
        f"{cfg.batch_size // mesh_lib.data_share(run.mesh)[1]} rows per process; "
        f"data {data.data_path}"
    )
    log.info(
        f"model: {run.n_params:,} parameters ({run.n_active_params:,} active per token), "
        f"{run.flops_per_token / 1e6:.1f} MFLOPs per token (6N + 6*L*d*T: N active, causal attention "
        "at half)\n"
        f"{param_summary(run.abstract.params)}"
    )
    if not metrics.peak_flops(job.device_kind, run.mfu_dtype):
        log.info(
            f"MFU: no peak FLOP/s on record for {job.device_kind} (a CPU has no table peak); "
            "logging achieved FLOP/s per device instead"
        )
    state_bytes = run.state_bytes_per_device
    log.info(
        f"mesh {mesh_lib.describe(run.mesh)}{' + zero1' if cfg.mesh.zero1 else ''}: train state "
        f"{state_bytes / 2**20:,.1f} MiB per device (params + 2 Adam moments, float32)"
    )
    for warning in mesh_lib.host_warnings(run.mesh):
        log.warning(warning)


def _record_start(
    run: Run, data: Resolved, timeline: Timeline, step: int, launch_time: float, restore_s: float
) -> None:
    """Once the start step is known: drop records past it, save the config, open the timeline."""
    cfg, run_dir = run.cfg, run.cfg.resolved_run_dir
    if cfg.epochs:
        epoch = config_lib.epoch_at(cfg, step, loader.epoch_windows(data.train))
        log.info(f"step {step}: epoch {epoch:.2f} of {cfg.epochs:g}")
    if run.job.is_main:
        rundir.truncate_metrics(run_dir / "metrics.jsonl", step)
        rundir.save_config(cfg)
        sources.record_run_data(run_dir, data.train + data.val)
        timeline.open(run_dir / "metrics.jsonl")
        timeline.event("launch", t=launch_time, step=step, restore_s=round(restore_s, 3))


def _reporter(
    run: Run, step: int, train_step: Any, compile_s: float, waited_s: float
) -> tuple[metrics.Reporter, int]:
    """The reporter, after the launch's start record (mesh, sizes, memory, compile time)."""
    job, n_devices = run.job, len(run.job.devices)
    peak_bytes = memory_lib.compiled_bytes(train_step)["total_bytes"]
    log.info(
        f"train step compiled in {compile_s:.1f} s ({waited_s:.1f} s of it after the state was ready); "
        f"peak {peak_bytes / 2**20:,.1f} MiB per device (arguments + temporaries + outputs not aliased)"
    )
    # The one memory rule (memory.fits), as scripts/plan.py applies it to GPUs that are not here.
    memory_lib.check_compiled(
        peak_bytes, job.local_devices[0], run.cfg, len(job.local_devices), run.model.cfg.moe.exchange
    )
    peak = metrics.peak_flops(job.device_kind, run.mfu_dtype)  # the peak of the dtype that runs
    fpt = run.flops_per_token
    reporter = metrics.Reporter(
        run.cfg, run.cfg.resolved_run_dir, job.is_main, step, fpt / (n_devices * peak) if peak else None,
        flops_per_token_per_device=fpt / n_devices,
    )  # fmt: skip
    reporter.start(
        {
            "event": "start",
            "step": step,
            "mesh": mesh_lib.mesh_shape(run.mesh),
            "processes": job.process_count,
            "devices": n_devices,
            "n_params": run.n_params,
            "n_active_params": run.n_active_params,
            "attention": run.attention,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),  # read once, when the backend started
            "state_bytes_per_device": run.state_bytes_per_device,
            "peak_bytes_per_device": peak_bytes,
            "compile_s": round(compile_s, 3),
            "t": round(time.time(), 3),
        }
    )
    return reporter, peak_bytes


def _warn_if_disk_short(cfg: Config, ckpt: ckpt_lib.Checkpointer, nbytes: int) -> None:
    """Warn when the checkpoints' filesystem cannot hold the checkpoints still to be written: up to
    keep_checkpoints + 1 (a new one is complete before the oldest is deleted), fewer those present."""
    needed = max(1, cfg.keep_checkpoints + 1 - len(ckpt.all_steps())) * nbytes
    free = storage.free_bytes(ckpt.directory)
    if free < needed:
        log.warning(
            f"{ckpt.directory} has {storage.mib(free)} free, but keep_checkpoints {cfg.keep_checkpoints} "
            f"needs about {storage.mib(needed)} more ({storage.mib(nbytes)} per checkpoint): a save "
            "will fail (exit 5) unless space is made"
        )


# ------------------------------------------------------------------------------ collaborators


class _Batches:
    """This process's rows of each global batch, one batch ahead on the devices."""

    def __init__(self, run: Run, train: list[sources.Source], start_step: int) -> None:
        cfg = run.cfg
        self.cfg, self.mesh = cfg, run.mesh
        self.rows = iter(
            loader.train_loader(
                train, cfg.batch_size, cfg.seed, start_step, cfg.total_steps, *mesh_lib.data_share(run.mesh),
                cfg.data_threads, cfg.prefetch,
            )
        )  # fmt: skip
        self.ready: jax.Array | None = None
        self.start_step = start_step
        # Data in a bucket waits on the store: a store that stops answering for a while (its
        # requests retried) is bounded by the absolute limit, not taken for a hung step.
        self.remote = any(bucket.is_url(info.path) for s in train for info in s.shards.infos)

    def prefetch(self, step: int, tracker: metrics.StepTracker) -> None:
        """Start the copy of step `step`'s batch (if there is one) while the devices work."""
        if step < self.cfg.total_steps:
            t0 = time.perf_counter()
            waiting = tracker.watchdog.phase(f"reading step {step + 1}'s batch from the bucket")
            with waiting if self.remote else contextlib.nullcontext():
                rows = next(self.rows)
            self.ready = mesh_lib.global_batch(rows, self.mesh, self.cfg.batch_size)
            tracker.data_wait += time.perf_counter() - t0

    def next(self, tracker: metrics.StepTracker) -> jax.Array:
        if self.ready is None:  # the first step of a launch
            self.prefetch(self.start_step, tracker)
        batch, self.ready = self.ready, None
        assert batch is not None
        return batch


class _Evaluator:
    """The validation loss every eval_interval steps and at the end (evaluate.py's rule)."""

    def __init__(self, run: Run, val: list[sources.Source]) -> None:
        self.built, self.cfg = run, run.cfg
        rows = (run.cfg.batch_size, run.cfg.eval_batches, *mesh_lib.data_share(run.mesh))
        self.sets = [(s, loader.eval_batches(s, *rows)) for s in (val if self.cfg.eval_interval else [])]

    def due(self, step: int) -> bool:
        interval = self.cfg.eval_interval
        return bool(interval) and (step % interval == 0 or step == self.cfg.total_steps)

    def measure(
        self, params: Any, step: int, watchdog: Watchdog, reporter: metrics.Reporter, timeline: Timeline
    ) -> float:
        """Evaluate, report and time it."""
        t0 = time.perf_counter()
        with watchdog.phase(f"eval at step {step}"):
            metrics = {s.name: evaluate.mean_metrics(self.built, params, batches) for s, batches in self.sets}
            per_source = {name: float(m["loss"]) for name, m in metrics.items()}
            val_loss = evaluate.overall(per_source, [s for s, _ in self.sets])
        # A mixture of experts' router on the validation rows (of every set alike).
        router = {k: np.mean([m[k] for m in metrics.values()], axis=0) for k in next(iter(metrics.values()))}
        reporter.eval(step, val_loss, per_source if len(per_source) > 1 else None, router)
        timeline.event("eval", step=step, seconds=round(time.perf_counter() - t0, 3))
        return val_loss


class _Saver:
    """Checkpoint saves in the background, their failures and hangs named, their time on the timeline."""

    def __init__(
        self, run: Run, ckpt: ckpt_lib.Checkpointer, watchdog: Watchdog, timeline: Timeline, start_step: int
    ) -> None:
        self.run, self.ckpt, self.watchdog, self.timeline = run, ckpt, watchdog, timeline
        # The step this launch resumed from, where it is one of this run's own checkpoints: a save
        # of it again (a stop before the first step) would meet orbax's StepAlreadyExistsError.
        self.saved = start_step if start_step in ckpt.all_steps() else -1

    def save(self, step: int, state: Any, faults: Faults | None) -> None:
        t0 = time.perf_counter()
        meta = {"step": step, "data_position": step, "config": config_lib.to_dict(self.run.cfg)}
        with self.watchdog.phase(f"checkpoint save at step {step}"):
            self.ckpt.save(step, state, meta)
        self.timeline.event("checkpoint", step=step, seconds=round(time.perf_counter() - t0, 3))
        self.saved = step
        if faults:
            faults.after_save_started(step)

    def poll(self) -> None:
        """A background save that failed stops the run now, not at the next save."""
        if self.ckpt.in_flight is not None:
            # Asking may block on storage that stopped answering: then the save is what hangs, not
            # the step, and the watchdog names it with the save's own limit.
            with self.watchdog.phase(self.ckpt.in_flight[0]):
                self.ckpt.poll()

    def save_last(self, step: int, state: Any, faults: Faults | None) -> None:
        """The one final save of every ending that keeps its work (done, or stopped by a signal)."""
        if self.saved != step:
            self.save(step, state, faults)
        t0 = time.perf_counter()
        self.finish()
        self.timeline.event("checkpoint", step=step, seconds=round(time.perf_counter() - t0, 3))
        self.ckpt.close()

    def finish(self) -> str:
        """Wait for the save in flight; where the last good checkpoint is."""
        with self.watchdog.phase("final checkpoint write"):
            self.ckpt.wait()
        good = self.ckpt.latest_step()
        return f"step {good} in {self.ckpt.directory}" if good is not None else "none yet"


def _sample(run: Run, params: Any) -> None:
    """Print a short generation from the final model's host copy (process 0)."""
    cfg = run.cfg
    params = mesh_lib.host_copy(params)  # a collective: every process takes part
    tokenizer = run_tokenizer(cfg.train_data_path, cfg.model.vocab_size)
    if not run.job.is_main:
        return
    if tokenizer is None:
        log.info("no tokenizer.json next to the training data: no sample printed")
        return
    prompt = tokenizer.encode(cfg.sample_prompt).astype(np.int32)
    out = generate(
        params, cfg.model, prompt, cfg.sample_tokens, jax.random.key(cfg.seed),
        temperature=cfg.temperature, top_k=cfg.top_k or None,
    )  # fmt: skip
    text = tokenizer.decode(np.concatenate([prompt, out]))
    log.info("sample from the trained model:\n" + "-" * 60 + f"\n{text}\n" + "-" * 60)
