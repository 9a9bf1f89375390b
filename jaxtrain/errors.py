"""User-facing errors: one line that names the problem and the fix, exit code 2."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

EXIT_USAGE = 2


class UserError(Exception):
    """Bad input from the user (config, data, arguments, environment); never a bug."""


def exit_on_user_error(main: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a script's main so a UserError prints one line and exits 2, with no traceback."""

    @functools.wraps(main)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USAGE)

    return wrapper
