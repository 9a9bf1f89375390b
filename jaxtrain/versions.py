"""The versions jaxtrain was tested with (constraints.txt beside the package, which `make` installs
with), and the one line a run says when it meets others. jax's APIs for sharding, Pallas and
cuDNN, and orbax's and grain's, change between releases: a run on untested versions may work
(one H200 ran jax 0.11.2, docs/gpu_check.md), and when it does not, this line is the first lead."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

CONSTRAINTS = Path(__file__).resolve().parent.parent / "constraints.txt"


def tested(path: Path = CONSTRAINTS) -> dict[str, str]:
    """Package -> the version CI tested, from constraints.txt ({} where there is none: an install
    from a wheel, which carries no constraints)."""
    if not path.is_file():
        return {}
    pins = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return dict(pin.split("==", 1) for pin in pins if "==" in pin)


def untested(want: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Package -> (tested, installed) for each installed package of `want` at another version."""
    found = {}
    for name, version in want.items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional one (the CUDA plugin on a CPU machine)
        if installed != version:
            found[name] = (version, installed)
    return found


def warning(want: dict[str, str] | None = None) -> str | None:
    """One line naming the packages at versions CI did not test, and the fix; None if there are none."""
    found = untested(tested() if want is None else want)
    if not found:
        return None
    named = ", ".join(f"{name} {got} (tested {pin})" for name, (pin, got) in sorted(found.items()))
    return (
        f"untested versions: {named}; if this run misbehaves, install the tested ones: "
        "pip install -c constraints.txt -e ."
    )
