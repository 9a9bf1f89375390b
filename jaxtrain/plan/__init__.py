"""GPU jobs planned without a GPU: `targets` (GPU targets, each figure with its source, their
deviceless topology, the CUDA plugin), `compiled` (what a compiled step needs on its target:
bytes, kernels, collectives, a step-time bound), `planner` (a job built and compiled for a target,
the nearest settings that fit, the search) and `cli` (scripts/plan.py's command line)."""
