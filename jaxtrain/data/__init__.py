"""Token data for training: token files, shards, manifests and mixtures, validated once
(sources.py), the global batch order and per-process loaders (loader.py), the embedded default
dataset and a run's data paths and tokenizer (default.py). The files' format is
jaxtrain/text/format.py; turning text into them, jaxtrain/prepare/."""
