"""Every test runs on CPU with 8 fake devices unless it starts its own processes."""

import atexit
import os
import shutil
import tempfile

import pytest
from processes import FAST_COMPILE
from stores import gcs, s3  # noqa: F401  (the object stores' session fixtures, shared by every file)

from jaxtrain.plan.targets import plugin_dir

# Must be set before jax is imported anywhere in the test session.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# torch.compile (tests/test_bench.py's peer) compiles in-process: a pool of compile workers, each
# importing torch, costs more CPU than it saves on 2 cores. The step it times is the same.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# The session's own cache (compiled steps, the default dataset, token scans): tests never fill
# the user's ~/.cache/jaxtrain, and each session starts cold. Building the dataset takes ~1 s.
# The CUDA plugin is the exception: it stays in the user's cache (make gpu-plugin), found there first.
# pytest-xdist's workers inherit the controller's environment: they share its cache, so a step one
# worker compiled (in-process or in a process it started) is read from disk by the other.
os.environ.setdefault("JAXTRAIN_CUDA_PLUGIN", str(plugin_dir()))
if "PYTEST_XDIST_WORKER" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxtrain-test-cache-")
    os.environ["XDG_CACHE_HOME"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
# Steps compiled in this process go to the same cache: a program another test or worker already
# compiled (the same tiny model under the same mesh, again and again) is read back.
from jaxtrain.xla_env import enable_compile_cache  # noqa: E402  (after the environment above)

enable_compile_cache("")


def pytest_sessionfinish(session, exitstatus):
    """With JAXTRAIN_CI set (.ci/run), a skipped test fails the run: CI runs as root with SLURM,
    network namespaces, Open MPI, torch, transformers and the CUDA plugin, so a skip there hides a
    broken install step. (Every skip's reason is printed either way: addopts -rs.)"""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if os.environ.get("JAXTRAIN_CI") and skipped:
        reporter.write_line(
            f"JAXTRAIN_CI: {len(skipped)} test(s) skipped where CI has every dependency", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# Files whose tests share one machine-wide resource: one SLURM cluster, network namespaces, mounts
# and loop devices, longest first. Under pytest-xdist (make test: `-n 2 --dist loadgroup`) each such file runs
# its tests one at a time on one worker, beside everything else.
SERIAL = ("test_slurm.py", "test_multihost.py", "test_storage.py")


# tryfirst: xdist's hook on the worker (registered after this file) reads the group marks to keep a
# group on one worker; after it, the marks came too late and a file's tests were split over both
# workers (two SLURM set-ups raced, and one munged refused to start).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        grouped = item.get_closest_marker("xdist_group") is not None  # a group of its own (oom_advice)
        if item.path.name in SERIAL or (_shares_a_module_fixture(item) and not grouped):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    # The serial files first: each is a chain of minutes on one worker, and dealt out last (in
    # name order) they ran alone at the end while the other worker sat idle. Then the other
    # grouped files, then the single tests, which fill in at the end beside whatever runs long.
    # The sort is stable: every file keeps its own order.
    items.sort(key=_deal_order)


def _shares_a_module_fixture(item) -> bool:
    """A test using a module-scoped fixture (a reference run, a compiled model) runs on the worker
    its file's other tests run on: split over two workers, each built the fixture (measured: 10 of
    them, about 130 s of set-up run twice in one suite)."""
    defs = getattr(item, "_fixtureinfo", None)
    return defs is not None and any(d.scope == "module" for ds in defs.name2fixturedefs.values() for d in ds)


def _deal_order(item) -> tuple[int, int]:
    if item.path.name in SERIAL:
        return SERIAL.index(item.path.name), 0
    return len(SERIAL), 0 if item.get_closest_marker("xdist_group") is not None else 1


def pytest_collection_finish(session):
    """Refuse to run when xdist did not group the serial files (a pytest or xdist upgrade has
    broken loadgroup before, silently: see pyproject.toml), rather than race on their resources."""
    if getattr(session.config.option, "loadgroup", False):
        loose = [i.nodeid for i in session.items if i.path.name in SERIAL and "@" not in i.nodeid]
        if loose:
            raise pytest.UsageError(f"--dist loadgroup did not group {loose[0]}: pin pytest/xdist")
