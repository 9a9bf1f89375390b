"""GPU jobs planned without a GPU: `targets` (GPU targets, each figure with its source, their
deviceless topology, the CUDA plugin) and `compiled` (what a compiled step needs on its target:
bytes, kernels, collectives, a step-time bound)."""
