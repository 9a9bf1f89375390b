"""Text to token files, what scripts/prepare_data.py runs: inputs cut into work units (inputs.py),
tokenized and written as shards with a manifest (shards.py), or conversations rendered with a chat
template, masked and packed (chat.py), in the format of jaxtrain/text/format.py, which
jaxtrain/data/ reads. Imports nothing of training."""
