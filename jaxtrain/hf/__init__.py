"""Hugging Face checkpoints in and out: Llama, Mistral, Qwen2 and Qwen3 causal LMs.

    --init_from hf:DIR               train from a Hugging Face model dir (config.json, *.safetensors)
    --task test|predict --resume_from hf:DIR
    scripts/export_hf.py RUN_DIR|CHECKPOINT --out DIR

config.py maps architectures to ModelConfig and back, weights.py names every tensor (one table,
read both ways), store.py reads and writes safetensors files, load.py and export.py use them.
"""

from jaxtrain.config.origin import PREFIX, hf_dir, is_hf

__all__ = ["PREFIX", "hf_dir", "is_hf"]
