"""The Makefile's targets as a developer runs them: `make gpu-plugin` says where the plugin is,
`make test-fast` runs the fast tier only."""

import os
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _make(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """make in the repo, the venv taken as installed (-o: its stamp is never remade here)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")} | env
    return subprocess.run(
        ["make", "-o", ".venv/.installed-stamp", *args],
        cwd=ROOT, env=clean, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_gpu_plugin_says_where_it_is_when_it_is_installed(tmp_path):
    """Once installed, `make gpu-plugin` said nothing: one line now, where it is."""
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / ".complete").touch()
    out = _make("gpu-plugin", JAXTRAIN_CUDA_PLUGIN=str(plugin))
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"the CUDA plugin is installed: {plugin}\n"


def test_test_fast_runs_the_fast_tier_of_files_that_exist():
    """`make test-fast`: the named files (each there), in two workers, their slow, multi-process,
    SLURM and namespace tests left out."""
    out = _make("-n", "test-fast")
    assert out.returncode == 0, out.stderr
    words = shlex.split(out.stdout.replace("\\\n", " ").splitlines()[-1])
    assert words[1:4] == ["-m", "pytest", "-q"] and "-n" in words
    assert words[words.index("-m", 2) + 1] == "not slow and not multiprocess and not slurm and not multihost"
    files = [w for w in words if w.startswith("tests/")]
    assert "tests/test_make.py" in files and all((ROOT / f).is_file() for f in files), files
