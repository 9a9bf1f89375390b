"""Export a jaxtrain checkpoint as a Hugging Face model dir (transformers, vLLM, llama.cpp read it).

    python scripts/export_hf.py runs/llama_tiny --out hf/llama_tiny          # the run's latest step
    python scripts/export_hf.py runs/x/checkpoints/300 --out hf/x --dtype bfloat16 --max_shard_gb 5

Writes config.json (LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM, as the model options
are), model.safetensors (or shards with model.safetensors.index.json past --max_shard_gb),
tokenizer.json + tokenizer_config.json (+ chat_template.jinja for a chat model, as transformers 5
saves it), generation_config.json. One process, CPU only: params are
read one at a time, so host memory stays near the largest param. Then:
    AutoModelForCausalLM.from_pretrained("hf/llama_tiny")

--out may be a bucket (gs://BUCKET/PATH, s3://BUCKET/PATH; the checkpoint too): the files are
staged under $TMPDIR, each safetensors file put as soon as it is complete, config.json last, and
a failure removes what was put (docs/object_storage.md). --resume_from hf:s3://BUCKET/PATH reads
it there (--task test|predict|chat).
"""

import sys

from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.hf.cli import main

if __name__ == "__main__":
    exit_on_user_error(main)(sys.argv[1:], __doc__ or "")
