"""How scripts end on purpose: one line naming the problem and the fix, and a known exit code.

Exit codes of scripts/train.py (also in docs/resume_and_faults.md):
    0   done                      2   bad input, nothing changed     3   hung: the watchdog fired
    4   too many non-finite steps 5   storage failed during a save  75  pre-empted: relaunch
    130 Ctrl-C (the process ends by SIGINT; a checkpoint was saved if training had begun)
"""

from __future__ import annotations

import signal

EXIT_USAGE = 2
EXIT_HUNG = 3
EXIT_NONFINITE = 4
EXIT_STORAGE = 5
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: try again later
EXIT_INTERRUPTED = 128 + signal.SIGINT  # what a shell reports for a process ended by Ctrl-C


class StopError(Exception):
    """Ends a script with its message on one line and `code`, never a traceback."""

    code = 1


class UserError(StopError):
    """Bad input from the user (config, data, arguments, environment); never a bug."""

    code = EXIT_USAGE


class DataError(UserError):
    """A token file, data path or shard set that cannot be used."""


class ArgumentError(UserError):
    """A command-line flag that cannot be used."""


class NonFiniteError(StopError):
    """Too many non-finite steps in a row."""

    code = EXIT_NONFINITE


class StorageError(StopError):
    """The filesystem refused a checkpoint (no space, read-only, I/O error, quota)."""

    code = EXIT_STORAGE


class Preempted(StopError):
    """A stop signal arrived; a checkpoint was saved."""

    code = EXIT_PREEMPTED


class Interrupted(Preempted):
    """Ctrl-C arrived; a checkpoint was saved. The process ends by SIGINT (see _end)."""

    code = EXIT_INTERRUPTED
