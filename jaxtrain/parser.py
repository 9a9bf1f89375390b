"""The argument parser every script shares: a bad flag is one line and exit 2, like any bad input.

Used by scripts/prepare_data.py, scripts/plot_metrics.py, scripts/test_distributed.py and the
launchers (jaxtrain/launch/cli.py, jaxtrain/launch/supervise.py). Never imports jax: the launchers
must answer --help at once.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

from jaxtrain.errors import ArgumentError


class Parser(argparse.ArgumentParser):
    """argparse, but an error raises ArgumentError (printed as one `error: ` line, exit 2) instead
    of printing the usage block and exiting itself."""

    def error(self, message: str) -> NoReturn:
        raise ArgumentError(f"{message}; see {self.prog} --help")
