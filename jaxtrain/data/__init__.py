"""Token data for training: the format (format.py), token files, shards, manifests and mixtures
(sources.py), the global batch order and per-process loaders (loader.py), the default dataset and
a run's data paths (default.py). Turning text into token files is jaxtrain/prepare/."""
