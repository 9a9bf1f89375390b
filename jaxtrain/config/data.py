"""How the data keys name their sources: a token file, glob, comma list or manifest, or a YAML
list of {path, weight, name} for a mixture (train_data_path, valid_data_path, test_data_path);
and the token dtypes a run may read. Parsed here, checked with the config; opened in jaxtrain/data/.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from jaxtrain.errors import DataError

TOKEN_DTYPES = ("auto", "uint16", "uint32")  # auto: the header's, else text.format.token_dtype_for


@dataclass(frozen=True)
class SourceSpec:
    """One entry of a data path setting."""

    path: str
    weight: float
    name: str


def parse_spec(spec: str, key: str) -> list[SourceSpec]:
    """The sources of a data path setting (`key` names it in errors); one source unless a YAML list."""
    if not spec.lstrip().startswith("["):
        return [SourceSpec(spec, 1.0, _default_name(spec))]
    try:
        items = yaml.safe_load(spec)
    except yaml.YAMLError:
        items = None
    example = "[{path: a/manifest.json, weight: 0.7}, {path: b/*.bin, weight: 0.3}]"
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise DataError(f"{key} must be a path or a list of sources like {example}, got {spec!r}")
    out: list[SourceSpec] = []
    for i, item in enumerate(items):
        extra = set(item) - {"path", "weight", "name"}
        path, weight, name = item.get("path"), item.get("weight", 1.0), item.get("name")
        if extra or not isinstance(path, str) or not path:
            raise DataError(
                f"{key} source {i} must have a path and only path/weight/name keys, got {item!r}; "
                f"e.g. {example}"
            )
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise DataError(f"{key} source {i} ({path}) needs a weight > 0, got {weight!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise DataError(f"{key} source {i} ({path}) has name {name!r}; use a non-empty string")
        out.append(SourceSpec(path, float(weight), name or ""))
    defaults = [_default_name(s.path) for s in out]
    for i, s in enumerate(out):
        if not s.name:  # a default name taken twice (paths in same-named folders) gets its index
            unique = defaults.count(defaults[i]) == 1 and defaults[i]
            out[i] = SourceSpec(s.path, s.weight, unique or f"{defaults[i]}{i}")
    if len({s.name for s in out}) < len(out):
        raise DataError(f"{key} sources must have distinct names, got {[s.name for s in out]}")
    return out


def _default_name(path: str) -> str:
    """A short label for a source: its folder's name (data/web/train_*.bin -> web)."""
    first = Path(path.split(",")[0].strip())
    return first.parent.name or first.stem
