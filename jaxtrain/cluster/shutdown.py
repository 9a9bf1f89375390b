"""How a script ends: `exit_on_user_error` turns a StopError into one line and its exit code, and
leaves a multi-process job without hanging in JAX's shutdown barrier or aborting a peer."""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from jaxtrain.errors import (
    EXIT_INTERRUPTED,
    Interrupted,
    NonFiniteError,
    Preempted,
    StopError,
    StorageError,
    UserError,
)


def _joined_to_peers() -> bool:
    """Whether this process joined a multi-process JAX job (asked without starting a backend)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import distributed  # private, but public APIs would initialise the backend

    return distributed.global_state.client is not None


def _leave_together(timeout_s: float = 10.0) -> None:
    """Pass JAX's shutdown barrier with every peer (at most `timeout_s`), then return.

    For errors every process raises at the same step (pre-emption, non-finite steps): if process
    0, which hosts the coordination service, left first, a peer still polling it would abort
    (SIGABRT) instead of exiting with the same code.
    """
    import jax

    leaving = threading.Thread(target=jax.distributed.shutdown, name="jaxtrain-shutdown", daemon=True)
    leaving.start()
    leaving.join(timeout_s)


def _end(code: int) -> None:
    """Exit with `code` at once; Ctrl-C's code by SIGINT itself, so a shell running this in a loop
    or script stops there as it does for any program ended by Ctrl-C (exit(130) would not do)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code == EXIT_INTERRUPTED:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def exit_on_user_error(main: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a script's main so a StopError prints one line and exits with its code, and Ctrl-C
    outside training (which saves first, jaxtrain/preemption.py) ends it without a traceback."""

    @functools.wraps(main)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return main(*args, **kwargs)
        except KeyboardInterrupt:
            print("interrupted (Ctrl-C)", file=sys.stderr)
            _end(EXIT_INTERRUPTED)
        except StopError as e:
            said = f"error: {e}" if isinstance(e, UserError | NonFiniteError | StorageError) else str(e)
            # One write of the whole line: print() writes the text and its newline apart, and
            # unbuffered (PYTHONUNBUFFERED) another rank's line could land between them on the
            # stream the ranks share (seen in CI: one rank's error ran into the next one's).
            sys.stderr.write(said + "\n")
            sys.stdout.flush()
            sys.stderr.flush()
            if isinstance(e, StorageError):
                # The failed save's orbax threads would print tracebacks while the interpreter
                # shuts down (their event loop closed under them): leave without that.
                os._exit(e.code)
            if _joined_to_peers():
                if isinstance(e, Preempted | NonFiniteError):
                    _leave_together()
                # JAX's exit handler would wait minutes in a shutdown barrier for peers that
                # may never come; the launcher or SLURM tears the rest down.
                _end(e.code)
            if isinstance(e, Interrupted):
                _end(e.code)
            sys.exit(e.code)

    return wrapper
