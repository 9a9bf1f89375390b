"""The training run, start to end: build, restore or init, train, evaluate, save, sample."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import checkpoint as ckpt_lib
from jaxtrain import config as config_lib
from jaxtrain import data, metrics, rundir, runlock, sources, storage
from jaxtrain import memory as memory_lib
from jaxtrain import mesh as mesh_lib
from jaxtrain.cluster import detect, join
from jaxtrain.cluster.watchdog import Watchdog
from jaxtrain.config import Config
from jaxtrain.errors import NonFiniteError, Preempted, StorageError, UserError
from jaxtrain.faults import Faults
from jaxtrain.goodput import Timeline, end_reason
from jaxtrain.hf import load as hf_load
from jaxtrain.model import GPT, flops_per_token, generate, param_count, param_summary
from jaxtrain.optim import make_optimizer
from jaxtrain.preemption import StopRequest
from jaxtrain.profiling import Profiler
from jaxtrain.state import TrainState, abstract_state, create_state, state_sharding
from jaxtrain.step import compute_dtype, jit_steps
from jaxtrain.tokenizer import load_tokenizer
from jaxtrain.xla_env import enable_compile_cache

log = logging.getLogger("jaxtrain")


@dataclasses.dataclass
class RunResult:
    final_step: int
    last_loss: float | None
    val_loss: float | None
    run_dir: Path


def _data_paths(cfg: Config) -> tuple[str, str]:
    """The user's data paths, or the embedded stdlib byte dataset when none are given.

    Without valid_data_path the training path is read again as validation: a manifest gives its
    val shards, a mixture its sources' val shards (each evaluated apart), a plain file itself.
    """
    if cfg.train_data_path:
        return cfg.train_data_path, cfg.valid_data_path or cfg.train_data_path
    if cfg.model.vocab_size < 256:
        raise UserError(
            f"the embedded byte dataset needs model.vocab_size >= 256, got {cfg.model.vocab_size}; "
            "raise it or pass --train_data_path"
        )
    train, val = data.default_dataset()
    return str(train), cfg.valid_data_path or str(val)


def _restore_or_init(
    cfg: Config, model: GPT, tx: Any, mesh: Any, ckpt: ckpt_lib.Checkpointer, target: Any
) -> tuple[TrainState, int]:
    """The latest complete checkpoint of this run (or --resume_from), else a fresh state (with
    --init_from's params: step 0, fresh optimizer and schedule), laid out as `target`
    (the state's shapes and shardings)."""
    source, step = ckpt, _newest_readable(ckpt)
    if cfg.resume_from and step is None:
        directory, step = ckpt_lib.locate(cfg.resume_from)
        source = ckpt_lib.Checkpointer(directory, cfg.keep_checkpoints, read_only=True)
        step = step if step is not None else source.latest_step()
        if step is None:
            raise UserError(f"--resume_from {cfg.resume_from} holds no complete checkpoint")
        damage = source.damage(step) if jax.process_index() == 0 else None
        if damage:  # the user asked for this one: no other is taken in its place
            raise UserError(f"checkpoint {source.directory}/{step} is unreadable ({damage}); pass another")
    if step is None:
        state = create_state(cfg, model, tx, mesh)
        if cfg.init_from:
            init_source, init_step = hf_load.open_checkpoint(cfg.init_from, "--init_from")
            target = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state.params
            )
            params = init_source.restore_params(init_step, target, "--init_from")
            state = state.replace(params=params)  # type: ignore[attr-defined]  # added by flax.struct
            log.info(f"params from {cfg.init_from} (--init_from); optimizer and step start afresh")
        return state, 0
    meta = source.read_meta(step)
    diff = rundir.incompatibilities(meta.get("config", {}), cfg)
    if diff:
        raise UserError(
            f"checkpoint {source.directory}/{step} was written by a different config "
            f"({'; '.join(diff[:3])}); "
            "resume with the same model/batch/seed/data, or start a new --run_dir"
        )
    faults = Faults.of(cfg.debug, jax.process_index())
    if faults:
        faults.during_restore()
    state = source.restore(step, target)
    log.info(f"resumed from {source.directory}/{step}")
    return state, step


def _newest_readable(ckpt: ckpt_lib.Checkpointer) -> int | None:
    """The run's newest checkpoint that passes its checks (process 0 judges, all follow); newer,
    damaged ones are moved aside with a warning. None if there are none; UserError if none is
    readable (then nothing is moved)."""
    steps = sorted(ckpt.all_steps(), reverse=True)
    if not steps:
        return None
    damaged: list[tuple[int, str]] = []
    chosen = -1
    if jax.process_index() == 0:
        for step in steps:
            why = ckpt.damage(step)
            if why is None:
                chosen = step
                break
            damaged.append((step, why))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        chosen = int(multihost_utils.broadcast_one_to_all(np.int32(chosen)))
    if chosen < 0:
        if jax.process_index() == 0:
            said = "; ".join(f"{s}: {why}" for s, why in damaged)
        else:
            said = "see train.log"
        raise UserError(
            f"no checkpoint in {ckpt.directory} is readable ({said}); they are left as they are: "
            "pass --resume_from a good copy, or --overwrite to start afresh"
        )
    for step, why in damaged:
        aside = ckpt.move_aside(step)
        log.warning(f"checkpoint {ckpt.directory}/{step} is unreadable ({why}): moved aside to {aside}")
    _barrier("checkpoints_moved_aside")
    ckpt.reload()
    return chosen


def _sample(cfg: Config, params: Any, train_path: str) -> None:
    """Print a short generation from the final model's host copy (process 0)."""
    if cfg.model.vocab_size != 256 and not Path(train_path).with_name("tokenizer.json").exists():
        log.info("no tokenizer.json next to the training data: no sample printed")
        return
    tokenizer = load_tokenizer(train_path)
    prompt = tokenizer.encode(cfg.sample_prompt).astype(np.int32)
    out = generate(
        params, cfg.model, prompt, cfg.sample_tokens, jax.random.key(cfg.seed),
        temperature=cfg.temperature, top_k=cfg.top_k or None,
    )  # fmt: skip
    text = tokenizer.decode(np.concatenate([prompt, out]))
    log.info("sample from the trained model:\n" + "-" * 60 + f"\n{text}\n" + "-" * 60)


def train(cfg: Config, launch_time: float | None = None) -> RunResult:
    """Run (or resume) the training job described by cfg on every device of every process.

    launch_time: when this launch's process started (unix s), for goodput; default now.
    """
    launch_time = time.time() if launch_time is None else launch_time
    # Every process checks what it can alone before any connection: the same error everywhere.
    # (A process that fails after joining leaves while its peers may still be starting their
    # backends, and they die in JAX's own abort instead of saying the same line.)
    rundir.check(cfg)
    rundir.restrict_umask()  # nothing it writes into the run dir is world-writable
    launch = detect.detect(cfg.dist)
    config_lib.check_processes(cfg, launch.num_processes, launch.local_rank)
    train_path, val_path = _data_paths(cfg)
    seq = cfg.model.seq_len
    vocab = cfg.model.vocab_size
    train_sources = sources.open_sources(train_path, "train", vocab, cfg.token_dtype, seq)
    val_sources = sources.open_sources(val_path, "val", vocab, cfg.token_dtype, seq)
    sources.check_run_data(cfg.resolved_run_dir, cfg.overwrite, train_sources + val_sources)
    cfg = config_lib.with_data(cfg, data.epoch_windows(train_sources))
    lock = runlock.RunLock(cfg.resolved_run_dir, cfg.lock_stale_s)
    # Process 0 locks the run dir before anything is written into it, and holds it to the end.
    with lock.held(detect.detect(cfg.dist).process_id == 0):
        join.initialize(cfg.dist)
        log_path = metrics.process_log_path(cfg.resolved_run_dir, jax.process_index())
        # From here on barriers, restore and compile get the absolute limit, steps a tighter one.
        watchdog = Watchdog(cfg.watchdog_factor, cfg.watchdog_timeout, log_path)
        stop = StopRequest()
        try:
            return _run_timed(cfg, watchdog, stop, train_path, train_sources, val_sources, launch_time)
        except OSError as e:  # a metrics or log write the filesystem refused
            reason = storage.failure_reason(e)
            if reason is None:
                raise
            raise StorageError(
                f"writing {e.filename or cfg.resolved_run_dir} failed: {reason}; make room (or fix "
                "the filesystem), then relaunch the same command to resume from the last checkpoint"
            ) from None
        finally:
            watchdog.stop()
            stop.restore()


def _run_timed(
    cfg: Config,
    watchdog: Watchdog,
    stop: StopRequest,
    train_path: str,
    train_sources: list[sources.Source],
    val_sources: list[sources.Source],
    launch_time: float,
) -> RunResult:
    """_run, with the launch's end (or death) on its goodput timeline."""
    timeline = Timeline()
    try:
        result = _run(cfg, watchdog, stop, train_path, train_sources, val_sources, timeline, launch_time)
    except BaseException as e:
        with contextlib.suppress(OSError):  # a full disk must not hide the error that ended the run
            timeline.event("end", reason=end_reason(e))
        raise
    timeline.event("end", step=result.final_step, reason=end_reason(None))
    return result


def _run(
    cfg: Config,
    watchdog: Watchdog,
    stop: StopRequest,
    train_path: str,
    train_sources: list[sources.Source],
    val_sources: list[sources.Source],
    timeline: Timeline,
    launch_time: float,
) -> RunResult:
    pid, nproc = jax.process_index(), jax.process_count()
    is_main = pid == 0
    run_dir = cfg.resolved_run_dir
    cfg = config_lib.with_topology(cfg, jax.device_count(), nproc, jax.devices()[0].platform)
    mesh = mesh_lib.make_mesh(shape=cfg.mesh)
    mesh_lib.check_mesh(mesh)
    seq = cfg.model.seq_len
    if cfg.init_from and not (run_dir / "checkpoints").exists():
        # Refuse other shapes before the run dir is made (a relaunch resumes its own checkpoints).
        source, init_step = hf_load.open_checkpoint(cfg.init_from, "--init_from")
        source.check_params(
            init_step, abstract_state(cfg, GPT(cfg.model), make_optimizer(cfg)).params, "--init_from"
        )

    if is_main:
        rundir.prepare(cfg)
    _barrier("run_dir")
    metrics.setup_logging(run_dir, pid)
    if cfg.verbose:  # the guides' --debug: every process logs everything, JAX each compilation
        logging.getLogger("jaxtrain").setLevel(logging.DEBUG)
        jax.config.update("jax_log_compiles", True)
    log.info(f"config:\n{config_lib.to_yaml(cfg)}")
    cache = enable_compile_cache(cfg.compile_cache_dir)
    log.info(f"compile cache: {cache or 'off'}")
    n_windows = data.epoch_windows(train_sources)
    for note in config_lib.compat_notes(cfg, n_windows):
        log.info(note)
    log.info(
        f"{nproc} process(es) x {jax.local_device_count()} {jax.devices()[0].device_kind} device(s); "
        f"global batch {cfg.batch_size} x {seq} tokens, {cfg.gradient_accumulation_steps} microbatch(es), "
        f"{cfg.batch_size // nproc} rows per process; data {train_path}"
    )

    model = GPT(cfg.model, dtype=compute_dtype(cfg))
    tx = make_optimizer(cfg)
    ckpt = ckpt_lib.Checkpointer(run_dir / "checkpoints", cfg.keep_checkpoints, primary=is_main)
    watchdog.watch_beside(lambda: ckpt.in_flight)  # a background write hung on storage
    abstract = abstract_state(cfg, model, tx)
    n_params = param_count(abstract.params)
    fpt = flops_per_token(cfg.model, n_params)
    peak = metrics.peak_flops(jax.devices()[0].device_kind)
    if not peak:
        log.info(
            f"MFU: no peak FLOP/s on record for {jax.devices()[0].device_kind} (a CPU has no table peak); "
            "logging achieved FLOP/s per device instead"
        )
    log.info(
        f"model: {n_params:,} parameters, {fpt / 1e6:.1f} MFLOPs per token (6N + 12*L*d*T)\n"
        f"{param_summary(abstract.params)}"
    )
    shardings = state_sharding(mesh, abstract, cfg.mesh.zero1)
    state_bytes = mesh_lib.bytes_per_device(abstract, jax.tree.map(lambda s: s.spec, shardings), mesh)
    log.info(
        f"mesh {mesh_lib.describe(mesh)}{' + zero1' if cfg.mesh.zero1 else ''}: train state "
        f"{state_bytes / 2**20:,.1f} MiB per device (params + 2 Adam moments, float32)"
    )
    mesh_lib.check_fits(state_bytes, jax.local_devices()[0], mesh)
    if is_main:
        _warn_if_disk_short(cfg, ckpt, sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract)))
    jitted_train, eval_step = jit_steps(cfg, model, tx, mesh, shardings)
    # The step compiles from shapes alone, so it compiles (or is read from the compile cache) in a
    # thread while the state is restored or initialised: a relaunch waits for the longer of the
    # two, not their sum.
    batch_shape = jax.ShapeDtypeStruct(
        (cfg.batch_size, seq + 1), jnp.int32, sharding=mesh_lib.batch_sharding(mesh)
    )
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    compiling = _Background(lambda: _compile(cfg, jitted_train, target, batch_shape))
    try:
        t_restore = time.perf_counter()
        with watchdog.phase("checkpoint restore"):
            state, start_step = _restore_or_init(cfg, model, tx, mesh, ckpt, target)
        if cfg.epochs:
            epoch = config_lib.epoch_at(cfg, start_step, n_windows)
            log.info(f"step {start_step}: epoch {epoch:.2f} of {cfg.epochs:g}")
        if is_main:
            rundir.truncate_metrics(run_dir / "metrics.jsonl", start_step)
            rundir.save_config(cfg)
            sources.record_run_data(run_dir, train_sources + val_sources)
            timeline.open(run_dir / "metrics.jsonl")
            restore_s = round(time.perf_counter() - t_restore, 3)
            timeline.event("launch", t=launch_time, step=start_step, restore_s=restore_s)
    except BaseException:
        compiling.thread.join()  # the interpreter aborts (SIGABRT) if it exits while XLA compiles
        raise
    with watchdog.phase("compile"):
        t_wait = time.perf_counter()
        train_step, compile_s = compiling.result()
        waited_s = time.perf_counter() - t_wait
    peak_bytes = metrics.compiled_peak_bytes(train_step)
    log.info(
        f"train step compiled in {compile_s:.1f} s ({waited_s:.1f} s of it after the state was ready); "
        f"peak {peak_bytes / 2**20:,.1f} MiB per device (arguments + temporaries + outputs not aliased)"
    )
    reporter = metrics.Reporter(
        cfg,
        run_dir,
        is_main,
        start_step,
        fpt / (jax.device_count() * peak) if peak else None,
        flops_per_token_per_device=fpt / jax.device_count(),
    )
    reporter.start(
        {
            "event": "start",
            "step": start_step,
            "mesh": mesh_lib.mesh_shape(mesh),
            "processes": nproc,
            "devices": jax.device_count(),
            "n_params": n_params,
            "state_bytes_per_device": state_bytes,
            "peak_bytes_per_device": peak_bytes,
            "compile_s": round(compile_s, 3),
            "t": round(time.time(), 3),
        }
    )
    loader = data.train_loader(
        train_sources, cfg.batch_size, cfg.seed, start_step, cfg.total_steps, pid, nproc,
        cfg.data_threads, cfg.prefetch,
    )  # fmt: skip
    val_sets = [
        (s, data.eval_batches(s, cfg.batch_size, cfg.eval_batches, pid, nproc))
        for s in (val_sources if cfg.eval_interval else [])
    ]

    def save(step: int) -> None:
        t_save = time.perf_counter()
        with watchdog.phase(f"checkpoint save at step {step}"):
            ckpt.save(step, state, {"step": step, "data_position": step, "config": config_lib.to_dict(cfg)})
        timeline.event("checkpoint", step=step, seconds=round(time.perf_counter() - t_save, 3))
        if faults:
            faults.after_save_started(step)

    faults = Faults.of(cfg.debug, pid)
    tracker = _Tracker(cfg, reporter, watchdog, start_step)
    val_loss = None
    step = start_step
    it = iter(loader)
    profiler = Profiler(cfg, run_dir, pid)
    batch = _next_batch(it, mesh, cfg, tracker) if step < cfg.total_steps else None
    try:
        while step < cfg.total_steps:
            if faults:
                faults.before_step(step)
                faults.out_of_memory("step")
            with profiler.step(step):
                state, m = train_step(state, batch)
            step += 1
            # Keep one step in flight: wait for the previous step while this one runs.
            tracker.finish_pending()
            tracker.pending = (step, m)
            profiler.after_step(step, m)
            if step < cfg.total_steps:  # on the devices before this step ends
                batch = _next_batch(it, mesh, cfg, tracker)
            last = step == cfg.total_steps
            if cfg.eval_interval and (step % cfg.eval_interval == 0 or last):
                tracker.finish_pending()
                t_eval = time.perf_counter()
                with watchdog.phase(f"eval at step {step}"):
                    per_source = {}
                    for s, batches in val_sets:
                        losses = [
                            eval_step(state.params, mesh_lib.global_batch(b, mesh, cfg.batch_size))
                            for b in batches
                        ]
                        per_source[s.name] = float(np.mean(jax.device_get(losses)))
                    # Several validation sets: their losses weighted as the sources are.
                    weights = [s.weight for s, _ in val_sets]
                    val_loss = float(np.average(list(per_source.values()), weights=weights))
                reporter.eval(step, val_loss, per_source if len(per_source) > 1 else None)
                timeline.event("eval", step=step, seconds=round(time.perf_counter() - t_eval, 3))
                tracker.restart_clock(step)
            if step % cfg.checkpoint_interval == 0 or last:
                save(step)
            if ckpt.in_flight is not None:
                # A background save that failed stops the run now, not at the next save. Asking
                # may block on storage that stopped answering: then the save is what hangs, not
                # the step, and the watchdog names it with the save's own limit.
                with watchdog.phase(ckpt.in_flight[0]):
                    ckpt.poll()
            if nproc == 1 or step % cfg.preemption_check_interval == 0:
                if stop.agreed():
                    tracker.finish_pending()
                    log.warning(
                        f"stop signal ({stop.signal_name or 'on another process'}): saving step {step}"
                    )
                    if step % cfg.checkpoint_interval and not last:
                        save(step)
                    with watchdog.phase("final checkpoint write"):
                        ckpt.wait()
                    reporter.close()
                    saved = run_dir / "checkpoints" / str(step)
                    raise Preempted(f"pre-empted: checkpoint {saved} saved; relaunch to resume")
        tracker.finish_pending()
        profiler.stop(state)
    except jax.errors.JaxRuntimeError as e:
        if not memory_lib.is_out_of_memory(e):
            raise
        where = f"running step {step + 1}"
        raise memory_lib.out_of_memory(e, where, cfg, peak_bytes, jax.local_devices()[0]) from None
    except NonFiniteError as e:
        # Params never take a non-finite update, so every saved checkpoint is a good one.
        with watchdog.phase("final checkpoint write"):
            ckpt.wait()
        good = ckpt.latest_step()
        where = f"step {good} in {run_dir / 'checkpoints'}" if good is not None else "none yet"
        raise NonFiniteError(
            f"{e}; last good checkpoint: {where}; lower the lr or check the data, then relaunch"
        ) from None
    t_save = time.perf_counter()
    with watchdog.phase("final checkpoint write"):
        ckpt.wait()
    timeline.event("checkpoint", step=step, seconds=round(time.perf_counter() - t_save, 3))
    ckpt.close()
    reporter.close()
    if cfg.sample_tokens:
        params = mesh_lib.host_copy(state.params)  # a collective: every process takes part
        if is_main:
            _sample(cfg, params, str(train_sources[0].shards.infos[0].path))  # tokenizer.json beside it
    log.info(f"done: step {step}, run dir {run_dir}")
    return RunResult(step, tracker.last_loss, val_loss, run_dir)


class _Tracker:
    """Per-step bookkeeping on the host: logging intervals, non-finite steps, the watchdog."""

    def __init__(self, cfg: Config, reporter: metrics.Reporter, watchdog: Watchdog, start_step: int) -> None:
        self.cfg, self.reporter, self.watchdog = cfg, reporter, watchdog
        self.pending: tuple[int, dict[str, jax.Array]] | None = None
        self.device = jax.local_devices()[0]  # the memory of one device: the mesh loads them alike
        self.last_loss: float | None = None
        self.restart_clock(start_step)

    def restart_clock(self, step: int) -> None:
        """Start a timing interval at `step` (after eval too, so eval stays out of tokens/s)."""
        self.t_last, self.data_wait, self.interval_start = time.perf_counter(), 0.0, step

    def finish_pending(self) -> None:
        """Wait for the step in flight; log it, judge it, tell the watchdog."""
        if self.pending is None:
            return
        step, m = self.pending
        self.pending = None
        m = jax.device_get(m)
        self.watchdog.beat(step)
        self.reporter.step_done()
        cfg = self.cfg
        if not m["finite"]:
            log.warning(f"step {step}: loss or gradient not finite; step skipped ({m['bad_steps']} in a row)")
            if m["bad_steps"] >= cfg.max_bad_steps:
                raise NonFiniteError(
                    f"{m['bad_steps']} non-finite steps in a row (last at step {step}, max_bad_steps "
                    f"{cfg.max_bad_steps})"
                )
        self.last_loss = float(m["loss"])
        if step % cfg.log_interval == 0 or step == cfg.total_steps:
            dt = time.perf_counter() - self.t_last
            n = step - self.interval_start
            record = {
                "step": step,
                "loss": self.last_loss,
                "lr": float(m["lr"]),
                "grad_norm": float(m["grad_norm"]),
                "tokens_per_sec": n * cfg.batch_size * cfg.model.seq_len / dt,
                "step_time_s": dt / n,
                "data_wait_frac": self.data_wait / dt,
                "skipped_steps": int(m["skipped_steps"]),
                **memory_lib.usage(self.device),
                "t": round(time.time(), 3),  # for goodput
            }
            if cfg.dtype == "float16":
                record["loss_scale"] = float(m["loss_scale"])
            self.reporter.train(record)
            self.restart_clock(step)


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


def _compile(cfg: Config, jitted_train: jax.stages.Wrapped, state: Any, batch_shape: Any) -> Any:
    """The train step compiled ahead of time (no stall in step 1); out of memory is one line."""
    try:
        faults = Faults.of(cfg.debug, jax.process_index())
        if faults:
            faults.out_of_memory("compile")
        return jitted_train.lower(state, batch_shape).compile()
    except jax.errors.JaxRuntimeError as e:
        if not memory_lib.is_out_of_memory(e):
            raise
        raise memory_lib.out_of_memory(e, "compiling the step", cfg, 0, jax.local_devices()[0]) from None


class _Background:
    """`fn()` run in a daemon thread (a run that fails meanwhile exits without waiting for it);
    result() gives (its value, its seconds) or raises what it raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, args=(fn,), name="compile", daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            self.value = fn()
        except BaseException as e:  # re-raised in the waiting thread
            self.error = e
        self.seconds = time.perf_counter() - t0

    def result(self) -> tuple[Any, float]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value, self.seconds


def _next_batch(it: Any, mesh: Any, cfg: Config, tracker: _Tracker) -> jax.Array:
    """The next global batch, its copy to the devices started; the time it took is data wait."""
    t0 = time.perf_counter()
    batch = mesh_lib.global_batch(next(it), mesh, cfg.batch_size)
    tracker.data_wait += time.perf_counter() - t0
    return batch


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
