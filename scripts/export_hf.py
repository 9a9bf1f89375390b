"""Export a jaxtrain checkpoint as a Hugging Face model dir (transformers, vLLM, llama.cpp read it).

    python scripts/export_hf.py runs/llama_tiny --out hf/llama_tiny          # the run's latest step
    python scripts/export_hf.py runs/x/checkpoints/300 --out hf/x --dtype bfloat16 --max_shard_gb 5

Writes config.json (LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM, as the model options
are), model.safetensors (or shards with model.safetensors.index.json past --max_shard_gb),
tokenizer.json + tokenizer_config.json (+ chat_template.jinja for a chat model, as transformers 5
saves it), generation_config.json. One process, CPU only: params are
read one at a time, so host memory stays near the largest param. Then:
    AutoModelForCausalLM.from_pretrained("hf/llama_tiny")
"""

import argparse
import json
import os
import sys
from pathlib import Path

from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.errors import UserError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a run dir, its checkpoints/ dir, or one step dir")
    parser.add_argument("--out", required=True, help="the Hugging Face model dir to write")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--max_shard_gb", type=float, default=5.0, help="safetensors file size limit")
    return parser.parse_args(sys.argv[1:] if argv is None else argv)


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.max_shard_gb <= 0:
        raise UserError(f"--max_shard_gb must be > 0, got {args.max_shard_gb}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the export never needs an accelerator
    from jaxtrain.hf.export import export  # imports jax

    result = export(args.checkpoint, Path(args.out), int(args.max_shard_gb * 2**30), args.dtype)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
