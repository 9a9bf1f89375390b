"""Every test runs on CPU with 8 fake devices unless it starts its own processes."""

import atexit
import os
import shutil
import tempfile

# Must be set before jax is imported anywhere in the test session.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# The session's own cache (compiled steps, the default dataset, token scans): tests never fill
# the user's ~/.cache/jaxtrain, and each session starts cold. Building the dataset takes ~1 s.
_cache = tempfile.mkdtemp(prefix="jaxtrain-test-cache-")
os.environ["XDG_CACHE_HOME"] = _cache
atexit.register(shutil.rmtree, _cache, ignore_errors=True)
