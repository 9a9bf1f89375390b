"""The command line of scripts/export_hf.py (whose docstring is its --help). jax is imported only
once the export starts, so --help and a bad flag answer at once."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from jaxtrain.disk import bucket
from jaxtrain.errors import UserError
from jaxtrain.parser import Parser


def parse_args(argv: list[str] | None = None, usage: str = "") -> argparse.Namespace:
    raw = argparse.RawDescriptionHelpFormatter  # the usage's examples as written
    p = Parser(prog="scripts/export_hf.py", description=usage, formatter_class=raw)
    p.add_argument("checkpoint", help="a run dir, its checkpoints/ dir, or one step dir")
    p.add_argument(
        "--out",
        required=True,
        help="the Hugging Face model dir to write: a folder, or a gs:// or s3:// prefix",
    )
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--max_shard_gb", type=float, default=5.0, help="safetensors file size limit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None, usage: str = "") -> None:
    args = parse_args(argv, usage)
    if args.max_shard_gb <= 0:
        raise UserError(f"--max_shard_gb must be > 0, got {args.max_shard_gb}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the export never needs an accelerator
    from jaxtrain.hf.export import export  # imports jax

    out = args.out if bucket.is_url(args.out) else Path(args.out)  # (a Path would fold a URL's //)
    result = export(args.checkpoint, out, int(args.max_shard_gb * 2**30), args.dtype)
    print(json.dumps(result))
