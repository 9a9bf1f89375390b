"""Every test runs on CPU with 8 fake devices unless it starts its own processes."""

import os

# Must be set before jax is imported anywhere in the test session.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
