"""The run configuration: its schema (schema.py) and how it is loaded from YAML and flags (load.py)."""

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
    check,
    compat_notes,
    epoch_at,
    flatten,
    global_rows,
    profile_processes,
    profile_range,
    to_dict,
    to_yaml,
    with_data,
)

__all__ = [
    "MESH_AXES", "CompatConfig", "Config", "ConfigError", "DistConfig", "MeshConfig", "ModelConfig",
    "MoeConfig",
    "OptimConfig", "check", "compat_notes", "differences", "epoch_at", "flatten", "from_dict",
    "global_rows", "help_text", "load_config", "profile_processes", "profile_range", "saved_model", "to_dict",
    "to_yaml", "with_data",
]  # fmt: skip
