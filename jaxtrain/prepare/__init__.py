"""Text to token files, what scripts/prepare_data.py runs: the format of token files and
manifests (format.py, which jaxtrain/data/ reads), inputs cut into work units (inputs.py),
tokenized and written as shards with a manifest (shards.py). Imports nothing of training."""
