"""Text to token files, what scripts/prepare_data.py runs: inputs cut into work units (inputs.py),
tokenized and written as shards with a manifest (shards.py). Imports nothing of training."""
