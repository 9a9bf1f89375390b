"""Loading a run configuration: YAML file, then command-line overrides, then checks.

    cfg = load_config(["--config", "configs/tiny.yaml", "--batch_size", "64", "--optim.lr=3e-4"])

A flag is a dotted path (`--optim.lr`) or, when unambiguous, a bare leaf name (`--lr`); the
guides' spellings are aliases (ALIASES). `--help` prints every key of the schema by section, with
its default and the comment the schema gives it.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import re
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from jaxtrain.config.checks import check, refuse_urls
from jaxtrain.config.schema import (
    SOURCE_LISTS,
    Config,
    ConfigError,
    ModelConfig,
    MoeConfig,
    flatten,
    to_dict,
)

# Other names for our keys, as the PyTorch guides spell them (docs/launching.md).
ALIASES = {
    "max_seq_len": "model.seq_len",  # nanochat's name
    "num_workers": "data_threads",
    "grad_accumulation_steps": "gradient_accumulation_steps",
    "debug": "verbose",
}
# What other configs call a key's last part (Hugging Face's config.json, Megatron, MaxText): only
# suggested after an unknown key, as `top_k` names the sampling key here, not the MoE router's.
_SUGGEST = {
    "top_k": "experts_per_token", "num_experts_per_tok": "experts_per_token",
    "moe_router_topk": "experts_per_token", "num_experts": "n_experts", "num_local_experts": "n_experts",
    "num_layers": "n_layer", "num_hidden_layers": "n_layer", "hidden_size": "d_model",
    "intermediate_size": "d_ff", "num_attention_heads": "n_head", "num_key_value_heads": "n_kv_head",
    "max_position_embeddings": "seq_len",
}  # fmt: skip


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _leaf_paths(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every settable dotted path of a config class, with its type."""
    out: dict[str, Any] = {}
    for name, typ in _fields(cls).items():
        if isinstance(typ, type) and dataclasses.is_dataclass(typ):
            out.update(_leaf_paths(typ, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = typ
    return out


_PATHS = _leaf_paths(Config)


def _resolve_key(key: str) -> str:
    """Map a flag or YAML key to its dotted path: exact path, or a unique leaf name."""
    key = key.replace("-", "_")
    key = ALIASES.get(key, key)
    if key in _PATHS:
        return key
    matches = [p for p in _PATHS if p.rsplit(".", 1)[-1] == key]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise ConfigError(f"'{key}' is ambiguous: write one of {', '.join(matches)}")
    near = _nearest(key)
    hint = f" (did you mean '{near}'?)" if near else ""
    raise ConfigError(f"unknown config key '{key}'{hint}; scripts/train.py --help lists every key")


def _nearest(key: str) -> str | None:
    """The key an unknown one most likely meant: another config's name for it (in its section,
    where one is given), else the closest spelling."""
    section, _, leaf = key.rpartition(".")
    named = [p for p in _PATHS if p.rsplit(".", 1)[-1] == _SUGGEST.get(leaf) and p.startswith(section)]
    near = named or difflib.get_close_matches(key, list(_PATHS), n=1)
    near = near or difflib.get_close_matches(key, [p.rsplit(".", 1)[-1] for p in _PATHS], n=1)
    return near[0] if near else None


def _convert(path: str, typ: Any, value: Any) -> Any:
    """Coerce a YAML or string value to the field's type, or raise naming the key."""
    if isinstance(typ, types.UnionType):  # only `X | None` style unions are not used here
        typ = next(t for t in typing.get_args(typ) if t is not type(None))
    if typ is bool:
        if isinstance(value, bool):
            return value
        s = str(value).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                f = float(value)
                if f == int(f):
                    return int(f)
            except ValueError:
                pass
        if isinstance(value, float) and value == int(value):
            return int(value)
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif typ is str:
        if value is None:
            return ""
        if isinstance(value, list) and path in SOURCE_LISTS:  # a mixture, kept as its YAML text
            return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=2**16).strip()
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"config key '{path}' must be {typ.__name__}, got {value!r}")


def _read_yaml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} not found; pass an existing --config FILE.yaml")
    try:
        data = yaml.safe_load(p.read_text())  # safe: never constructs Python objects
    except yaml.constructor.ConstructorError as e:
        raise ConfigError(
            f"config file {path} uses a YAML tag that would build an object ({e.problem}); "
            "write plain values only"
        ) from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        raise ConfigError(f"config file {path} is not valid YAML{line}; fix its syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys to values")
    return flatten(data)


def _parse_argv(argv: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Split argv into the --config file and (key, raw value) overrides, in order."""
    config_file = None
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument '{arg}'; flags look like --key value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or nxt.startswith("--"):
                value = "true"  # a bare flag switches a bool on
                if key != "config" and _PATHS.get(_resolve_key(key)) is not bool:
                    raise ConfigError(f"flag --{key} needs a value: --{key} VALUE")
            else:
                value, i = nxt, i + 1
        if key == "config":
            config_file = value
        else:
            overrides.append((key, value))
        i += 1
    return config_file, overrides


def _build(cls: type, flat: dict[str, Any], prefix: str = "") -> Any:
    kwargs = {}
    for name, typ in _fields(cls).items():
        if isinstance(typ, type) and dataclasses.is_dataclass(typ):
            kwargs[name] = _build(typ, flat, f"{prefix}{name}.")
        elif f"{prefix}{name}" in flat:
            kwargs[name] = flat[f"{prefix}{name}"]
    return cls(**kwargs)


# What --depth sets (see Config.depth).
_DEPTH_KEYS = ("model.n_layer", "model.d_model", "model.n_head", "optim.lr")


def _sized_by_depth(flat: dict[str, Any]) -> dict[str, Any]:
    """nanochat's sizing from `depth` beneath the keys given (as nanochat's base_train does it)."""
    depth = flat.get("depth", 0)
    if depth <= 0:
        return flat
    d_model = flat.get("model.d_model", 64 * depth)  # aspect ratio 64
    derived = {
        "model.n_layer": depth,
        "model.d_model": d_model,
        "model.n_head": max(1, math.ceil(d_model / 128)),  # head dim 128
        # nanochat's (unembedding) AdamW lr, scaled like 1/sqrt(width) from its 768-wide base
        "optim.lr": 0.004 * (d_model / 768) ** -0.5,
    }
    return {**derived, **flat}


Fill = Callable[[dict[str, Any]], dict[str, Any]]


def from_dict(values: dict[str, Any], fill: Fill | None = None) -> Config:
    """Build and check a Config from a (possibly nested) mapping of keys to values.

    `fill` maps the given keys (dotted) to the keys to build from; scripts pass
    jaxtrain.hf.config.with_hf_model, which reads --init_from hf:DIR's config.json for the model
    keys. Without it nothing is read: a config is built from what it was given."""
    flat: dict[str, Any] = {}
    for key, value in flatten(values).items():
        path = _resolve_key(key)
        flat[path] = _convert(path, _PATHS[path], value)
    flat = _sized_by_depth(flat)
    refuse_urls(flat)  # before `fill` reads an hf:DIR
    if fill is not None:
        flat = fill(flat)
    cfg = _build(Config, flat)
    check(cfg)
    if cfg.compat.single_gpu and not cfg.dist.local_device_ids:
        cfg = dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, local_device_ids="0"))
    return cfg


def load_config(argv: list[str], usage: str = "", fill: Fill | None = None) -> Config:
    """Config from `--config FILE` plus command-line overrides (the command line wins); `--help`
    prints `usage` and every key, then exits. `fill`: see from_dict."""
    if "--help" in argv or "-h" in argv:
        print(help_text(usage))
        sys.exit(0)
    config_file, overrides = _parse_argv(argv)
    values = _read_yaml(config_file) if config_file else {}
    merged = {_resolve_key(k): v for k, v in values.items()}
    if any(_resolve_key(k) == "depth" for k, _ in overrides):
        # --depth resizes the file's model; keys given beside it on the command line still win.
        merged = {k: v for k, v in merged.items() if k not in _DEPTH_KEYS}
    for key, raw in overrides:
        merged[_resolve_key(key)] = raw
    return from_dict(merged, fill)


def saved_model(saved: dict[str, Any]) -> ModelConfig:
    """The model of a config saved with a checkpoint (its meta's `config`); keys this version does
    not know (a checkpoint of another jaxtrain) are left out, missing ones take their defaults."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model = {k: v for k, v in saved.get("model", {}).items() if k in fields}
    if isinstance(model.get("moe"), dict):
        moe_fields = {f.name for f in dataclasses.fields(MoeConfig)}
        model["moe"] = MoeConfig(**{k: v for k, v in model["moe"].items() if k in moe_fields})
    return ModelConfig(**model)


def differences(cfg: Config) -> dict[str, Any]:
    """The keys whose values differ from the schema's defaults (what the user chose)."""
    default = flatten(to_dict(Config()))
    return {k: v for k, v in flatten(to_dict(cfg)).items() if default.get(k) != v}


_FIELD = re.compile(r"^\s{4}(\w+): [^=]+?(?: = (.+?))?\s*(?:#\s*(.*))?$")


def _comments(cls: type) -> dict[str, str]:
    """Each field's comment in the schema's source: on its line, else the comment lines above it."""
    out: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# "))
            continue
        match = _FIELD.match(line)
        if match:
            out[match.group(1)] = match.group(3) or " ".join(above)
        above = []
    return out


def help_text(usage: str = "") -> str:
    """Every key by section: --key (default) and its meaning, from the schema itself."""
    lines = [usage.strip(), ""] if usage else []
    lines.append("Every key is a flag (--key VALUE, --section.key=VALUE) or a YAML key of --config FILE.")

    def section(cls: type, prefix: str) -> None:
        comments = _comments(cls)
        nested = []
        lines.append(
            f"\n{prefix.rstrip('.') or 'run'}:"
            + (f"  {cls.__doc__.splitlines()[0]}" if cls.__doc__ and prefix else "")
        )
        for name, typ in _fields(cls).items():
            if isinstance(typ, type) and dataclasses.is_dataclass(typ):
                nested.append((typ, f"{prefix}{name}."))
                continue
            default = getattr(cls(), name)
            lines.append(f"  --{prefix}{name} ({default!r})  {comments.get(name, '')}".rstrip())
        for typ, sub in nested:
            section(typ, sub)

    section(Config, "")
    aliases = ", ".join(f"--{a} = --{p}" for a, p in ALIASES.items())
    lines.append(f"\naliases: {aliases}")
    return "\n".join(lines)
