"""What people see: process 0 logs to the terminal, train.log, metrics.jsonl and wandb.

Other processes write only warnings and errors, each to logs/process_<i>.log.

MFU = flops_per_token * tokens_per_sec / (devices * peak_flops_per_device), with
flops_per_token = 6 * n_params + 6 * n_layer * d_model * seq_len (model.flops_per_token: causal
attention counted at half, as MaxText and cuDNN's causal kernel do),
and the peak the device's dense bfloat16 matmul rate (jaxtrain/observe/peaks.py). Devices with
no peak in the table (CPUs) show the achieved FLOP/s per device instead (the same flops_per_token).
"""

from __future__ import annotations

import json
import logging
import netrc
import os
import secrets
import sys
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, cast

import jax
from tqdm import tqdm

from jaxtrain import config as config_lib
from jaxtrain.cluster.watchdog import Watchdog
from jaxtrain.config import Config
from jaxtrain.disk.files import LineFile
from jaxtrain.errors import NonFiniteError, UserError
from jaxtrain.observe import memory as memory_lib
from jaxtrain.observe import peaks
from jaxtrain.observe.tboard import ScalarWriter

log = logging.getLogger("jaxtrain")


def peak_flops(device_kind: str, dtype: str = "bfloat16") -> float | None:
    """The device's dense peak for the dtype the step's matmuls run in (observe/peaks.py), or None
    when unknown (CPUs): then no MFU is shown."""
    return peaks.peak_flops(device_kind, dtype)


class _TqdmHandler(logging.StreamHandler):
    """Console lines that do not break the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stdout)


class _LineFileHandler(logging.Handler):
    """A log file written one whole record at a time; a record the filesystem refuses (disk full)
    is dropped, not half-written, and says nothing: the storage error that follows says it."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.file = LineFile(path)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.file.write_line(self.format(record))
        except OSError:
            pass

    def close(self) -> None:
        self.file.close()
        super().close()


def process_log_path(run_dir: Path, process_index: int) -> Path:
    """This process's log file: train.log on process 0, logs/process_<i>.log elsewhere."""
    return run_dir / "train.log" if process_index == 0 else run_dir / "logs" / f"process_{process_index}.log"


def setup_logging(run_dir: Path | None, process_index: int, level: str = "", verbose: bool = False) -> None:
    """Process 0: INFO to the terminal (and train.log). Others: WARNING to stderr (and their own
    file). run_dir None (--task test, predict): the terminal only, no file in any run dir.
    `level` (ddp.log_level): every process logs at that level instead. `verbose` (the guides'
    --debug): every process logs everything, and JAX logs each compilation."""
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    root = logging.getLogger("jaxtrain")
    root.handlers.clear()
    root.propagate = False
    handlers: list[logging.Handler] = [
        _TqdmHandler() if process_index == 0 else logging.StreamHandler(sys.stderr)
    ]
    if run_dir is not None:
        if process_index:
            (run_dir / "logs").mkdir(exist_ok=True)
        handlers.append(_LineFileHandler(process_log_path(run_dir, process_index)))
    root.setLevel(
        logging.DEBUG if verbose else level or (logging.INFO if process_index == 0 else logging.WARNING)
    )
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
    jax.config.update("jax_log_compiles", verbose)


class Reporter:
    """Progress bar, metric lines, metrics.jsonl and wandb; inert on processes other than 0."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        is_main: bool,
        start_step: int,
        mfu_denominator: float | None,
        flops_per_token_per_device: float = 0.0,
    ):
        self.is_main = is_main
        self.mfu_denominator = mfu_denominator  # flops_per_token / (devices * peak), or None
        self.flops_per_token_per_device = flops_per_token_per_device
        self.wandb: Any = None
        self.tensorboard: ScalarWriter | None = None
        if not is_main:
            return
        self.metrics_file = LineFile(run_dir / "metrics.jsonl")  # closed in close()
        self.bar = tqdm(
            total=cfg.total_steps, initial=start_step, disable=not cfg.progress_bar, dynamic_ncols=True,
            desc="train", file=sys.stdout,
        )  # fmt: skip
        if cfg.use_wandb:
            self.wandb = _start_wandb(cfg, run_dir)
        if cfg.tensorboard:
            self.tensorboard = ScalarWriter(run_dir)

    def start(self, record: dict[str, Any]) -> None:
        """The launch's start record: mesh, sizes, memory per device, compile time."""
        if self.is_main:
            self.metrics_file.write_line(json.dumps(record))

    def step_done(self) -> None:
        if self.is_main:
            self.bar.update(1)

    def train(self, record: dict[str, Any]) -> None:
        """A training record: step, loss, lr, grad_norm, tokens_per_sec, step_time_s, ..."""
        if not self.is_main:
            return
        if self.mfu_denominator:
            record["mfu"] = record["tokens_per_sec"] * self.mfu_denominator
        flops = record["tokens_per_sec"] * self.flops_per_token_per_device
        if flops:
            record["flops_per_sec_per_device"] = flops
        line = (
            f"step {record['step']:>6} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"grad_norm {record['grad_norm']:.3f} | {record['tokens_per_sec']:,.0f} tok/s | "
            f"step {record['step_time_s'] * 1000:.1f} ms"
        )
        if "mfu" in record:
            line += f" | MFU {record['mfu'] * 100:.1f}%"
        elif flops:
            line += f" | {flops / 1e12:.3f} TFLOP/s per device"
        if record.get("skipped_steps"):
            line += f" | skipped {record['skipped_steps']}"
        if "moe_balance_loss" in record:
            line += (
                f" | balance {record['moe_balance_loss']:.3f} | expert load max/mean "
                f"{max(record['expert_load_max_mean']):.2f}"
            )
            if record["moe_dropped"]:
                line += f" | dropped {record['moe_dropped']:.2%}"
        self._emit(record, line)

    def eval(
        self,
        step: int,
        val_loss: float,
        per_source: dict[str, float] | None = None,
        router: Mapping[str, Any] | None = None,
    ) -> None:
        """An eval record; with several validation sets also `val_loss/<name>` for each; `router`:
        the eval step's metrics, whose expert load (a mixture of experts') goes in as `val_*`."""
        if self.is_main:
            record: dict[str, Any] = {"step": step, "val_loss": val_loss}
            line = f"step {step:>6} | val_loss {val_loss:.4f}"
            for name, loss in (per_source or {}).items():
                record[f"val_loss/{name}"] = loss
                line += f" | {name} {loss:.4f}"
            if router and "expert_load" in router:
                moe = expert_load_record(router)
                record.update({f"val_{k}": v for k, v in moe.items()})
                line += f" | expert load max/mean {max(moe['expert_load_max_mean']):.2f}"
            self._emit(record, line)

    def _emit(self, record: dict[str, Any], line: str) -> None:
        log.info(line)
        self.metrics_file.write_line(json.dumps(record))
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k not in ("step", "t")}, step=record["step"])
        if self.tensorboard is not None:
            self.tensorboard.add(record)

    def close(self) -> None:
        if not self.is_main:
            return
        self.bar.close()
        self.metrics_file.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


# Seconds wandb may take to reach its server at start, and to upload at the end: past them the
# run logs offline (`wandb sync` uploads later) rather than hang a job on a network.
WANDB_INIT_TIMEOUT_S = 60.0
WANDB_FINISH_TIMEOUT_S = 120.0


def wandb_mode(cfg: Config, environ: Mapping[str, str] = os.environ) -> str:
    """online | offline: --wandb_mode, unless WANDB_MODE asks for offline (or disabled) logging."""
    return "offline" if environ.get("WANDB_MODE", "") in ("offline", "dryrun", "disabled") else cfg.wandb_mode


def _wandb_key(environ: Mapping[str, str]) -> bool:
    """Whether wandb has an API key here: WANDB_API_KEY, or `wandb login`'s entry in the netrc file."""
    if environ.get("WANDB_API_KEY"):
        return True
    host = urllib.parse.urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    path = Path(environ.get("NETRC") or Path.home() / ".netrc")
    try:
        return netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check_wandb(cfg: Config, environ: Mapping[str, str] = os.environ) -> None:
    """At start, before anything is compiled or written: online logging needs an API key."""
    if cfg.use_wandb and wandb_mode(cfg, environ) == "online" and not _wandb_key(environ):
        raise UserError(
            "--use_wandb logs online, but this machine has no wandb API key; run `wandb login`, set "
            "WANDB_API_KEY, or pass --wandb_mode offline (`wandb sync <run_dir>/wandb/offline-run-*` "
            "uploads it later)"
        )


def _start_wandb(cfg: Config, run_dir: Path) -> Any:
    """One wandb run per run dir: a resumed run continues the same wandb run id. A server that
    does not answer within WANDB_INIT_TIMEOUT_S leaves the run logging offline, with a warning."""
    import wandb  # imported only when asked for: it is slow to import

    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
    id_file.write_text(run_id)
    # wandb's own WANDB_INIT_TIMEOUT, when set, is the user's choice of the first limit.
    init_timeout = float(os.environ.get("WANDB_INIT_TIMEOUT") or WANDB_INIT_TIMEOUT_S)
    settings = wandb.Settings(init_timeout=init_timeout, finish_timeout=WANDB_FINISH_TIMEOUT_S)
    mode = wandb_mode(cfg)

    def init(mode: str) -> Any:
        return wandb.init(
            project=cfg.wandb_project,
            name=cfg.wandb_run_name or cfg.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            mode=cast(Literal["online", "offline"], mode),
            config=config_lib.to_dict(cfg),
            settings=settings,
        )

    if mode == "offline":
        return init(mode)
    try:
        return init(mode)
    except Exception as e:  # wandb raises several types for a server it cannot reach
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning(
            f"wandb: cannot reach its server ({first}); logging offline to {run_dir / 'wandb'}; "
            f"`wandb sync {run_dir / 'wandb'}/offline-run-*` uploads it later"
        )
        return init("offline")


def expert_load_record(m: Mapping[str, Any]) -> dict[str, Any]:
    """A mixture of experts' router, for a record: the balancing and z losses, and per MoE layer
    the fraction of routed tokens each expert got and its max over its mean (1.0: even; a router
    collapsing onto few experts shows as a large max/mean)."""
    load = m["expert_load"]  # [MoE layers, experts]
    return {
        "moe_balance_loss": float(m["moe_balance_loss"]),
        "moe_z_loss": float(m["moe_z_loss"]),
        "moe_dropped": float(m["moe_dropped"]),  # share of routed copies over capacity (capacity_factor)
        "expert_load": [[round(float(x), 5) for x in layer] for layer in load],
        "expert_load_max_mean": [round(float(layer.max() / layer.mean()), 4) for layer in load],
    }


class StepTracker:
    """Per-step bookkeeping on the host: logging intervals, non-finite steps, the watchdog."""

    def __init__(
        self, cfg: Config, reporter: Reporter, watchdog: Watchdog, device: Any, start_step: int
    ) -> None:
        self.cfg, self.reporter, self.watchdog = cfg, reporter, watchdog
        self.pending: tuple[int, dict[str, Any]] | None = None
        self.device = device  # the memory of one device: the mesh loads them alike
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
            # One instant ends this interval, stamps the record and starts the next interval: the
            # intervals of successive records are end to end, none missing the time spent here.
            now, wall = time.perf_counter(), time.time()
            dt = now - self.t_last
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
                "t": round(wall, 3),  # this interval's end, for goodput and bench/bench_gpu.py
            }
            if cfg.dtype == "float16":
                record["loss_scale"] = float(m["loss_scale"])
            if "expert_load" in m:
                record.update(expert_load_record(m))
            self.reporter.train(record)
            self.t_last, self.data_wait, self.interval_start = now, 0.0, step
