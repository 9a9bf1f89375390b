"""The run configuration: its schema (schema.py), its value checks (checks.py) and how it is loaded
from YAML and flags (load.py)."""

from jaxtrain.config.checks import check, mesh_str, profile_processes, profile_range
from jaxtrain.config.compat import compat_notes
from jaxtrain.config.load import differences, from_dict, help_text, load_config, saved_model
from jaxtrain.config.schema import (
    MESH_AXES,
    CompatConfig,
    Config,
    ConfigError,
    DistConfig,
    MeshConfig,
    ModelConfig,
    MoeConfig,
    OptimConfig,
    epoch_at,
    flatten,
    global_rows,
    to_dict,
    to_yaml,
)

__all__ = [
    "MESH_AXES", "CompatConfig", "Config", "ConfigError", "DistConfig", "MeshConfig", "ModelConfig",
    "MoeConfig",
    "OptimConfig", "check", "compat_notes", "differences", "epoch_at", "flatten", "from_dict",
    "global_rows", "help_text", "load_config", "profile_processes", "profile_range", "saved_model", "to_dict",
    "to_yaml", "mesh_str",
]  # fmt: skip
