"""A worker's life tied to its launcher's: when the launcher dies, by any means (SIGKILL too, which
it cannot catch), its workers die within a second instead of training on as orphans.

  - Our launchers (jaxtrain/launch/supervise.py) start each local process with `die_with_parent`
    run in the child before exec: the kernel SIGKILLs it as soon as the launcher exits (Linux's
    parent-death signal, prctl PR_SET_PDEATHSIG; any script, even a hung one). jaxtrain's own
    helper processes (the tokenizer pool, jaxtrain/corpus.py) do the same at start.
  - torchrun starts its workers in sessions of their own and mpirun as plain children, and neither
    stops them when it is killed; `watch_launcher` polls the parent pid from a thread and ends this
    process (and its process group, if it leads one) once the parent is gone.
  - SLURM tracks every task of a job itself (a cgroup per job) and ends them all with the job; a
    task's parent is slurmstepd, not srun, so there is nothing to watch from here.
Never imports jax: the launchers use it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
POLL_S = 0.5  # how often a watched launcher is looked for
# Resolved once in the launcher, not in the freshly forked child that calls it.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """Get `sig` when the parent thread that started this process exits; at once if `parent` is
    already gone (it may have died before this ran). Linux; elsewhere only the at-once check."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def abandoning_launcher(environ: dict[str, str] | os._Environ[str]) -> str | None:
    """The launcher that started this process and would leave it running if killed, or None."""
    if environ.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    if environ.get("OMPI_COMM_WORLD_SIZE"):
        return "mpirun"
    return None


def watch_launcher() -> None:
    """Under torchrun or mpirun: SIGKILL this process (with its process group when it leads one, so
    its helpers too) within POLL_S of the parent's death; a daemon thread. Else nothing."""
    launcher = abandoning_launcher(os.environ)
    if launcher is None:
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        os.write(2, f"jaxtrain: {launcher} (pid {parent}) is gone; stopping this process\n".encode())
        if os.getpgrp() == os.getpid():  # torchrun's workers lead their own group
            os.killpg(0, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="jaxtrain-launcher-watch", daemon=True).start()
